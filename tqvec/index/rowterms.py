"""The per-row terms an index pairs with a codec's estimate of <q, x> (computed once, at add
time): N(x), the squared norm an L2 or cosine score divides or subtracts, and the centred inner
product's exact correction. Why each is what it is: ``tqvec.index.flat``'s module docstring."""

from __future__ import annotations

import torch

from ..codecs.base import Codec, Codes
from .metrics import METRIC_INNER_PRODUCT

__all__ = ["sqnorms_of", "ip_row_correction", "ROW_BLOCK"]

#: Rows decoded at once where a term needs the reconstruction.
ROW_BLOCK = 16384


def sqnorms_of(codec: Codec, codes: Codes, scoring: int, device: torch.device) -> torch.Tensor:
    """N(x) per row: the reconstruction's ||x_hat||^2 for the biased estimators, the true
    ||x||^2 for the unbiased ones; for an inner product, ||x_hat||^2 / ||x||^2 of the codecs that
    store the norm (their score is rescaled to it) and empty otherwise (used unscaled)."""
    if scoring == METRIC_INNER_PRODUCT:
        if codec.unbiased_ip:
            return torch.empty(0, dtype=torch.float32, device=device)
        try:
            true = codec.true_sqnorms(codes).to(device)
        except NotImplementedError:  # e.g. PolarQuant: ||x_hat|| is its stored radius
            return torch.empty(0, dtype=torch.float32, device=device)
        rec = codec.reconstruction_sqnorms(codes).to(device)
        # A zero vector (true = rec = 0) keeps the scale 1.
        return torch.where(true > 0, rec / true.clamp_min(1e-30), torch.ones_like(rec))
    if codec.unbiased_ip:
        return codec.true_sqnorms(codes).to(device)
    return codec.reconstruction_sqnorms(codes).to(device)


def ip_row_correction(codec: Codec, codes: Codes, y: torch.Tensor, v: torch.Tensor,
                      est_v: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """a_i <v_i, y_i> - est<v_i, y_i> per row: y (n, d) the rows the codes hold, v (d,) or
    (n, d) the vector whose product with them is known exactly (the center, an IVF row's
    centroid), est_v (n,) the index's estimate of <v_i, y_i> (``weight`` times the codec's
    score; None: 1). a = 1 for unbiased estimators, else est<y_i, y_i> / ||y_i||^2."""
    exact = (y * v).sum(1) if v.dim() == 2 else y @ v
    if codec.unbiased_ip:
        return (exact - est_v).to(torch.float32)
    est_y = torch.empty_like(exact)  # <y_i, decode_i> (a codec's score is <q, decode>), by blocks
    for s in range(0, len(codes), ROW_BLOCK):
        e = min(len(codes), s + ROW_BLOCK)
        est_y[s:e] = (y[s:e] * codec.decode(codes[s:e]).to(y.device, torch.float32)).sum(1)
    if weight is not None:
        est_y = est_y * weight
    sq = (y * y).sum(1)
    a = torch.where(sq > 0, est_y / sq.clamp_min(1e-30), torch.zeros_like(sq))
    return (a * exact - est_v).to(torch.float32)
