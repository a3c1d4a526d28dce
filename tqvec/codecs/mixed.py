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
h (2 i_lo - 15) + 16 h (2 i_hi - 15). So the run's estimator is one 4-bit term over 2 n_g
coordinates - its code bytes as they are, read as nibbles (lo_0, hi_0, lo_1, hi_1, ...), the
centroids h (2 j - 15), the query (q_0, 16 q_0, q_1, 16 q_1, ...) - and every run of the codec
is one term with a fast-scan layout (``ops.fast_scan_terms``). The terms come in run order, so a
prefix of them is the code of the leading runs, which an index's ``prefilter`` scans first
(``first_pass_terms``). (The run's two nibbles as two terms, with a 7-bit table each, cost a
second pass over the blocks; the high nibbles alone make a 4-bit code of the leading
components, and a first pass over them lost recall: docs/benchmarks.md.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import _validate as V
from .. import ops
from .base import Codec, Codes, LutTerm, register
from .turbo import TurboQuant

__all__ = ["MixedTurboQuant", "MIXED_WIDTHS", "mixed_code_size"]

MIXED_WIDTHS = (0, 1, 2, 3, 4, 8)


def mixed_code_size(groups: Any) -> int:
    """Bytes per vector of ``MixedTurboQuant(d, groups)``: each coded run's packed codes and its
    float16 scale (what ``code_size`` gives, without building the runs' codecs)."""
    return sum(ops.row_bytes(int(n), int(b)) + 2 for n, b in groups if b)


@register
class MixedTurboQuant(Codec):
    """TurboQuant on runs of coordinates at their own widths (see the module docstring).

    Parameters
    ----------
    dim: vector dimension d.
    groups: sequence of (n_g, b_g): run lengths (summing to d) and widths in (0, 1, 2, 3, 4,
        8); a run with b_g > 0 needs n_g >= 2. At most 8 coded runs (one scan term each).
    seed: run g's rotation uses ``seed + g``.
    first_runs: how many leading coded runs a two-stage search's first pass reads (an index's
        ``prefilter``; ``first_pass_terms``); None (default): the runs of 4 bits or more, at
        least one - where the widths follow the energy, the runs that hold most of it.
        ``PCAIndex`` sets it from the variances.
    backend: as ``TurboQuant``.

    Stored per vector: the runs' codes (each padded to whole bytes) and one float16 scale per
    coded run.
    """

    name = "turboquant-mixed"

    def __init__(self, dim: int, groups: Any, seed: int = 0, *, first_runs: int | None = None,
                 backend: str = "auto"):
        self.dim = V.positive_int(dim, "dim", 2, V.MAX_DIM)
        self.seed = V.seed(seed)
        self.backend = V.choice(backend, "backend", ops.BACKENDS)
        try:
            gs = [(V.positive_int(n, "groups' lengths", 0, self.dim),
                   V.positive_int(b, "groups' bits", 0, 8)) for n, b in groups]
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
        if len(self._parts) > ops.MAX_SCAN_TERMS:
            raise ValueError(f"groups must have at most {ops.MAX_SCAN_TERMS} coded runs (scan "
                             f"terms), got {gs}")
        self._payload_bytes = off
        if first_runs is None:
            self.first_runs = max(1, sum(c.bits >= 4 for _, _, c in self._parts))
        else:
            self.first_runs = V.positive_int(first_runs, "first_runs", 1, len(self._parts))

    # -- description ------------------------------------------------------------------------
    @property
    def params(self) -> dict[str, Any]:
        return {"codec": self.name, "dim": self.dim, "groups": [list(g) for g in self.groups],
                "seed": self.seed, "first_runs": self.first_runs}

    @property
    def payload_bytes(self) -> int:
        return self._payload_bytes

    def _scalar_layout(self):
        return {"fit": ((len(self._parts),), torch.float16)}

    def draw_work(self) -> int:
        return sum(c.draw_work() for _, _, c in self._parts)

    def fingerprint_arrays(self):
        return [a for _, _, c in self._parts for a in c.fingerprint_arrays()]

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

    def encode_block(self, x: torch.Tensor, norms: torch.Tensor):
        payload, fits = [], []
        for start, _, c in self._parts:
            xs = x[:, start: start + c.dim].contiguous()
            p, sc = c.encode_block(xs, torch.linalg.vector_norm(xs, dim=1))
            payload.append(p)
            fits.append(sc["fit"])
        return torch.cat(payload, dim=1), {"fit": torch.stack(fits, dim=1)}

    def decode_block(self, codes: Codes) -> torch.Tensor:
        out = torch.zeros((len(codes), self.dim), dtype=torch.float32, device=codes.device)
        for start, c, sub in self._sub_codes(codes):
            out[:, start: start + c.dim] = c.decode_block(sub)
        return out

    def decoded_sqnorms(self, codes: Codes) -> torch.Tensor:
        tot = torch.zeros(len(codes), dtype=torch.float32, device=codes.device)
        for _, c, sub in self._sub_codes(codes):
            tot += c.decoded_sqnorms(sub)
        return tot

    # -- the estimator as terms -------------------------------------------------------------
    @staticmethod
    def _grid_nibbles(c: TurboQuant, dev: torch.device) -> torch.Tensor:
        """The 16 centroids h (2 j - 15) of an 8-bit grid run's nibbles (module docstring)."""
        cent = c.centroids_on(dev).to(torch.float64)
        h = (cent[1] - cent[0]) / 2
        return (h * (2 * torch.arange(16, dtype=torch.float64, device=dev) - 15)).float()

    @staticmethod
    def _nibble_query(qr: torch.Tensor) -> torch.Tensor:
        """(q_0, 16 q_0, q_1, 16 q_1, ...): an 8-bit grid run's query over its nibbles."""
        return torch.stack([qr, 16 * qr], dim=2).reshape(qr.shape[0], -1)

    def query_terms(self, q: torch.Tensor) -> list[torch.Tensor]:
        terms = []
        for start, _, c in self._parts:
            qr = c.query_terms(q[:, start: start + c.dim].contiguous())[0]
            terms.append(self._nibble_query(qr) if c.bits == 8 else qr)
        return terms

    def query_matrix(self) -> tuple[torch.Tensor, list[slice]]:
        """(M, slices): the runs' query maps as one (dim, m) float32 matrix, with
        ``query_terms(q)[t]`` equal to ``(q @ M)[:, slices[t]]`` up to float rounding - for a
        caller that folds a linear map of its own into it (``PCAIndex``: its basis, so that a
        query takes one product instead of a basis product and a rotation per run)."""
        maps = []
        for _, _, c in self._parts:
            R = c.query_terms(torch.eye(c.dim))[0]  # row i: the rotation of e_i (linear)
            maps.append(self._nibble_query(R) if c.bits == 8 else R)
        M = torch.zeros((self.dim, sum(r.shape[1] for r in maps)), dtype=torch.float32)
        slices, at = [], 0
        for (start, _, c), R in zip(self._parts, maps, strict=True):
            M[start: start + c.dim, at: at + R.shape[1]] = R
            slices.append(slice(at, at + R.shape[1]))
            at += R.shape[1]
        return M, slices

    def code_terms(self, codes: Codes) -> list[tuple[torch.Tensor, torch.Tensor]]:
        terms = []
        for _, c, sub in self._sub_codes(codes):
            if c.bits != 8:
                terms += c.code_terms(sub)
                continue
            nib = ops.unpack_bits(sub.payload.contiguous(), 2 * c.dim, 4, self.backend).long()
            terms.append((self._grid_nibbles(c, codes.device)[nib], c.multiplier(sub)))
        return terms

    def lut_term_bits(self) -> list[int]:
        return [4 if c.bits == 8 else c.bits for _, _, c in self._parts]

    def first_pass_terms(self) -> int:
        """The terms of the first ``first_runs`` coded runs (one per run)."""
        return self.first_runs

    def lut_terms(self, codes: Codes) -> list[LutTerm]:
        terms = []
        for _, c, sub in self._sub_codes(codes):
            if c.bits != 8:
                terms += c.lut_terms(sub)
                continue
            # the code bytes are the nibbles' packed 4-bit row (low nibble first)
            terms.append(LutTerm(sub.payload, 2 * c.dim, 4, self._grid_nibbles(c, codes.device),
                                 c.multiplier(sub).to(torch.float32)))
        return terms
