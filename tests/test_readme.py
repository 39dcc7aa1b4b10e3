"""Every ```python block of README.md runs on CPU as written. Blocks run in order in one shared
namespace, as a reader pasting them into one session would."""

import re
import sys
import types
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.slow(s=222)
def test_readme_snippets_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the Trainer example writes its output directory here
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3, "README lost its code examples"
    module = types.ModuleType("readme")  # a real module: Dynamo (2.11) imports the code's __name__
    monkeypatch.setitem(sys.modules, "readme", module)
    namespace = module.__dict__
    torch._dynamo.reset()
    for index, code in enumerate(blocks):
        exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    torch._dynamo.reset()
