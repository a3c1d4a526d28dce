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
        # workers at nice 0, not Ray's 15 (tests/test_distributed.py says why)
        monkeypatch.setenv("RAY_worker_niceness", "0")
    monkeypatch.chdir(tmp_path)
    for code in _blocks(page):
        exec(compile(code, page, "exec"), {})


def _links(page: str) -> list[str]:
    """Relative link targets of a markdown page (no scheme, no bare anchors), anchors cut."""
    text = re.sub(r"```.*?```", "", (ROOT / page).read_text(), flags=re.S)
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        out.append(target.split("#")[0])
    return out


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve_in_the_repository(page):
    """Every relative link of the README and the docs names a file of the repository, read
    where it lies (the site's hook maps ../bench/results/ to its results/ folder)."""
    folder = (ROOT / page).parent
    broken = [t for t in _links(page) if not (folder / t).exists()]
    assert not broken, f"{page}: {broken}"


def test_api_reference_lists_each_class_public_surface():
    """docs/api.md names, per class, members that exist (inherited ones included: the codecs'
    encode/decode/score, the indexes' add/search), every index class among them, and none of
    the methods the library's layers call on each other."""
    import importlib

    text = (ROOT / "docs" / "api.md").read_text()
    blocks = re.findall(r"^::: (\S+)\n((?:    .*\n)*)", text, re.M)
    named = {}
    for path, opts in blocks:
        module, _, name = path.rpartition(".")
        if module == "tqvec.distributed":
            pytest.importorskip("ray")
        obj = getattr(importlib.import_module(module), name)
        members = re.findall(r"^        - (\w+)$", opts, re.M)
        for m in members:
            assert hasattr(obj, m), f"{path}.{m} does not exist"
        named[path.split(".")[-1]] = set(members)
    for codec in ("TurboQuant", "QJL", "PolarQuant"):
        assert {"encode", "decode", "score"} <= named[codec]
    for index in ("FlatIndex", "IVFIndex", "PCAIndex", "GraphIndex"):
        assert {"add", "search", "remove_ids", "reset", "train"} <= named[index], index
    internal = {"install_rows", "install_graph", "search_prepared", "search_mapped", "fast_scan",
                "query_map", "encode_block", "decode_block", "lut_terms", "row_terms"}
    assert not internal & set().union(*named.values())
