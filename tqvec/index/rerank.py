"""Refinement: re-rank a scan's candidates with finer codes or the exact vectors (faiss's
``IndexRefine``), one function for every index and search route."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import ops
from ..codecs.base import Codec, Codes
from .metrics import METRIC_COSINE, METRIC_L2, metric_name

__all__ = ["check_refine", "RefineLut", "refine_lut", "rerank"]


def check_refine(refine: Codec | str | None, d: int) -> Codec | str | None:
    """A refinement argument: None, ``"flat"`` or a codec of dimension d."""
    if refine is not None and not (refine == "flat" or isinstance(refine, Codec)):
        raise ValueError(f"refine must be None, 'flat' or a tqvec codec, got {refine!r}")
    if isinstance(refine, Codec) and refine.dim != d:
        raise ValueError(f"refine codec must have dim {d}, got {refine.dim}")
    return refine


@dataclass(frozen=True)
class RefineLut:
    """A TurboQuant-mse refinement in its rotated domain (``ops.lut_rescore``): score =
    mult_j <Pi q, c[idx_j]> + add_j is the metric's similarity to the reconstruction (l2
    without ||q||^2)."""

    packed: torch.Tensor
    cents: torch.Tensor
    mult: torch.Tensor
    add: torch.Tensor
    bits: int


def refine_lut(refine: Any, ref: Codes | None, scoring: int, device: torch.device
               ) -> RefineLut | None:
    """The refinement's tables, for TurboQuant-mse refinement codes on the CPU: re-scoring
    them in the rotated domain skips an inverse rotation per candidate (decoding them was 2/3
    of a TQ1,Refine(TQ8) search). None where it does not apply."""
    if not (isinstance(refine, Codec) and refine.kernel_form() is not None
            and device.type == "cpu" and ref is not None):
        return None
    t = refine.lut_terms(ref)[0]
    rec = refine.reconstruction_sqnorms(ref).float()
    add = torch.zeros_like(rec)
    if scoring == METRIC_L2:  # 2 <q, x_hat> - ||x_hat||^2
        mult, add = 2 * t.scale, -rec
    elif scoring == METRIC_COSINE:  # <q, x_hat> / ||x_hat||
        mult = t.scale / torch.sqrt(rec).clamp_min(1e-30)
    else:
        mult = t.scale
    return RefineLut(t.packed.contiguous(), t.centroids.float().contiguous(),
                     mult.float().contiguous(), add.contiguous(), t.bits)


def rerank(q: torch.Tensor, s: np.ndarray, p: np.ndarray, refine: Any, ref: Any,
           lut: RefineLut | None, scoring: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best k of the candidate rows p (nq, kk) (scan similarities s; non-finite: none) by
    the refinement, best first, on the host: TurboQuant-mse codes by ``ops.lut_rescore``,
    exact vectors by ``ops.rescore_topk`` (the metric and the top-k in its kernel), other codecs
    by decoding and the (nq, kk) steps in numpy. Similarities: l2 as -||q - x||^2."""
    nq, kk = p.shape
    if lut is not None:  # TurboQuant-mse refinement: rotated-domain tables, fused top-k
        qc = q.cpu()
        rows = torch.from_numpy(np.where(np.isfinite(s), p, -1))
        vals, pos = ops.lut_rescore(refine.query_terms(qc)[0], lut.packed, lut.cents, lut.mult,
                                    lut.add, rows, lut.bits, min(k, kk))
        vals, pos = vals.numpy(), pos.numpy()
        if scoring == METRIC_L2:  # ops.row_sqnorms: the one-call search's (same bits)
            vals = vals - ops.row_sqnorms(qc).numpy()[:, None]
        return vals, pos
    if not isinstance(ref, Codes):  # exact vectors: the metric and the top-k in one kernel
        rows = np.where(np.isfinite(s), p, -1)
        return ops.rescore_topk_np(q.cpu().numpy(), ref.numpy(), rows, metric_name(scoring),
                                   min(k, kk))
    flat = torch.from_numpy(p.reshape(-1)).clamp_min(0).to(ref.device)
    cand = refine.decode(ref[flat]).reshape(nq, kk, refine.dim)  # -1 rows masked below
    qd = q.to(cand.device)
    ip = torch.einsum("qd,qkd->qk", qd, cand).cpu().numpy()
    sqn = (cand * cand).sum(-1).cpu().numpy()
    qn = q.cpu().numpy()
    if scoring == METRIC_L2:
        new = 2 * ip - sqn - (qn * qn).sum(1, keepdims=True)
    elif scoring == METRIC_COSINE:
        new = ip / np.maximum(np.sqrt(sqn), np.float32(1e-30))
    else:
        new = ip
    new[~np.isfinite(s)] = -np.inf
    # a full stable sort of kk (= k_factor * k) values is cheaper here than numpy's
    # partition-then-gather steps (each a call's overhead at one query)
    order = np.argsort(-new, axis=1, kind="stable")[:, :k]
    rows = np.arange(nq)[:, None]
    return new[rows, order], p[rows, order]
