"""Mixed bit widths: TurboQuant over consecutive groups of coordinates, each at its own width.

``MixedTurboQuant(dim, groups=((n_0, b_0), (n_1, b_1), ...))`` splits a vector into runs of
n_g coordinates and codes run g with its own ``TurboQuant(n_g, b_g, scale="fit",
norm_dtype="float16")`` (own seeded rotation inside the run, own least-squares scale); a run of
0 bits is dropped (decoded as zeros). The codec is fit-free like every other one: its params
fix it. It pays off when the runs carry very different energies - after a PCA basis, where
the leading components hold most of the variance and earn most of the bits (``PCAIndex``
chooses the runs and widths from a fit); on rotation-invariant data a single TurboQuant is
better (the same bits, no per-run scales).

Widths are 0-4 or 8; an 8-bit run uses the uniform grid codebook (``TurboQuant(codebook=
"grid")``), whose centroid h (2 i - 255) splits additively over the two nibbles of i:
h (32 i_hi - 240) + h (2 i_lo - 15). Its estimator therefore has two 4-bit terms, and every
term of the codec has a fast-scan layout (``ops.fast_scan_terms``, up to 8 terms).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import _validate as V
from .. import ops
from .base import Codec, Codes, register
from .turbo import TurboQuant

__all__ = ["MixedTurboQuant", "MIXED_WIDTHS", "mixed_code_size"]

MIXED_WIDTHS = (0, 1, 2, 3, 4, 8)


def mixed_code_size(groups: Any) -> int:
    """Bytes per vector of ``MixedTurboQuant(d, groups)``: each coded run's packed codes and its
    float16 scale (what ``code_size`` gives, without building the runs' codecs)."""
    return sum(ops.row_bytes(int(n), int(b)) + 2 for n, b in groups if b)


def _nibbles(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return idx >> 4, idx & 15


@register
class MixedTurboQuant(Codec):
    """TurboQuant on runs of coordinates at their own widths (see the module docstring).

    Parameters
    ----------
    dim: vector dimension d.
    groups: sequence of (n_g, b_g): run lengths (summing to d) and widths in (0, 1, 2, 3, 4,
        8); a run with b_g > 0 needs n_g >= 2. At most 6 coded runs (8 scan terms).
    seed: run g's rotation uses ``seed + g``.
    backend: as ``TurboQuant``.

    Stored per vector: the runs' codes (each padded to whole bytes) and one float16 scale per
    coded run.
    """

    name = "turboquant-mixed"

    def __init__(self, dim: int, groups: Any, seed: int = 0, *, backend: str = "auto"):
        self.dim = V.positive_int(dim, "dim", minimum=2)
        self.seed = V.seed(seed)
        self.backend = V.choice(backend, "backend", ops.BACKENDS)
        try:
            gs = [(int(n), int(b)) for n, b in groups]
        except (TypeError, ValueError) as e:
            raise TypeError(f"groups must be a sequence of (length, bits) pairs, got "
                            f"{groups!r}") from e
        if not gs or sum(n for n, _ in gs) != self.dim or any(n < 1 for n, _ in gs):
            raise ValueError(f"groups must have positive lengths summing to dim={self.dim}, "
                             f"got {gs}")
        for n, b in gs:
            if b not in MIXED_WIDTHS:
                raise ValueError(f"groups' bits must be in {MIXED_WIDTHS}, got {b}")
            if b and n < 2:
                raise ValueError(f"groups' coded runs need >= 2 coordinates, got ({n}, {b})")
        if not any(b for _, b in gs):
            raise ValueError(f"groups must code at least one run, got {gs}")
        self.groups = gs
        self._parts: list[tuple[int, int, TurboQuant]] = []  # (start, payload offset, codec)
        start = off = 0
        for g, (n, b) in enumerate(gs):
            if b:
                sub = TurboQuant(n, b, seed=self.seed + g, scale="fit", norm_dtype="float16",
                                 codebook="grid" if b == 8 else "lloyd-max",
                                 backend=self.backend)
                self._parts.append((start, off, sub))
                off += sub.payload_bytes
            start += n
        if len(self.lut_term_bits()) > 8:
            raise ValueError(f"groups must give at most 8 scan terms (an 8-bit run counts 2), "
                             f"got {gs}")
        self._payload_bytes = off

    # -- description ------------------------------------------------------------------------
    @property
    def params(self) -> dict[str, Any]:
        return {"codec": self.name, "dim": self.dim, "groups": [list(g) for g in self.groups],
                "seed": self.seed}

    @property
    def payload_bytes(self) -> int:
        return self._payload_bytes

    def _scalar_layout(self):
        return {"fit": ((len(self._parts),), torch.float16)}

    def _fingerprint_arrays(self):
        return [a for _, _, c in self._parts for a in c._fingerprint_arrays()]

    def expected_mse(self, energy: Any) -> float:
        """Predicted E||x - x_hat||^2 / E||x||^2 for runs holding the given shares of the energy
        (``energy``: one non-negative value per group): sum_g e_g D(n_g, b_g) / sum_g e_g, with
        D the run's Lloyd-Max (or grid) cost (1 for a dropped run)."""
        e = np.asarray(energy, dtype=np.float64)
        if e.shape != (len(self.groups),) or (e < 0).any():
            raise ValueError(f"energy must hold {len(self.groups)} non-negative values, got "
                             f"shape {e.shape}")
        cost, it = [], iter(self._parts)
        for _, b in self.groups:
            cost.append(next(it)[2].expected_mse if b else 1.0)
        return float((e * np.array(cost)).sum() / max(e.sum(), 1e-300))

    # -- the runs' codes --------------------------------------------------------------------
    def _sub_codes(self, codes: Codes) -> list[tuple[int, TurboQuant, Codes]]:
        fit = codes.scalars["fit"]
        out = []
        for j, (start, off, c) in enumerate(self._parts):
            out.append((start, c, Codes(codes.payload[:, off: off + c.payload_bytes],
                                        {"fit": fit[:, j]}, c.params)))
        return out

    def _encode_block(self, x: torch.Tensor, norms: torch.Tensor):
        payload, fits = [], []
        for start, _, c in self._parts:
            xs = x[:, start: start + c.dim].contiguous()
            p, sc = c._encode_block(xs, torch.linalg.vector_norm(xs, dim=1))
            payload.append(p)
            fits.append(sc["fit"])
        return torch.cat(payload, dim=1), {"fit": torch.stack(fits, dim=1)}

    def _decode_block(self, codes: Codes) -> torch.Tensor:
        out = torch.zeros((len(codes), self.dim), dtype=torch.float32, device=codes.device)
        for start, c, sub in self._sub_codes(codes):
            out[:, start: start + c.dim] = c._decode_block(sub)
        return out

    def _reconstruction_sqnorms(self, codes: Codes) -> torch.Tensor:
        tot = torch.zeros(len(codes), dtype=torch.float32, device=codes.device)
        for _, c, sub in self._sub_codes(codes):
            tot += c._reconstruction_sqnorms(sub)
        return tot

    # -- the estimator as terms -------------------------------------------------------------
    @staticmethod
    def _grid_split(c: TurboQuant, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Centroids of the high and low nibble of an 8-bit grid run (they sum to c[i])."""
        cent = c._arr.get("centroids", dev).to(torch.float64)
        h = (cent[1] - cent[0]) / 2
        j = torch.arange(16, dtype=torch.float64, device=dev)
        return (h * (32 * j - 240)).float(), (h * (2 * j - 15)).float()

    def query_terms(self, q: torch.Tensor) -> list[torch.Tensor]:
        terms = []
        for start, _, c in self._parts:
            qr = c.query_terms(q[:, start: start + c.dim].contiguous())[0]
            terms += [qr, qr] if c.bits == 8 else [qr]
        return terms

    def code_terms(self, codes: Codes) -> list[tuple[torch.Tensor, torch.Tensor]]:
        terms = []
        for _, c, sub in self._sub_codes(codes):
            m = c._multiplier(sub)
            if c.bits != 8:
                terms += c.code_terms(sub)
                continue
            hi_c, lo_c = self._grid_split(c, codes.device)
            hi, lo = _nibbles(ops.unpack_bits(sub.payload, c.dim, 8, self.backend).long())
            terms += [(hi_c[hi], m), (lo_c[lo], m)]
        return terms

    def lut_term_bits(self) -> list[int]:
        return [b for _, _, c in self._parts for b in ([4, 4] if c.bits == 8 else [c.bits])]

    def lut_terms(self, codes: Codes) -> list[tuple[torch.Tensor, int, int, torch.Tensor,
                                                   torch.Tensor]]:
        dev, terms = codes.device, []
        for _, c, sub in self._sub_codes(codes):
            m = c._multiplier(sub).to(torch.float32)
            if c.bits != 8:
                terms += c.lut_terms(sub)
                continue
            hi_c, lo_c = self._grid_split(c, dev)
            hi, lo = _nibbles(sub.payload)  # one index per byte: the nibbles are the codes
            for nib, cent in ((hi, hi_c), (lo, lo_c)):
                terms.append((ops.pack_bits(nib.contiguous(), 4, self.backend), c.dim, 4,
                              cent, m))
        return terms
