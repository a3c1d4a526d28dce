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

def _code_refinement(ref_codes: tuple | None) -> dict | None:
    """The compiled searchers' ``refine_codes`` from ``ref_codes`` = (rotate, packed, b,
    centroids, mult, add); None for no such refinement. Raises LookupError where the rotation
    is not a compiled Hadamard one."""
    if ref_codes is None:
        return None
    rot, packed, b, cents, mult, add = ref_codes
    if rot.host is None:
        raise LookupError("the refinement's rotation has no compiled form")
    perms, signs = rot.host

    def as_np(t: Any, dt: Any) -> np.ndarray:
        return np.ascontiguousarray(t.numpy() if isinstance(t, torch.Tensor) else t, dt)

    return dict(rotation=(perms, signs, int(rot.p)), packed=as_np(packed, np.uint8), bits=int(b),
                centroids=as_np(cents, np.float32), mult=as_np(mult, np.float32),
                add=as_np(add, np.float32))


def _optional(x: Any) -> np.ndarray | None:
    return None if x is None else np.ascontiguousarray(x, np.float32)


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
        if rotate.host is None or scan.host is None or len(scan.bits) != 1 or scan.n == 0:
            return None
        try:
            refine_codes = _code_refinement(ref_codes)
        except LookupError:
            return None
        perms, signs = rotate.host
        h = scan.host
        prefilter_arg = None
        if h.full is not None:
            packed, bfull, cfull, add1, mult1 = h.full
            prefilter_arg = dict(keep=int(prefilter), packed=packed, bits=int(bfull),
                                 centroids=cfull, first_add=add1, first_mult=mult1)
        searcher = ops.compiled_flat_searcher(
            rotation=(perms, signs, rotate.p), blocked=h.blocked[0], n=scan.n,
            bits=scan.bits[0], centroids=h.centroids[0], mult=h.mults[0], add=h.add,
            ids=np.ascontiguousarray(ids, np.int64), metric=ops.RESCORE_METRICS.index(metric),
            prefilter=prefilter_arg, center=_optional(center), normalize=bool(normalize),
            ip_center=_optional(ip_center), refine_x=_optional(ref_x), refine_codes=refine_codes)
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
        h = scan.host
        if h is None or scan.n == 0 or (scan.first and prefilter < 1):
            return None
        searcher = ops.compiled_terms_searcher(
            W=np.ascontiguousarray(W.numpy(), np.float32), cols=[sl.start for sl in slices],
            blocked=h.blocked, centroids=h.centroids, mults=h.mults, bits=list(scan.bits),
            n=scan.n, add=h.add, ids=np.ascontiguousarray(ids, np.int64),
            metric=ops.RESCORE_METRICS.index(metric), nfirst=int(scan.first),
            prefilter=int(prefilter), packed=list(h.packed or []), center=_optional(center),
            normalize=bool(normalize), ip_center=_optional(ip_center))
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
        if probe.host is None or rotate.host is None or scan.host is None:
            return None
        if probe.l2 != (metric != "ip"):
            raise ValueError("probe.l2 must be True exactly for the l2 and cosine metrics")
        try:
            refine_codes = _code_refinement(ref_codes)
        except LookupError:
            return None
        cen, csq = probe.host
        perms, signs = rotate.host
        blocked, codebook, mult, add, list_blocks = scan.host
        searcher = ops.compiled_ivf_searcher(
            centroids=cen, centroid_norms=csq, rotation=(perms, signs, rotate.p), blocked=blocked,
            bits=scan.b, codebook=codebook, mult=mult, add=add, list_blocks=list_blocks,
            pos=np.ascontiguousarray(pos, np.int64), ids=np.ascontiguousarray(ids, np.int64),
            metric=ops.RESCORE_METRICS.index(metric),
            refine_x=None if ref is None else ref.to(torch.float32).contiguous().numpy(),
            refine_codes=refine_codes)
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
