"""Whole searches in one compiled call: each an implementation of its index's composed search
(prepare the query -> rotate -> scan -> re-rank -> ids and distances), with the same float
operations as the composition, so that the two agree bit for bit; the index chooses it, where
its parts all run on the compiled CPU kernels, for float32 numpy queries (at one query the
Python steps between the kernels cost more than the kernels).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import ops

__all__ = ["FlatSearch", "TermsSearch", "IVFSearch"]


def _refinement(ref_codes: tuple | None) -> ops.CodeRefinement | None:
    return None if ref_codes is None else ops.CodeRefinement(*ref_codes)


class FlatSearch:
    """A whole flat search of float32 numpy queries in one compiled call: minus ``center`` or
    rows to unit norm (``normalize``, by ``row_sqnorms``; optional) -> ``HadamardRotate`` ->
    ``FastScan.search`` (one mse term; two-stage with a prefilter) -> for l2 the score minus
    ``row_sqnorms`` -> ``(D, I)`` as faiss returns them (plus ``row_dots(q, ip_center)``
    where given: a centred inner-product index's <q, mu>), with the same float operations as
    the composed ops (the flat index's general path), so the same bits.
    ``prepare`` returns None where the parts do not all run on the compiled CPU kernels."""

    def __init__(self, searcher: Any):
        self._searcher = searcher

    @classmethod
    def prepare(cls, rotate: ops.HadamardRotate, scan: ops.FastScan, ids: np.ndarray, metric: str,
                prefilter: int = 0, center: np.ndarray | None = None, normalize: bool = False,
                ip_center: np.ndarray | None = None, ref_x: np.ndarray | None = None,
                ref_codes: tuple | None = None) -> FlatSearch | None:
        """``ref_x`` (n, d) float32 exact vectors or ``ref_codes`` = (rotate, packed, b,
        centroids, mult, add) TurboQuant-mse codes: a refinement of k_factor k candidates that
        the scan ranks by its tables alone (``rescore_topk`` / ``lut_rescore``; no prefilter)."""
        if metric not in ops.RESCORE_METRICS:
            raise ValueError(f"metric must be one of {list(ops.RESCORE_METRICS)}, got {metric!r}")
        args = ops.FlatSearchArgs(scan, ids, metric, int(prefilter), center, bool(normalize),
                                  ip_center, rotate=rotate, ref_x=ref_x,
                                  ref_codes=_refinement(ref_codes))
        searcher = ops.prepare("flat_search_fused", args, scan.device, scan.backend)
        return None if searcher is None else cls(searcher)

    def search(self, q: np.ndarray, k: int, k_factor: int = 1
               ) -> tuple[np.ndarray, np.ndarray] | None:
        """q (nq, d) C-contiguous float32 (``center``, ``normalize`` and ``ip_center``, where
        given, apply here; l2 then subtracts ``row_sqnorms`` of the result); with a refinement,
        k_factor k candidates re-scored -> (D (nq, k) float32, I (nq, k) int64); None if q holds
        a NaN or an infinity."""
        D = np.empty((q.shape[0], k), dtype=np.float32)
        I = np.empty((q.shape[0], k), dtype=np.int64)
        if not self._searcher.search(q, D, I, ops.threads(), int(k_factor)):
            return None
        return D, I


class TermsSearch:
    """A whole search of float32 numpy queries of another space mapped into a flat index's
    terms by one product (``PCAIndex``: its basis and every run's rotation in W) in one compiled
    call: unit rows (``normalize``) or minus ``center`` -> ``ops.row_project`` (x W) -> each
    term's columns -> ``FastScan.search`` over the terms (two stages with a prefilter) -> for
    l2 the score minus ``row_sqnorms`` -> ``(D, I)`` as faiss returns them (plus
    ``row_dots(q, ip_center)`` where given), with the float operations of the composed ops
    (``FlatIndex.search_prepared`` with the PCA index's ``prepare``), so the same bits.
    ``prepare`` returns None where the scan is not on the compiled CPU kernels."""

    def __init__(self, searcher: Any):
        self._searcher = searcher  # holds (and keeps alive) the arrays it reads

    @classmethod
    def prepare(cls, W: torch.Tensor, slices: list[slice], scan: ops.FastScan, ids: np.ndarray,
                metric: str, prefilter: int = 0, center: np.ndarray | None = None,
                normalize: bool = False, ip_center: np.ndarray | None = None
                ) -> TermsSearch | None:
        if metric not in ops.RESCORE_METRICS:
            raise ValueError(f"metric must be one of {list(ops.RESCORE_METRICS)}, got {metric!r}")
        args = ops.TermsSearchArgs(scan, ids, metric, int(prefilter), center, bool(normalize),
                                   ip_center, W=W, slices=list(slices))
        searcher = ops.prepare("terms_search_fused", args, scan.device, scan.backend)
        return None if searcher is None else cls(searcher)

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """q (nq, d) C-contiguous float32 -> (D (nq, k) float32, I (nq, k) int64); None if q
        holds a NaN or an infinity."""
        D = np.empty((q.shape[0], k), dtype=np.float32)
        I = np.empty((q.shape[0], k), dtype=np.int64)
        if not self._searcher.search(q, D, I, ops.threads()):
            return None
        return D, I


class IVFSearch:
    """A whole IVF search of a few float32 numpy queries in one compiled call: the composition
    ``IVFProbe.probe`` -> ``HadamardRotate`` -> ``IVFFastScan.search`` (approximate with a
    refinement) -> padded rows to positions (``pos``) -> ``rescore_topk`` with exact vectors
    ``ref`` or ``lut_rescore`` with codes ``ref_codes`` -> ``(D, I)`` as faiss returns them (L2
    distances, ``ids[position]``, padding), with the same float operations as the composed ops
    (the IVF index's general path), so the same bits. At
    one query the Python steps between those kernels cost more than the kernels. Build it with
    ``prepare``, which returns None where the parts do not all run on the compiled CPU kernels."""

    def __init__(self, searcher: Any):
        self._searcher = searcher  # holds (and keeps alive) the arrays it reads

    @classmethod
    def prepare(cls, probe: ops.IVFProbe, rotate: ops.HadamardRotate, scan: ops.IVFFastScan,
                pos: np.ndarray, ids: np.ndarray, ref: torch.Tensor | None, metric: str,
                ref_codes: tuple | None = None) -> IVFSearch | None:
        """``ref`` (n, d) exact vectors or ``ref_codes`` = (rotate, packed, b, centroids, mult,
        add) TurboQuant-mse codes (``FlatSearch.prepare``'s): the refinement, or neither."""
        if metric not in ops.RESCORE_METRICS:
            raise ValueError(f"metric must be one of {list(ops.RESCORE_METRICS)}, got {metric!r}")
        if probe.l2 != (metric != "ip"):
            raise ValueError("probe.l2 must be True exactly for the l2 and cosine metrics")
        args = ops.IVFSearchArgs(probe, rotate, scan, pos, ids, metric, ref,
                                 _refinement(ref_codes))
        searcher = ops.prepare("ivf_search_fused", args, scan.device, scan.backend)
        return None if searcher is None else cls(searcher)

    def search(self, q: np.ndarray, nprobe: int, kk: int, k: int
               ) -> tuple[np.ndarray, np.ndarray] | None:
        """q (nq, d) C-contiguous float32; kk candidates per query (k * k_factor with a
        refinement, else k, at most ntotal) -> (D (nq, k) float32, I (nq, k) int64); None if q
        holds a NaN or an infinity."""
        D = np.empty((q.shape[0], k), dtype=np.float32)
        I = np.empty((q.shape[0], k), dtype=np.int64)
        if not self._searcher.search(q, nprobe, kk, D, I, ops.threads()):
            return None
        return D, I

    def candidates(self, q: np.ndarray, nprobe: int, kk: int,
                   probes: tuple[np.ndarray, np.ndarray] | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """What ``search`` ranks, as the index's ``search_candidates`` returns it: (scan,
        final, I) (nq, kk) - the scan's kk best rows re-ranked by the refinement, best first,
        with their scan and refined similarities (no refinement: both the scan's) and ids; -inf
        and -1 past the rows there are. ``probes``: ``IVFIndex.probe``'s (lists, offsets) for q
        (a coordinator's), else probed here. None if q holds a NaN or an infinity."""
        nq = q.shape[0]
        scan = np.empty((nq, kk), dtype=np.float32)
        final = np.empty((nq, kk), dtype=np.float32)
        I = np.empty((nq, kk), dtype=np.int64)
        lists, offsets = (None, None) if probes is None else (
            np.ascontiguousarray(probes[0], np.int64), np.ascontiguousarray(probes[1], np.float32))
        if lists is not None:
            nprobe = lists.shape[1]
        if not self._searcher.candidates(q, nprobe, lists, offsets, scan, final, I,
                                         ops.threads()):
            return None
        return scan, final, I
