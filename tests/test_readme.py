"""The README's and the docs' Python examples must run as written (each page in its own
temporary folder): documentation that does not run is a bug."""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))


def _blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)


def test_readme_example_runs(tmp_path, monkeypatch):
    blocks = _blocks("README.md")
    assert blocks, "README has no python example"
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
    assert os.path.exists("codes.tqc") and os.path.exists("x.tqv")


@pytest.mark.parametrize("page", [p for p in PAGES[1:] if _blocks(p)])
def test_docs_examples_run(page, tmp_path, monkeypatch):
    if "transformers" in (ROOT / page).read_text():
        pytest.importorskip("transformers")
    if "import ray" in (ROOT / page).read_text():
        pytest.importorskip("ray")
    monkeypatch.chdir(tmp_path)
    for code in _blocks(page):
        exec(compile(code, page, "exec"), {})
