"""PolarQuant (Zhang, Zandieh 2025): random preconditioning + recursive polar transform.

After a random rotation, x/||x|| is uniform on the sphere, so its polar angles have the same
law as those of a Gaussian vector (they depend on the direction only): level 1 angles
atan2(y_{2i+1}, y_{2i}) are uniform on [0, 2pi), level-l angles atan2(r_{2i+1}, r_{2i}) of
pairs of level-(l-1) radii have density ∝ sin^(k-1)(2 psi) on [0, pi/2] (k = 2^(l-1)), and all
are independent (PolarQuant Lemma 2). Each level is quantized with its own Lloyd-Max codebook
(tqvec.codebooks.angle_codebook); the d / 2^L radii left after L levels are stored (float16 by
default), as in the paper: default level bits (4, 2, 2, 2) cost 2.875 bits/coord for the angles
plus 16 / 16 = 1 bit/coord of radii = 3.875 bits/coordinate.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from .. import _validate as V
from .. import ops
from ..codebooks import Codebook, angle_codebook, polar_expected_mse
from ..random import ROTATIONS, Rotation, haar_check, make_rotation, rotation_work
from ._common import DeviceCache
from .base import Codec, Codes, register, store_norm

__all__ = ["PolarQuant"]

_RADIUS_DTYPES = {"float16": torch.float16, "float32": torch.float32}


@register
class PolarQuant(Codec):
    """PolarQuant codec.

    Parameters
    ----------
    dim: d, divisible by 2^L where L = len(level_bits).
    level_bits: bits of the angles at levels 1..L (default (4, 2, 2, 2), the paper's choice).
    seed, rotation, rounds: the preconditioning rotation (as TurboQuant).
    radius_dtype: ``"float16"`` (default, as the paper) or ``"float32"`` for the d/2^L radii.
    """

    name = "polarquant"

    def __init__(self, dim: int, level_bits: Any = (4, 2, 2, 2), seed: int = 0, *,
                 rotation: str = "hadamard", rounds: int = 3, radius_dtype: str = "float16",
                 backend: str = "auto"):
        self.dim = V.positive_int(dim, "dim", 2, V.MAX_DIM)
        if isinstance(level_bits, (int, np.integer)) or not len(level_bits):
            raise ValueError(f"level_bits must be a non-empty sequence of ints in 1..8, got "
                             f"{level_bits!r}")
        self.level_bits = tuple(V.positive_int(b, "level_bits[i]", 1, 8) for b in level_bits)
        L = len(self.level_bits)
        if self.dim % (1 << L):
            raise ValueError(f"dim must be divisible by 2^{L} = {1 << L} for {L} polar levels, "
                             f"got dim={self.dim} (use fewer levels or pad the vectors)")
        self.seed = V.seed(seed)
        self.rotation = V.choice(rotation, "rotation", ROTATIONS)
        self.rounds = V.positive_int(rounds, "rounds", 1, 16)
        self.radius_dtype = V.choice(radius_dtype, "radius_dtype", tuple(_RADIUS_DTYPES))
        self.backend = V.choice(backend, "backend", ops.BACKENDS)
        if self.rotation == "haar":  # refused now, drawn at first use
            haar_check(self.dim)
        self._counts = [self.dim >> lv for lv in range(1, L + 1)]  # angles per level
        self._bytes = [ops.row_bytes(c, b) for c, b in zip(self._counts, self.level_bits,
                                                            strict=True)]
        self.n_radii = self.dim >> L

    @functools.cached_property
    def _rot(self) -> Rotation:
        return make_rotation(self.rotation, self.dim, self.seed,
                             self.rounds if self.rotation == "hadamard" else 3)

    @functools.cached_property
    def codebooks(self) -> list[Codebook]:
        """The angle codebook of each level."""
        return [angle_codebook(lv, b) for lv, b in enumerate(self.level_bits, 1)]

    @functools.cached_property
    def _arr(self) -> DeviceCache:
        arrays = {}
        for lv, cb in enumerate(self.codebooks, 1):
            arrays[f"c{lv}"] = cb.centroids.astype(np.float32)
            arrays[f"t{lv}"] = cb.thresholds.astype(np.float32)
        return DeviceCache(**arrays)

    @property
    def params(self) -> dict[str, Any]:
        p: dict[str, Any] = {"codec": self.name, "dim": self.dim,
                             "level_bits": list(self.level_bits), "seed": self.seed,
                             "rotation": self.rotation, "radius_dtype": self.radius_dtype}
        if self.rotation == "hadamard":
            p["rounds"] = self.rounds
        return p

    @property
    def payload_bytes(self) -> int:
        return sum(self._bytes)

    def _scalar_layout(self):
        return {"radii": ((self.n_radii,), _RADIUS_DTYPES[self.radius_dtype])}

    def draw_work(self) -> int:
        return rotation_work(self.rotation, self.dim, self.rounds)

    def fingerprint_arrays(self):
        return ([np.frombuffer(self._rot.fingerprint().encode(), np.uint8)]
                + [a.numpy() for a in self._arr.host.values()])

    @property
    def expected_mse(self) -> float:
        """Predicted E||x - x_hat||^2 / ||x||^2 from the codebooks (exact radii)."""
        return polar_expected_mse(self.level_bits)

    def encode_block(self, x: torch.Tensor, norms: torch.Tensor):
        dev = x.device
        y = self._rot.apply(x)
        parts = []
        r = y
        for lv, b in enumerate(self.level_bits, 1):
            a, c = r[:, 0::2], r[:, 1::2]
            psi = torch.atan2(c, a)
            if lv == 1:
                psi = torch.where(psi < 0, psi + 2 * math.pi, psi)
            idx = torch.searchsorted(self._arr.get(f"t{lv}", dev), psi.contiguous(), right=True)
            parts.append(ops.pack_bits(idx.clamp_(max=(1 << b) - 1).to(torch.uint8), b,
                                       self.backend))
            r = torch.hypot(a, c)
        radii = store_norm(r, _RADIUS_DTYPES[self.radius_dtype], "radii", "radius_dtype")
        return torch.cat(parts, dim=1), {"radii": radii}

    def _rotated(self, codes: Codes) -> torch.Tensor:
        dev = codes.device
        offs = np.concatenate([[0], np.cumsum(self._bytes)])
        r = codes.scalars["radii"].float()
        for lv in range(len(self.level_bits), 0, -1):
            b = self.level_bits[lv - 1]
            idx = ops.unpack_bits(codes.payload[:, offs[lv - 1]: offs[lv]], self._counts[lv - 1],
                                  b, self.backend)
            psi = self._arr.get(f"c{lv}", dev)[idx.long()]
            r = torch.stack((r * torch.cos(psi), r * torch.sin(psi)), dim=2).reshape(len(codes), -1)
        return r

    def decoded_sqnorms(self, codes: Codes) -> torch.Tensor:
        # Polar reconstruction keeps the stored radii exactly: ||x_hat||^2 = sum of radii^2.
        return (codes.scalars["radii"].float() ** 2).sum(1)

    def decode_block(self, codes: Codes) -> torch.Tensor:
        return self._rot.inverse(self._rotated(codes).contiguous())

    def _prepare_queries(self, q: torch.Tensor):
        return self._rot.apply(q)

    def _score_block(self, qr, codes: Codes) -> torch.Tensor:
        # Decoded per block in the rotated domain (no inverse rotation), then one GEMM.
        return qr @ self._rotated(codes).T
