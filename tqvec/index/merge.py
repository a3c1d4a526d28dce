"""Merging the searches of several indexes that hold disjoint parts of one collection into the
result one index over all of it returns (faiss's ``IndexShards``, made exact under a
refinement): each part answers ``search_candidates``; ``merge_candidates`` takes the best
``candidates`` rows by the scan's similarity over all parts - the rows one index's scan would
hand its refinement - and of those the best k by the refined similarity. Under a refinement
that re-ranking may also run after the merge, once per row instead of once per part's
candidate: ``merge_scans`` picks the best candidates from the parts' ``scan_candidates``, each
part re-ranks its own (``refine_candidates``) and ``merge_refined`` ranks them - the same result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .metrics import METRIC_L2, padded, range_results

__all__ = ["merge_candidates", "merge_ranges", "merge_refined", "merge_scans"]


def _check_parts(parts: Sequence[tuple[np.ndarray, ...]], what: str) -> None:
    if not parts:
        raise ValueError(f"parts must hold at least one {what} result, got none")
    nq = parts[0][0].shape[0]
    for j, (a, b, c) in enumerate(parts):
        if not a.shape == b.shape == c.shape or a.ndim != 2 or a.shape[0] != nq:
            raise ValueError(f"parts[{j}] must be three ({nq}, m) arrays, got shapes "
                             f"{a.shape}, {b.shape}, {c.shape}")


def merge_candidates(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], k: int,
                     candidates: int, metric_type: int) -> tuple[np.ndarray, np.ndarray]:
    """faiss's ``(D, I)`` of k results from the parts' ``search_candidates`` (scan, final, I).

    ``candidates`` is what one index over all rows would re-rank: min(rows, k_factor k) under
    a refinement, k without one. Ties keep the parts' order, then each part's own.
    """
    _check_parts(parts, "search_candidates")
    scan = np.concatenate([p[0] for p in parts], axis=1)
    final = np.concatenate([p[1] for p in parts], axis=1)
    ids = np.concatenate([p[2] for p in parts], axis=1)
    if candidates < scan.shape[1]:  # the scan's best over every part
        top = np.argsort(-scan, axis=1, kind="stable")[:, :candidates]
        final = np.take_along_axis(final, top, 1)
        ids = np.take_along_axis(ids, top, 1)
    return merge_refined(final, ids, k, metric_type)


def merge_scans(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], candidates: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round one of a merge that re-ranks after it: of the parts' ``scan_candidates`` (scan,
    positions, I), the best ``candidates`` per query by the scan over all parts - the rows one
    index's scan would hand its refinement -, as (part, positions, I), each (nq, c): the part
    holding each, its row position there and its id (-1 in all three past the candidates
    there are), best first (ties keep the parts' order, then each part's own). Each part then
    re-ranks its own rows (``refine_candidates``), and ``merge_refined`` ranks them all."""
    _check_parts(parts, "scan_candidates")
    scan = np.concatenate([p[0] for p in parts], axis=1)
    top = np.argsort(-scan, axis=1, kind="stable")[:, :candidates]
    ok = np.isfinite(np.take_along_axis(scan, top, 1))
    part = np.concatenate([np.full(p[0].shape, j, np.int64) for j, p in enumerate(parts)],
                          axis=1)
    return tuple(np.where(ok, np.take_along_axis(a, top, 1), -1) for a in (
        part, np.concatenate([p[1] for p in parts], axis=1),
        np.concatenate([p[2] for p in parts], axis=1)))


def merge_refined(final: np.ndarray, ids: np.ndarray, k: int, metric_type: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """faiss's ``(D, I)``: the best k of merged candidates (nq, c) by their refined
    similarities ``final`` (larger is better; -inf or id -1: none), ties in the candidates'
    order."""
    nq = final.shape[0]
    D, I = padded(metric_type, nq, k)
    if final.shape[1] == 0:
        return D, I
    best = np.argsort(-final, axis=1, kind="stable")[:, :k]
    vals = np.take_along_axis(final, best, 1)
    got = np.take_along_axis(ids, best, 1)
    valid = np.isfinite(vals) & (got >= 0)
    m = vals.shape[1]
    D[:, :m] = np.where(valid, -vals if metric_type == METRIC_L2 else vals, D[:, :m])
    I[:, :m] = np.where(valid, got, -1)
    return D, I


def merge_ranges(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """faiss's ``(lims, D, I)`` of the parts' ``range_search`` results: each query's results
    from every part, in the parts' order."""
    if not parts:
        raise ValueError("parts must hold at least one range_search result, got none")
    nq = len(parts[0][0]) - 1
    per_query: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(nq)]
    for j, (lims, D, I) in enumerate(parts):
        if len(lims) != nq + 1:
            raise ValueError(f"parts[{j}] must have {nq + 1} lims, got {len(lims)}")
        for q in range(nq):
            a, b = int(lims[q]), int(lims[q + 1])
            if b > a:
                per_query[q].append((D[a:b], I[a:b]))
    return range_results(per_query)
