"""mkdocs hook: the benchmark results (bench/results/*.md, *.png, *.json, *.txt) are published
under results/ without copying them into docs/, so the pages link to the files the benchmarks
wrote. The pages link to them as ``../bench/results/...`` (a path that resolves in the
repository, read on disk or on a forge); the site rewrites it to ``results/...``."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def on_files(files: Files, config) -> Files:
    for path in sorted(RESULTS.glob("*")):
        if path.suffix in (".md", ".png", ".json", ".txt"):
            files.append(File.generated(config, f"results/{path.name}",
                                        abs_src_path=str(path)))
    return files


_REPO_LINK = re.compile(r"\]\(\.\./bench/results/")


def on_page_markdown(markdown: str, page, config, files) -> str:
    return _REPO_LINK.sub("](results/", markdown)
