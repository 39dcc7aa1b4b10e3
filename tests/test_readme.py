"""Every ```python block of README.md runs on CPU as written. The blocks of each numbered Quickstart
section (``### 1.`` to ``### 5.``) run in order in one namespace, after the first block (its
imports and the model every section uses), as a reader pasting that section into a session would;
the sections run as separate tests, so that pytest-xdist runs them side by side (one test of every
block took 217 s on the GPU box, the suite's longest)."""

import re
import sys
import types
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = re.compile(r"^### (\d+)\. ", flags=re.M)
BLOCK = re.compile(r"```python\n(.*?)```", flags=re.S)


def _sections() -> dict[str, list[tuple[int, str]]]:
    """{section number: [(block index, code), ...]} for the python blocks after ``### N.`` headings
    (a block before the first heading belongs to none)."""
    text = README.read_text()
    heads = [(m.start(), m.group(1)) for m in SECTION.finditer(text)]
    out: dict[str, list[tuple[int, str]]] = {}
    for index, m in enumerate(BLOCK.finditer(text)):
        owner = [number for start, number in heads if start < m.start()]
        if owner:
            out.setdefault(owner[-1], []).append((index, m.group(1)))
    return out


SECTIONS = _sections()


def test_readme_has_its_sections_and_examples():
    assert sorted(SECTIONS) == ["1", "2", "3", "4", "5"], "README lost a Quickstart section"
    assert sum(map(len, SECTIONS.values())) == len(BLOCK.findall(README.read_text())), \
        "a python block sits outside the numbered sections: no test runs it"
    assert len(SECTIONS["4"]) >= 3, "README lost its functional API examples"
    # an edit that cuts across a fence leaves one unpaired (94b2f42 cut the top-k section's opening one)
    fences = [line for line in README.read_text().splitlines() if line.startswith("```")]
    assert len(fences) % 2 == 0, "an unpaired ``` fence: a code block lost its opening or closing line"


@pytest.mark.slow(s=120)
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("section", sorted(SECTIONS, key=lambda n: -len(SECTIONS[n])))
def test_readme_snippets_run(section, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the Trainer example writes its output directory here
    # a real module: Dynamo (2.11) imports the code's __name__ for its guards, and one name per
    # section (a module of an earlier section, left in Dynamo's lookups on the same worker, lacked
    # section 5's globals on the GPU box)
    module = types.ModuleType(f"readme_section_{section}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    first = SECTIONS["1"][0]
    for index, code in ([first] if section != "1" else []) + SECTIONS[section]:
        exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    torch._dynamo.reset()
