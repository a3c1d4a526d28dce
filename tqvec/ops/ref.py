"""Plain-torch reference ops: each defines the meaning of the op of the same name.

Layouts: ``idx`` (n, d) uint8; ``packed`` (n, ceil(d*b/8)) uint8, row-major, LSB-first bit
stream (index j occupies stream bits [j*b, (j+1)*b); stream bit t is bit t % 8 of byte t // 8;
trailing pad bits are 0). Float inputs are float32 and contiguous (the dispatcher ensures it).
"""

from __future__ import annotations

import torch

__all__ = ["pack_bits_ref", "unpack_bits_ref", "quantize_pack_ref", "hadamard_rotate_ref",
           "row_bytes"]


def row_bytes(d: int, b: int) -> int:
    return (d * b + 7) // 8


def pack_bits_ref(idx: torch.Tensor, b: int) -> torch.Tensor:
    n, d = idx.shape
    rb = row_bytes(d, b)
    shifts = torch.arange(b, device=idx.device, dtype=torch.int32)
    bits = (idx.to(torch.int32)[..., None] >> shifts) & 1  # (n, d, b), LSB of each index first
    stream = bits.reshape(n, d * b)
    stream = torch.nn.functional.pad(stream, (0, rb * 8 - d * b))
    weights = (1 << torch.arange(8, device=idx.device, dtype=torch.int32))
    return (stream.view(n, rb, 8) * weights).sum(-1).to(torch.uint8)


def unpack_bits_ref(packed: torch.Tensor, d: int, b: int) -> torch.Tensor:
    n, rb = packed.shape
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32)[..., None] >> shifts) & 1).reshape(n, rb * 8)[:, : d * b]
    weights = (1 << torch.arange(b, device=packed.device, dtype=torch.int32))
    return (stream.reshape(n, d, b) * weights).sum(-1).to(torch.uint8)


def quantize_pack_ref(y: torch.Tensor, scale: torch.Tensor, thresholds: torch.Tensor, b: int
                      ) -> torch.Tensor:
    """Scalar-quantize ``y * scale[:, None]`` against ascending ``thresholds`` (K-1 values) and
    pack: index = #{t : thresholds[t] <= v} (TurboQuant Algorithm 1, nearest centroid, since
    the thresholds are the midpoints between centroids)."""
    v = y * scale[:, None]
    idx = torch.searchsorted(thresholds, v, right=True).to(torch.uint8)
    return pack_bits_ref(idx, b)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of the rows of x (n, p), butterfly order
    h = 1, 2, 4, ...; pairs (j, j + h) within blocks of 2h."""
    n, p = x.shape
    h = 1
    while h < p:
        v = x.reshape(n, p // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        x = torch.stack((a + b, a - b), dim=2).reshape(n, p)
        h *= 2
    return x


def hadamard_rotate_ref(x: torch.Tensor, perms: torch.Tensor, signs: torch.Tensor, p: int,
                        inverse: bool = False) -> torch.Tensor:
    """Multi-round randomized Hadamard rotation (see tqvec.random.HadamardRotation).

    Forward round r: z = x[:, perms[r]] * signs[r]; z[:, :p] = H z[:, :p] / sqrt(p); if p < d,
    z[:, d-p:] = H z[:, d-p:] / sqrt(p). The inverse runs the rounds backwards.
    """
    n, d = x.shape
    s = torch.tensor(1.0 / (p ** 0.5), dtype=torch.float32, device=x.device)
    z = x
    rounds = perms.shape[0]
    order = range(rounds - 1, -1, -1) if inverse else range(rounds)
    for r in order:
        if not inverse:
            z = z[:, perms[r]] * signs[r]
            z[:, :p] = _fwht(z[:, :p]) * s
            if p < d:
                z[:, d - p:] = _fwht(z[:, d - p:]) * s
        else:
            z = z.clone()
            if p < d:
                z[:, d - p:] = _fwht(z[:, d - p:]) * s
            z[:, :p] = _fwht(z[:, :p]) * s
            out = torch.empty_like(z)
            out[:, perms[r]] = z * signs[r]
            z = out
    return z
