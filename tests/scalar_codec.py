"""A scalar codec that is not TurboQuant, for the tests of ``Codec.kernel_form``.

``UniformScalar``: the rows' seeded Hadamard rotation, then each coordinate of the unit vector
quantized on a clipped uniform grid of 2^b cells over +-``clip`` / sqrt(d) (no codebook fitted
to the coordinates' law), the norm stored as float32 or float16. Its estimator is one
rotated-domain term, x_hat = ||x|| Pi^T c[idx], so it declares a ``KernelForm`` - and only
through that one method do the indexes and the KV cache learn that their kernels apply to it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from tqvec import ops
from tqvec.codebooks import Codebook
from tqvec.codecs.base import Codec, Codes, KernelForm, LutTerm
from tqvec.random import make_rotation


class UniformScalar(Codec):
    name = "test-uniform-scalar"

    def __init__(self, dim: int, bits: int = 2, seed: int = 0, clip: float = 2.5,
                 norm_dtype: str = "float32"):
        self.dim, self.bits, self.seed, self.clip = int(dim), int(bits), int(seed), float(clip)
        self.norm_dtype = norm_dtype
        self.backend = "auto"

    @functools.cached_property
    def _rot(self):
        return make_rotation("hadamard", self.dim, self.seed, 3)

    @functools.cached_property
    def codebook(self) -> Codebook:
        k = 1 << self.bits
        step = 2 * self.clip / np.sqrt(self.dim) / k
        centroids = (np.arange(k) + 0.5 - k / 2) * step
        thresholds = (centroids[1:] + centroids[:-1]) / 2
        return Codebook(centroids, thresholds, float("nan"))

    @property
    def params(self) -> dict[str, Any]:
        return {"codec": self.name, "dim": self.dim, "bits": self.bits, "seed": self.seed,
                "clip": self.clip, "norm_dtype": self.norm_dtype}

    @property
    def payload_bytes(self) -> int:
        return ops.row_bytes(self.dim, self.bits)

    def _scalar_layout(self):
        return {"norm": ((), getattr(torch, self.norm_dtype))}

    def fingerprint_arrays(self):
        return [self._rot.perms.numpy(), self._rot.signs.numpy()]

    # -- the form ----------------------------------------------------------------------------
    def kernel_form(self) -> KernelForm:
        return KernelForm(self.bits, "norm", True)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return self._rot.apply(x)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        return self._rot.inverse(y.contiguous())

    def query_rotation(self, device="cpu"):
        return self._rot.op(torch.device(device))

    def centroids_on(self, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(self.codebook.centroids.astype(np.float32)).to(device)

    def multiplier(self, codes: Codes) -> torch.Tensor:
        return codes.scalars["norm"].float()

    def true_sqnorms(self, codes: Codes) -> torch.Tensor:
        return codes.scalars["norm"].float() ** 2

    # -- encode / decode / terms -------------------------------------------------------------
    def encode_block(self, x: torch.Tensor, nrm: torch.Tensor):
        u = self.rotate(x) / nrm.clamp_min(1e-30)[:, None]
        th = torch.from_numpy(self.codebook.thresholds.astype(np.float32)).to(x.device)
        idx = torch.bucketize(u, th, right=True).to(torch.uint8)
        return ops.pack_bits(idx, self.bits), {"norm": nrm.to(getattr(torch, self.norm_dtype))}

    def _centroid_rows(self, codes: Codes) -> torch.Tensor:
        idx = ops.unpack_bits(codes.payload, self.dim, self.bits)
        return self.centroids_on(codes.device)[idx.long()]

    def decode_block(self, codes: Codes) -> torch.Tensor:
        return self.unrotate(self._centroid_rows(codes) * self.multiplier(codes)[:, None])

    def query_terms(self, q: torch.Tensor) -> list[torch.Tensor]:
        return [self.rotate(q)]

    def code_terms(self, codes: Codes):
        return [(self._centroid_rows(codes), self.multiplier(codes))]

    def lut_term_bits(self) -> list[int]:
        return [self.bits]

    def lut_terms(self, codes: Codes) -> list[LutTerm]:
        return [LutTerm(codes.payload, self.dim, self.bits, self.centroids_on(codes.device),
                        self.multiplier(codes))]
