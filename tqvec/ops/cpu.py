"""Compiled CPU implementations (tqvec._C); same arguments and results as ``ref.py``."""

from __future__ import annotations

import torch

from .ref import fast_scan_row_bytes, row_bytes

try:  # the compiled module is optional: tqvec.ops falls back to the reference without it
    from .. import _C
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    _C = None
    IMPORT_ERROR: ImportError | None = e
else:
    IMPORT_ERROR = None

__all__ = ["available", "pack_bits_cpu", "unpack_bits_cpu", "quantize_pack_cpu",
           "hadamard_rotate_cpu", "lut_scan_cpu", "block_codes_cpu", "fast_scan_cpu",
           "fast_scan_terms_cpu", "ivf_fast_scan_cpu", "rescore_rows_cpu"]


def available() -> bool:
    return _C is not None


def _np(*ts: torch.Tensor):
    """numpy views of CPU tensors: nanobind takes them ~2x faster than torch tensors (whose
    __dlpack__ runs Python code), which matters for one-query searches."""
    return tuple(t.numpy() for t in ts)


def _threads() -> int:
    return max(1, torch.get_num_threads())


def pack_bits_cpu(idx: torch.Tensor, b: int) -> torch.Tensor:
    n, d = idx.shape
    out = torch.empty((n, row_bytes(d, b)), dtype=torch.uint8)
    if n:
        _C.pack_bits(idx, b, out, _threads())
    return out


def unpack_bits_cpu(packed: torch.Tensor, d: int, b: int) -> torch.Tensor:
    out = torch.empty((packed.shape[0], d), dtype=torch.uint8)
    if packed.shape[0]:
        _C.unpack_bits(packed, d, b, out, _threads())
    return out


def quantize_pack_cpu(y: torch.Tensor, scale: torch.Tensor, thresholds: torch.Tensor, b: int
                      ) -> torch.Tensor:
    n, d = y.shape
    out = torch.empty((n, row_bytes(d, b)), dtype=torch.uint8)
    if n:
        _C.quantize_pack(y, scale, thresholds, b, out, _threads())
    return out


def hadamard_rotate_cpu(x: torch.Tensor, perms: torch.Tensor, signs: torch.Tensor, p: int,
                        inverse: bool = False) -> torch.Tensor:
    out = torch.empty_like(x)
    if x.shape[0]:
        x_, perms_, signs_, out_ = _np(x, perms, signs, out)
        _C.hadamard_rotate(x_, perms_, signs_, p, inverse, out_, _threads())
    return out


def lut_scan_cpu(qr: torch.Tensor, packed: torch.Tensor, centroids: torch.Tensor,
                 mult: torch.Tensor, add: torch.Tensor, b: int, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    nq = qr.shape[0]
    vals = torch.empty((nq, k), dtype=torch.float32)
    pos = torch.empty((nq, k), dtype=torch.int64)
    if nq:
        qr_, packed_, c_, mult_, add_, vals_, pos_ = _np(qr, packed, centroids, mult, add, vals,
                                                         pos)
        _C.lut_scan(qr_, packed_, c_, mult_, add_, b, k, vals_, pos_, _threads())
    return vals, pos


def block_codes_cpu(packed: torch.Tensor, d: int, b: int) -> torch.Tensor:
    n = packed.shape[0]
    out = torch.empty((-(-n // 32), fast_scan_row_bytes(d, b), 32), dtype=torch.uint8)
    if n:
        _C.block_codes(packed, d, b, out, _threads())
    return out


def fast_scan_cpu(qr: torch.Tensor, blocked: torch.Tensor, n: int, centroids: torch.Tensor,
                  mult: torch.Tensor, add: torch.Tensor, b: int, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    nq = qr.shape[0]
    vals = torch.full((nq, k), -float("inf"), dtype=torch.float32)
    pos = torch.full((nq, k), -1, dtype=torch.int64)
    if nq and n:
        qr_, bl_, c_, mult_, add_, vals_, pos_ = _np(qr, blocked, centroids, mult, add, vals, pos)
        _C.fast_scan(qr_, bl_, n, c_, mult_, add_, b, k, vals_, pos_, _threads())
    return vals, pos


def fast_scan_terms_cpu(qrs: list[torch.Tensor], blocked: list[torch.Tensor], n: int,
                        centroids: list[torch.Tensor], mults: list[torch.Tensor],
                        add: torch.Tensor, bits: list[int], k: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    nq = qrs[0].shape[0]
    vals = torch.full((nq, k), -float("inf"), dtype=torch.float32)
    pos = torch.full((nq, k), -1, dtype=torch.int64)
    if nq and n:
        add_, vals_, pos_ = _np(add, vals, pos)
        _C.fast_scan_terms(list(_np(*qrs)), list(_np(*blocked)), list(_np(*centroids)),
                           list(_np(*mults)), [int(b) for b in bits], n, add_, k, vals_, pos_,
                           _threads())
    return vals, pos


def ivf_fast_scan_cpu(qr: torch.Tensor, blocked: torch.Tensor, centroids: torch.Tensor,
                      mult: torch.Tensor, add: torch.Tensor, list_blocks: torch.Tensor,
                      probes: torch.Tensor, offsets: torch.Tensor, b: int, k: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    nq = qr.shape[0]
    vals = torch.full((nq, k), -float("inf"), dtype=torch.float32)
    pos = torch.full((nq, k), -1, dtype=torch.int64)
    if nq and blocked.shape[0]:
        arrays = _np(qr, blocked, centroids, mult, add, list_blocks, probes, offsets, vals, pos)
        _C.ivf_fast_scan(*arrays[:8], b, k, *arrays[8:], _threads())
    return vals, pos


def rescore_rows_cpu(q: torch.Tensor, x: torch.Tensor, rows: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    dot = torch.zeros(rows.shape, dtype=torch.float32)
    sqn = torch.zeros(rows.shape, dtype=torch.float32)
    if rows.numel():
        _C.rescore_rows(*_np(q, x, rows, dot, sqn), _threads())
    return dot, sqn
