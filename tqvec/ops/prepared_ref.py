"""The prepared ops' references (``prepared.py``): each factory takes an op's argument struct and
returns a runner that calls the reference ops (``ref.py``) on the struct's tensors - their
meaning, and their implementation on a device without a kernel of its own (torch on a GPU).
The fused rows' reference is ``no_fused``: the index composes its parts instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import ref as _ref

__all__ = ["hadamard_rotate_runner", "fast_scan_runner", "ivf_fast_scan_runner",
           "ivf_probe_runner", "no_fused"]


def hadamard_rotate_runner(r: Any) -> Callable:
    def run(x: torch.Tensor, inverse: bool) -> torch.Tensor:
        return _ref.hadamard_rotate_ref(x.float().contiguous(), r.perms, r.signs, r.p, inverse)
    return run


def _tensor(q: torch.Tensor) -> torch.Tensor:
    return q.contiguous()


def fast_scan_runner(s: Any) -> Callable:
    terms = s.terms

    def run(qrs: list[torch.Tensor], k: int, add: torch.Tensor | None,
            add1: torch.Tensor | None, k1: int | None, approx: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
        qrs = [_tensor(q) for q in qrs]
        add = s.add if add is None else add
        if s.full is not None:
            f, t = s.full, terms[0]
            return _ref.fast_scan_two_stage_ref(
                qrs[0], t.blocked, s.n, t.centroids, f.packed, f.bits, f.centroids, t.mult,
                add, f.first_add if add1 is None else add1, k1, k, f.first_mult, f.bound)
        if s.first:
            return _ref.fast_scan_terms_two_stage_ref(
                qrs, [t.blocked for t in terms], [t.packed for t in terms], s.n,
                [t.centroids for t in terms], [t.mult for t in terms], add, s.bits, s.first,
                k1, k)
        if len(terms) == 1:
            t = terms[0]
            return _ref.fast_scan_ref(qrs[0], t.blocked, s.n, t.centroids, t.mult, add, t.bits,
                                      k)
        return _ref.fast_scan_terms_ref(qrs, [t.blocked for t in terms], s.n,
                                        [t.centroids for t in terms], [t.mult for t in terms],
                                        add, s.bits, k)
    return run


def ivf_fast_scan_runner(s: Any) -> Callable:
    def run(qr: np.ndarray, probes: np.ndarray, offsets: np.ndarray, k: int,
            add: torch.Tensor | None, approx: bool) -> tuple[np.ndarray, np.ndarray]:
        dev = s.add.device
        vals, pos = _ref.ivf_fast_scan_ref(
            torch.from_numpy(qr).to(dev), s.blocked, s.centroids, s.mult,
            s.add if add is None else add, s.list_blocks, torch.from_numpy(probes).to(dev),
            torch.from_numpy(offsets).to(dev), s.b, k, approx)
        return vals.cpu().numpy(), pos.cpu().numpy()
    return run


def ivf_probe_runner(s: Any) -> Callable:
    def run(q: np.ndarray, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        probes, scores = _ref.ivf_probe_ref(torch.from_numpy(q).to(s.centroids.device),
                                            s.centroids, s.csq, s.l2, nprobe)
        return probes.cpu().numpy(), scores.cpu().numpy()
    return run


def no_fused(args: Any) -> None:
    """No fused form: the caller composes the parts (which is what a fused call computes)."""
    return None
