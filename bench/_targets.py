"""The fastest setting of each method reaching each recall target (the summaries of the
ann-style sweeps: bench/graph.py, bench/ivf.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

__all__ = ["fastest_at_targets"]


def fastest_at_targets(rows: list[dict], targets: Sequence[float], batch_key: str,
                       single_key: str) -> Iterator[tuple[str, float, dict, dict, dict]]:
    """(method, target, the method's first row, its fastest batch row, its fastest single row)
    for each method (in the rows' order) and each target its recall@10 reaches."""
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        for tgt in targets:
            ok = [r for r in mine if r["recall@10"] >= tgt]
            if ok:
                yield (method, tgt, mine[0], max(ok, key=lambda r: r[batch_key]),
                       max(ok, key=lambda r: r[single_key]))
