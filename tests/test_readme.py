"""The README's Python example must run as written (in a temporary folder)."""

import os
import re
from pathlib import Path


def test_readme_example_runs(tmp_path, monkeypatch):
    text = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
    assert os.path.exists("codes.tqc")
