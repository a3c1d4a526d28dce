"""The prepared ops on the compiled CPU kernels (``prepared.py``): each factory takes an op's
argument struct and returns a runner holding the numpy views the kernel reads (made once: a
view per call would weigh on a one-query search), or None where the kernel
cannot take the struct; the fused factories make one compiled searcher from an index's prepared
parts when every part runs here."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import cpu as _cpu
from .cpu import RotateKernel

__all__ = ["hadamard_rotate_runner", "fast_scan_runner", "ivf_fast_scan_runner",
           "ivf_probe_runner", "flat_search", "terms_search", "ivf_search", "graph_search"]

# the compiled searchers' metric codes (csrc/cpu/kernels.h RescoreMetric)
_METRICS = _cpu.RESCORE_METRIC_CODES


def hadamard_rotate_runner(r: Any) -> RotateKernel | None:
    if r.perms.device.type != "cpu":
        return None
    return RotateKernel(r.perms.numpy(), r.signs.numpy(), r.p)


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.numpy()


def _query(q: torch.Tensor | np.ndarray) -> np.ndarray:
    """A query term as the kernel reads it: contiguous float32 numpy."""
    if isinstance(q, np.ndarray):
        return np.ascontiguousarray(q, dtype=np.float32)
    return q.contiguous().numpy()


class FastScanKernel:
    """``FastScan`` on the compiled kernels: its arrays' numpy views."""

    compiled = True

    def __init__(self, s: Any):
        self.n, self.bits, self.first = s.n, list(s.bits), s.first
        self.blocked = [t.blocked.numpy() for t in s.terms]
        self.centroids = [t.centroids.numpy() for t in s.terms]
        self.mults = [t.mult.numpy() for t in s.terms]
        self.add = s.add.numpy()
        self.packed = [t.packed.numpy() for t in s.terms] if s.first else None
        f = s.full
        self.full = None if f is None else (f.packed.numpy(), f.bits, f.centroids.numpy(),
                                            f.first_add.numpy(), _np(f.first_mult))
        self.bound = None if f is None else f.bound

    def __call__(self, qrs: list, k: int, add: torch.Tensor | None, add1: torch.Tensor | None,
                 k1: int | None, approx: bool) -> tuple[torch.Tensor, torch.Tensor]:
        add_np = self.add if add is None else add.numpy()
        if self.full is not None:
            packed, b, cents, first_add, first_mult = self.full
            vals, pos = _cpu.fast_scan_two_stage_np(
                _query(qrs[0]), self.blocked[0], self.n, self.centroids[0], packed, b, cents,
                self.mults[0], add_np, first_add if add1 is None else add1.numpy(), int(k1),
                k, first_mult, self.bound)
        else:
            vals, pos = _cpu.fast_scan_np([_query(q) for q in qrs], self.blocked, self.n,
                                          self.centroids, self.mults, add_np, self.bits, k,
                                          approx, packed=self.packed, first=self.first,
                                          k1=int(k1 or 0))
        return torch.from_numpy(vals), torch.from_numpy(pos)


def fast_scan_runner(s: Any) -> FastScanKernel | None:
    return FastScanKernel(s) if s.add.device.type == "cpu" else None


class IVFScanKernel:
    """``IVFFastScan`` on the compiled kernel: the lists' numpy views."""

    compiled = True

    def __init__(self, s: Any):
        self.b = s.b
        self.blocked, self.centroids, self.mult, self.add, self.list_blocks = _cpu.host_views(
            s.blocked, s.centroids, s.mult, s.add, s.list_blocks)

    def __call__(self, qr: np.ndarray, probes: np.ndarray, offsets: np.ndarray, k: int,
                 add: torch.Tensor | None, approx: bool) -> tuple[np.ndarray, np.ndarray]:
        return _cpu.ivf_fast_scan_np(qr, self.blocked, self.centroids, self.mult,
                                     self.add if add is None else add.numpy(), self.list_blocks,
                                     probes, offsets, self.b, k, approx)


def ivf_fast_scan_runner(s: Any) -> IVFScanKernel | None:
    return IVFScanKernel(s) if s.add.device.type == "cpu" else None


class ProbeKernel:
    """``IVFProbe`` on the compiled kernel: the centroids' numpy views."""

    compiled = True

    def __init__(self, s: Any):
        self.centroids, self.csq, self.l2 = s.centroids.numpy(), s.csq.numpy(), s.l2

    def __call__(self, q: np.ndarray, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        return _cpu.ivf_probe_np(q, self.centroids, self.csq, self.l2, nprobe)


def ivf_probe_runner(s: Any) -> ProbeKernel | None:
    return ProbeKernel(s) if s.centroids.device.type == "cpu" else None


# -- fused searches ------------------------------------------------------------------------------

def _rotation(r: Any) -> tuple | None:
    """A prepared rotation's (perms, signs, p) where the compiled kernel runs it, else None."""
    k = getattr(r, "runner", None)
    return (k.perms, k.signs, k.p) if isinstance(k, RotateKernel) else None


def _f32(x: Any) -> np.ndarray | None:
    if x is None:
        return None
    return np.ascontiguousarray(x.numpy() if isinstance(x, torch.Tensor) else x, np.float32)


def _code_refinement(rc: Any) -> dict | None | bool:
    """A ``CodeRefinement`` as the compiled searchers' ``refine_codes``; None for none, False
    where its rotation has no compiled form."""
    if rc is None:
        return None
    rot = _rotation(rc.rotate)
    if rot is None:
        return False

    def as_np(t: Any, dt: Any) -> np.ndarray:
        return np.ascontiguousarray(t.numpy() if isinstance(t, torch.Tensor) else t, dt)

    return dict(rotation=rot, packed=as_np(rc.packed, np.uint8), bits=int(rc.bits),
                centroids=as_np(rc.centroids, np.float32), mult=as_np(rc.mult, np.float32),
                add=as_np(rc.add, np.float32))


def _ids(ids: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(ids, np.int64)


def flat_search(a: Any) -> object | None:
    """The one-call flat search (csrc/cpu/search.cpp ``flat_search``; keyword arguments:
    csrc/cpu/bind/searchers.cpp) over a ``FlatSearchArgs``, or None where a part does not run
    on the compiled kernels."""
    rot, scan = _rotation(a.rotate), a.scan.runner
    if rot is None or not isinstance(scan, FastScanKernel) or len(scan.bits) != 1 \
            or scan.n == 0:
        return None
    refine_codes = _code_refinement(a.ref_codes)
    if refine_codes is False:
        return None
    prefilter = None
    if scan.full is not None:
        packed, bfull, cfull, add1, mult1 = scan.full
        sigma, gain, cnorm, min_sin = scan.bound or (0.0, 1.0, 1.0, 0.0)
        prefilter = _cpu.compiled().Prefilter(
            keep=int(a.prefilter), packed=packed, bits=int(bfull), centroids=cfull,
            first_add=add1, first_mult=mult1, bound_sigma=sigma, bound_gain=gain,
            bound_cnorm=cnorm, bound_min_sin=min_sin)
    return _cpu.compiled().FlatSearcher(
        rotation=_cpu.rotation(rot), prefilter=prefilter,
        refine_codes=_cpu.code_refinement(refine_codes), blocked=scan.blocked[0], n=scan.n,
        bits=scan.bits[0], centroids=scan.centroids[0], mult=scan.mults[0], add=scan.add,
        ids=_ids(a.ids), metric=_METRICS[a.metric], center=_f32(a.center),
        normalize=bool(a.normalize), ip_center=_f32(a.ip_center), refine_x=_f32(a.ref_x))


def terms_search(a: Any) -> object | None:
    """The one-call search through one query product (``terms_search``; keyword arguments:
    csrc/cpu/bind/searchers.cpp ``TermsSearcher``) over a ``TermsSearchArgs``."""
    scan = a.scan.runner
    if not isinstance(scan, FastScanKernel) or scan.n == 0 or (scan.first and a.prefilter < 1):
        return None
    return _cpu.compiled().TermsSearcher(
        W=np.ascontiguousarray(a.W.numpy(), np.float32), cols=[sl.start for sl in a.slices],
        blocked=scan.blocked, centroids=scan.centroids, mults=scan.mults, bits=scan.bits,
        n=scan.n, add=scan.add, ids=_ids(a.ids), metric=_METRICS[a.metric],
        nfirst=int(scan.first), prefilter=int(a.prefilter), packed=list(scan.packed or []),
        center=_f32(a.center), normalize=bool(a.normalize), ip_center=_f32(a.ip_center))


def ivf_search(a: Any) -> object | None:
    """The one-call IVF search (``ivf_search``) over an ``IVFSearchArgs``."""
    probe, scan, rot = a.probe.runner, a.scan.runner, _rotation(a.rotate)
    if not isinstance(probe, ProbeKernel) or not isinstance(scan, IVFScanKernel) or rot is None:
        return None
    refine_codes = _code_refinement(a.ref_codes)
    if refine_codes is False:
        return None
    return _cpu.compiled().IVFSearcher(
        centroids=probe.centroids, centroid_norms=probe.csq, rotation=_cpu.rotation(rot),
        blocked=scan.blocked, bits=scan.b, codebook=scan.centroids, mult=scan.mult,
        add=scan.add, list_blocks=scan.list_blocks, pos=_ids(a.pos), ids=_ids(a.ids),
        metric=_METRICS[a.metric],
        refine_x=None if a.ref is None else a.ref.to(torch.float32).contiguous().numpy(),
        refine_codes=_cpu.code_refinement(refine_codes))


def graph_search(a: Any) -> object | None:
    """The graph search (csrc/cpu/graph.cpp ``graph_search``; keyword arguments:
    csrc/cpu/bind/graph.cpp) over a ``GraphSearchArgs``'s layers; with a compiled rotation also
    the whole search in one call (``search_full``: search.cpp ``graph_index_search``). Its
    ``whole`` says which."""
    rot = None if a.rotate is None else _rotation(a.rotate)
    whole = {}
    if rot is not None:
        whole = dict(rotation=_cpu.rotation(rot), ids=_ids(a.ids), metric=_METRICS[a.metric],
                     normalize=bool(a.normalize), refine_x=a.refine_x)
    searcher = _cpu.compiled().GraphSearcher(
        **a.layers, n=a.n, d=a.d, bits=a.bits,
        centroids=a.centroids.to(torch.float32).contiguous(), entry=a.entry, **a.entry_layer,
        **whole)
    return GraphKernel(searcher, bool(whole))


class GraphKernel:
    """The compiled graph searcher and whether it holds the whole search (``whole``)."""

    compiled = True

    def __init__(self, searcher: object, whole: bool):
        self.searcher, self.whole = searcher, whole
