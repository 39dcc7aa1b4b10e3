"""Every ```python block of README.md runs on CPU as written. Blocks run in order in one shared
namespace, as a reader pasting them into one session would."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_snippets_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the Trainer example writes its output directory here
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3, "README lost its code examples"
    namespace: dict = {"__name__": "readme"}
    torch._dynamo.reset()
    for index, code in enumerate(blocks):
        exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    torch._dynamo.reset()
