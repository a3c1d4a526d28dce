"""Small pieces the codecs share: device caches and the QJL sign term."""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import ops


class DeviceCache:
    """float32 copies of fixed CPU arrays, made once per device."""

    def __init__(self, **arrays: np.ndarray):
        #: name -> the CPU tensor (what the codec's fingerprint covers)
        self.host = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
        self._dev: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, name: str, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self.host[name]
        key = (name, device)
        if key not in self._dev:
            self._dev[key] = self.host[name].to(device)
        return self._dev[key]


def qjl_scale(m: int) -> float:
    """sqrt(pi/2) / m, the factor of the QJL estimator (QJL paper, Eq. (4))."""
    return math.sqrt(math.pi / 2) / m


def sign_pack(z: torch.Tensor, backend: str) -> torch.Tensor:
    """Pack sign(z) as bits: 1 for z >= 0 (+1), 0 for z < 0 (-1)."""
    ones = torch.ones(z.shape[0], dtype=torch.float32, device=z.device)
    zero = torch.zeros(1, dtype=torch.float32, device=z.device)
    return ops.quantize_pack(z, ones, zero, 1, backend)


def signs_pm1(packed: torch.Tensor, m: int, backend: str) -> torch.Tensor:
    """Packed sign bits -> (n, m) float32 of +-1."""
    return ops.unpack_bits(packed, m, 1, backend).to(torch.float32) * 2.0 - 1.0
