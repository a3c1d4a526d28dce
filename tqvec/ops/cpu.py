"""Compiled CPU implementations (tqvec._C); same arguments and results as ``ref.py``."""

from __future__ import annotations

import numpy as np
import torch

from . import pages
from .kvstep import KVStepPlan, compose_attention_step
from .ref import fast_scan_row_bytes, row_bytes

try:  # the compiled module is optional: tqvec.ops falls back to the reference without it
    from .. import _C
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    _C = None
    IMPORT_ERROR: ImportError | None = e
else:
    IMPORT_ERROR = None

__all__ = ["available", "threads", "simd_path", "host_views", "compiled", "rotation",
           "code_refinement", "RotateKernel",
           "RESCORE_METRIC_CODES", "pack_bits_cpu", "unpack_bits_cpu", "quantize_pack_cpu",
           "centroid_stats_cpu",
           "hadamard_rotate_cpu", "hadamard_rotate_np", "lut_scan_cpu", "lut_rescore_cpu",
           "block_codes_cpu", "block_code_rows_cpu", "fast_scan_cpu", "fast_scan_terms_cpu",
           "fast_scan_np",
           "fast_scan_terms_two_stage_cpu",
           "fast_scan_two_stage_np", "fast_scan_two_stage_cpu", "ivf_fast_scan_np",
           "ivf_fast_scan_cpu", "ivf_probe_np", "ivf_probe_cpu",
           "decode_attention_cpu", "turbo_mse_encode_cpu", "turbo_mse_decode_cpu", "kv_side",
           "step_plan", "attention_step_cpu", "EXACT_DTYPES",
           "attention_step_np", "rescore_topk_np",
           "rescore_topk_cpu"]


def available() -> bool:
    return _C is not None


def host_views(*ts: torch.Tensor) -> tuple[np.ndarray, ...]:
    """numpy views of CPU tensors: nanobind takes them faster than torch tensors (whose
    __dlpack__ runs Python code), which matters for one-query searches
    (docs/kernel-costs.md)."""
    return tuple(t.numpy() for t in ts)


_np = host_views  # the short local name


def threads() -> int:
    """The threads the kernels use: torch's setting."""
    return max(1, torch.get_num_threads())


def simd_path() -> str:
    """The fast scans' vector path on this CPU ("avx512", "avx2" or "scalar"); "none" without
    the compiled kernels."""
    return _C.simd_path() if _C is not None else "none"


def pack_bits_cpu(idx: torch.Tensor, b: int) -> torch.Tensor:
    n, d = idx.shape
    out = torch.empty((n, row_bytes(d, b)), dtype=torch.uint8)
    if n:
        _C.pack_bits(idx.numpy(), b, out.numpy(), threads())
    return out


def unpack_bits_cpu(packed: torch.Tensor, d: int, b: int) -> torch.Tensor:
    out = torch.empty((packed.shape[0], d), dtype=torch.uint8)
    if packed.shape[0]:
        _C.unpack_bits(packed.numpy(), d, b, out.numpy(), threads())
    return out


def quantize_pack_cpu(y: torch.Tensor, scale: torch.Tensor, thresholds: torch.Tensor, b: int
                      ) -> torch.Tensor:
    n, d = y.shape
    out = torch.empty((n, row_bytes(d, b)), dtype=torch.uint8)
    if n:
        _C.quantize_pack(*host_views(y, scale, thresholds), b, out.numpy(), threads())
    return out


def centroid_stats_cpu(packed: torch.Tensor, d: int, b: int, centroids: torch.Tensor,
                       y: torch.Tensor | None = None, scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = packed.shape[0]
    csq = np.empty(n, dtype=np.float32)
    dot = None if y is None else np.empty(n, dtype=np.float32)
    if n:
        _C.centroid_stats(packed.numpy(), d, b, centroids.numpy(),
                          None if y is None else y.numpy(),
                          None if scale is None else scale.numpy(), csq, dot, threads())
    return torch.from_numpy(csq), None if dot is None else torch.from_numpy(dot)


def turbo_mse_encode_cpu(x: torch.Tensor, nrm: torch.Tensor, perms: torch.Tensor,
                         signs: torch.Tensor, p: int, thresholds: torch.Tensor,
                         centroids: torch.Tensor, b: int, fit: bool
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, d = x.shape
    packed = torch.empty((n, row_bytes(d, b)), dtype=torch.uint8)
    out = torch.empty(n, dtype=torch.float32) if fit else None
    if n:
        _C.turbo_mse_encode(*host_views(x, nrm, perms, signs), p,
                            *host_views(thresholds, centroids), b, packed.numpy(),
                            None if out is None else out.numpy(), threads())
    return packed, out


def turbo_mse_decode_cpu(packed: torch.Tensor, mult: torch.Tensor, perms: torch.Tensor,
                         signs: torch.Tensor, p: int, centroids: torch.Tensor, b: int, d: int
                         ) -> torch.Tensor:
    out = np.empty((packed.shape[0], d), dtype=np.float32)
    if packed.shape[0]:
        _C.turbo_mse_decode(*host_views(packed, mult, perms, signs), p, centroids.numpy(), b,
                            out, threads())
    return torch.from_numpy(out)


def hadamard_rotate_np(x: torch.Tensor, perms: np.ndarray, signs: np.ndarray, p: int,
                       inverse: bool = False) -> torch.Tensor:
    """The kernel with the rotation's parameters already in numpy (``ops.HadamardRotate``)."""
    out = np.empty(tuple(x.shape), dtype=np.float32)
    if x.shape[0]:
        _C.hadamard_rotate(x.numpy(), perms, signs, p, inverse, out, threads())
    return torch.from_numpy(out)


def hadamard_rotate_cpu(x: torch.Tensor, perms: torch.Tensor, signs: torch.Tensor, p: int,
                        inverse: bool = False) -> torch.Tensor:
    return hadamard_rotate_np(x, perms.numpy(), signs.numpy(), p, inverse)


class RotateKernel:
    """A prepared Hadamard rotation on the compiled kernel (``ops.HadamardRotate``'s runner):
    its permutations and signs as numpy, so that rotating float32 rows is one kernel call."""

    compiled = True

    def __init__(self, perms: np.ndarray, signs: np.ndarray, p: int):
        self.perms, self.signs, self.p = perms, signs, int(p)

    def __call__(self, x: torch.Tensor, inverse: bool) -> torch.Tensor:
        if x.dtype != torch.float32:
            x = x.float()
        return hadamard_rotate_np(x.contiguous(), self.perms, self.signs, self.p, inverse)


def lut_scan_cpu(qr: torch.Tensor, packed: torch.Tensor, centroids: torch.Tensor,
                 mult: torch.Tensor, add: torch.Tensor, b: int, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    nq = qr.shape[0]
    vals = torch.empty((nq, k), dtype=torch.float32)
    pos = torch.empty((nq, k), dtype=torch.int64)
    if nq:
        qr_, packed_, c_, mult_, add_, vals_, pos_ = _np(qr, packed, centroids, mult, add, vals,
                                                         pos)
        _C.lut_scan(qr_, packed_, c_, mult_, add_, b, k, vals_, pos_, threads())
    return vals, pos


def lut_rescore_cpu(qr: torch.Tensor, packed: torch.Tensor, centroids: torch.Tensor,
                    mult: torch.Tensor, add: torch.Tensor, rows: torch.Tensor, b: int, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    vals, pos = _topk_out(qr.shape[0], k)
    if qr.shape[0] and rows.shape[1]:
        _C.lut_rescore(*_np(qr, packed, centroids, mult, add, rows), b, k, vals, pos, threads())
    return torch.from_numpy(vals), torch.from_numpy(pos)


def block_codes_cpu(packed: torch.Tensor, d: int, b: int) -> torch.Tensor:
    n = packed.shape[0]
    out = torch.empty((-(-n // 32), fast_scan_row_bytes(d, b), 32), dtype=torch.uint8)
    if n:
        _C.block_codes(packed.numpy(), d, b, out.numpy(), threads())
    return out


def block_code_rows_cpu(packed: torch.Tensor, rows: torch.Tensor, d: int, b: int
                        ) -> torch.Tensor:
    n = rows.shape[0]
    out = pages.empty((-(-n // 32), fast_scan_row_bytes(d, b), 32), np.uint8)  # read at random
    if n:
        _C.block_code_rows(packed.numpy(), rows.numpy(), d, b, out, threads())
    return torch.from_numpy(out)


def _topk_out(nq: int, k: int, written: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Top-k outputs in numpy (half the cost of torch.full + .numpy()): the padding (-inf, -1),
    or uninitialized where the kernel will write every entry (``written``; the fast scans
    write k per query, padding included)."""
    if written:
        return np.empty((nq, k), dtype=np.float32), np.empty((nq, k), dtype=np.int64)
    return np.full((nq, k), -np.inf, dtype=np.float32), np.full((nq, k), -1, dtype=np.int64)


def fast_scan_np(qrs: list[np.ndarray], blocked: list[np.ndarray], n: int,
                 centroids: list[np.ndarray], mults: list[np.ndarray], add: np.ndarray,
                 bits: list[int], k: int, approx: bool = False,
                 packed: list[np.ndarray] | None = None, first: int = 0, k1: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The fast-scan kernels on numpy arrays (``ops.FastScan`` calls this per search): one term
    is ``fast_scan`` (several queries per pass; ``approx`` as in ``FastScan.search``), several
    ``fast_scan_terms`` (two-stage with ``first`` > 0: ``ops.fast_scan_terms_two_stage``)."""
    nq = qrs[0].shape[0]
    vals, pos = _topk_out(nq, k, written=bool(n))
    if nq and n:
        if len(qrs) == 1 and not first:
            _C.fast_scan(qrs[0], blocked[0], n, centroids[0], mults[0], add, bits[0], k,
                         bool(approx), vals, pos, threads())
        else:
            _C.fast_scan_terms(qrs, blocked, centroids, mults, bits, n, add, k, vals, pos,
                               threads(), packed if first else [], int(first), int(k1))
    return vals, pos


def fast_scan_two_stage_np(qr: np.ndarray, signs: np.ndarray, n: int, c1: np.ndarray,
                           packed: np.ndarray, b: int, centroids: np.ndarray, mult: np.ndarray,
                           add: np.ndarray, add1: np.ndarray, k1: int, k: int,
                           mult1: np.ndarray | None = None, bound: tuple | None = None
                           ) -> tuple[np.ndarray, np.ndarray]:
    """``bound``: a ``ref.SignBound`` (sigma, gain, cnorm, min_sin) or None."""
    vals, pos = _topk_out(qr.shape[0], k, written=bool(n))
    if qr.shape[0] and n:
        sigma, gain, cnorm, min_sin = bound if bound is not None else (0.0, 1.0, 1.0, 0.0)
        _C.fast_scan_two_stage(qr, signs, n, c1, packed, b, centroids, mult, add, add1, k1, k,
                               vals, pos, threads(), mult1, sigma, gain, cnorm, min_sin)
    return vals, pos


def fast_scan_two_stage_cpu(qr: torch.Tensor, signs: torch.Tensor, n: int, c1: torch.Tensor,
                            packed: torch.Tensor, b: int, centroids: torch.Tensor,
                            mult: torch.Tensor, add: torch.Tensor, add1: torch.Tensor, k1: int,
                            k: int, mult1: torch.Tensor | None = None,
                            bound: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    vals, pos = fast_scan_two_stage_np(*_np(qr, signs), n, c1.numpy(), packed.numpy(), b,
                                       *_np(centroids, mult, add, add1), k1, k,
                                       None if mult1 is None else mult1.numpy(), bound)
    return torch.from_numpy(vals), torch.from_numpy(pos)


def fast_scan_cpu(qr: torch.Tensor, blocked: torch.Tensor, n: int, centroids: torch.Tensor,
                  mult: torch.Tensor, add: torch.Tensor, b: int, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    vals, pos = fast_scan_np(list(_np(qr)), list(_np(blocked)), n, list(_np(centroids)),
                             list(_np(mult)), add.numpy(), [int(b)], k)
    return torch.from_numpy(vals), torch.from_numpy(pos)


def fast_scan_terms_cpu(qrs: list[torch.Tensor], blocked: list[torch.Tensor], n: int,
                        centroids: list[torch.Tensor], mults: list[torch.Tensor],
                        add: torch.Tensor, bits: list[int], k: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    vals, pos = fast_scan_np(list(_np(*qrs)), list(_np(*blocked)), n, list(_np(*centroids)),
                             list(_np(*mults)), add.numpy(), [int(b) for b in bits], k)
    return torch.from_numpy(vals), torch.from_numpy(pos)


def fast_scan_terms_two_stage_cpu(qrs: list[torch.Tensor], blocked: list[torch.Tensor],
                                  packed: list[torch.Tensor], n: int,
                                  centroids: list[torch.Tensor], mults: list[torch.Tensor],
                                  add: torch.Tensor, bits: list[int], first: int, k1: int, k: int
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    vals, pos = fast_scan_np(list(_np(*qrs)), list(_np(*blocked)), n, list(_np(*centroids)),
                             list(_np(*mults)), add.numpy(), [int(b) for b in bits], k,
                             packed=list(_np(*packed)), first=first, k1=k1)
    return torch.from_numpy(vals), torch.from_numpy(pos)


def ivf_fast_scan_np(qr: np.ndarray, blocked: np.ndarray, centroids: np.ndarray,
                     mult: np.ndarray, add: np.ndarray, list_blocks: np.ndarray,
                     probes: np.ndarray, offsets: np.ndarray, b: int, k: int,
                     approx: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The kernel on numpy arrays (``ops.IVFFastScan`` keeps the codes' views)."""
    nq = qr.shape[0]
    vals, pos = _topk_out(nq, k, written=bool(blocked.shape[0]))
    if nq and blocked.shape[0]:
        _C.ivf_fast_scan(qr, blocked, centroids, mult, add, list_blocks, probes, offsets, b, k,
                         bool(approx), vals, pos, threads())
    return vals, pos


def ivf_fast_scan_cpu(qr: torch.Tensor, blocked: torch.Tensor, centroids: torch.Tensor,
                      mult: torch.Tensor, add: torch.Tensor, list_blocks: torch.Tensor,
                      probes: torch.Tensor, offsets: torch.Tensor, b: int, k: int,
                      approx: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    vals, pos = ivf_fast_scan_np(*_np(qr, blocked, centroids, mult, add, list_blocks, probes,
                                      offsets), b, k, approx)
    return torch.from_numpy(vals), torch.from_numpy(pos)


def decode_attention_cpu(qr: torch.Tensor, qbias: torch.Tensor, kpacked: torch.Tensor,
                         knorm: torch.Tensor, kcent: torch.Tensor, kb: int,
                         vpacked: torch.Tensor, vnorm: torch.Tensor, vcent: torch.Tensor, vb: int,
                         lo: torch.Tensor, hi: torch.Tensor, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bh, g, d = qr.shape
    m = np.empty((bh, g), dtype=np.float32)
    l = np.empty((bh, g), dtype=np.float32)
    acc = np.empty((bh, g, d), dtype=np.float32)
    if bh and g:
        _C.decode_attention(*_np(qr, qbias, kpacked, knorm, kcent), kb,
                            *_np(vpacked, vnorm, vcent), vb, *_np(lo, hi), float(scale), m, l,
                            acc, threads())
    return torch.from_numpy(m), torch.from_numpy(l), torch.from_numpy(acc)


def kv_side(*, rotation: tuple, centroids: torch.Tensor, bits: int,
            mu: torch.Tensor | None = None, sc: torch.Tensor | None = None,
            norm_table: torch.Tensor | None = None) -> object:
    """A code segment side's constants for ``step_plan``, prepared once
    (csrc/cpu/bind/attention.cpp ``KVSide``): ``rotation`` = (perms, signs, p) numpy arrays and
    block, centroids (2^bits) float32, the channel scale's mu and sc (heads, d) or None, and
    for multipliers stored as 8-bit codes their float32 values (256)."""
    def host(t):
        return None if t is None else t.float().contiguous().numpy()
    return _C.KVSide(rotation=_C.Rotation(*rotation), centroids=host(centroids), bits=int(bits),
                     mu=host(mu), sc=host(sc), norm_table=host(norm_table))


def step_plan(heads: int, bh: int, d: int, sides: list, packed: list, norms: list,
              exact: list, exact_dtype: int) -> object:
    """A layer's code segments and fixed full-precision rows prepared for
    ``attention_step_np`` (csrc/cpu/bind/attention.cpp ``KVStepPlan``): the arrays are checked
    once and held by the plan."""
    return _C.KVStepPlan(heads, bh, d, sides, packed, norms, exact, exact_dtype)


# the compiled step's exact_dtype codes (csrc/cpu/kernels.h kF32 / kBF16 / kF16)
EXACT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _exact_host(t: torch.Tensor, code: int) -> np.ndarray:
    """A full-precision row tensor as the numpy array the step reads (16-bit floats as their
    bits)."""
    t = t.contiguous()
    return t.numpy() if code == 0 else t.view(torch.int16).numpy()


def _compiled_plan(plan: KVStepPlan) -> object | None:
    """The compiled kernel's form of a ``KVStepPlan`` (made once per plan and kept in it), or
    None where the kernel cannot take it: another dtype, a side without a Hadamard rotation on
    the CPU, multipliers stored as other than float16 or table-coded bytes."""
    prepared = plan.prepared
    if "cpu" not in prepared:
        prepared["cpu"] = _make_compiled_plan(plan)
    return prepared["cpu"]


def _make_compiled_plan(plan: KVStepPlan) -> object | None:
    code = EXACT_DTYPES.get(plan.dtype)
    if code is None or any(t.device.type != "cpu" or t.dtype != plan.dtype
                           for t in plan.sink or ()):
        return None
    sides, packed, norms = [], [], []
    for seg in plan.segments:
        for side, codes, mults in ((seg.key, seg.key_codes, seg.key_mults),
                                   (seg.value, seg.value_codes, seg.value_mults)):
            rot = getattr(side.rotation, "runner", None)
            stored = torch.uint8 if side.norm_table is not None else torch.float16
            if not isinstance(rot, RotateKernel) or codes.device.type != "cpu" or \
                    mults.dtype != stored:
                return None
            sides.append(kv_side(rotation=(rot.perms, rot.signs, rot.p), bits=side.bits,
                                 centroids=side.centroids, mu=side.mu, sc=side.sc,
                                 norm_table=side.norm_table))
            packed.append(codes.numpy())
            norms.append(mults.numpy())
    return step_plan(plan.heads, plan.bh, plan.d, sides, packed, norms,
                     [_exact_host(t, code) for t in plan.sink or ()], code)


def attention_step_cpu(q: torch.Tensor, scale: float, plan: KVStepPlan, ranges: list[int],
                       exact: list, bias: list | None = None) -> torch.Tensor:
    """``ops.attention_step`` on the CPU: one compiled call (csrc/cpu/attention.cpp) where
    every token is visible to every row (no ``bias``) and the plan is what the kernel takes;
    else the composition over the compiled ``decode_attention``."""
    compiled = None if bias is not None and any(b is not None for b in bias) else \
        _compiled_plan(plan)
    dtype = plan.dtype
    if compiled is None or any(k.dtype != dtype or v.dtype != dtype for k, v in exact):
        return compose_attention_step(decode_attention_cpu, q, scale, plan, ranges, exact, bias)
    code = EXACT_DTYPES[dtype]
    ex = [_exact_host(t, code) for pair in exact for t in pair]
    return torch.from_numpy(attention_step_np(compiled, q.numpy(), scale, ranges, ex))


def attention_step_np(plan: object, q: np.ndarray, scale: float, ranges: list[int],
                      exact: list) -> np.ndarray:
    """One decode step of a cache layer's attention (csrc/cpu/attention.cpp ``attention_step``):
    q (bh, g, d) float32 -> (bh, g, d) float32."""
    out = np.empty(q.shape, dtype=np.float32)
    if q.size:
        plan.run(q, float(scale), ranges, exact, out, threads())
    return out


def ivf_probe_np(q: np.ndarray, centroids: np.ndarray, csq: np.ndarray, l2: bool, nprobe: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    probes = np.empty((q.shape[0], nprobe), dtype=np.int64)
    offsets = np.empty((q.shape[0], nprobe), dtype=np.float32)
    if q.shape[0]:
        _C.ivf_probe(q, centroids, csq, bool(l2), probes, offsets, threads())
    return probes, offsets


def ivf_probe_cpu(q: torch.Tensor, centroids: torch.Tensor, csq: torch.Tensor, l2: bool,
                  nprobe: int) -> tuple[torch.Tensor, torch.Tensor]:
    probes, offsets = ivf_probe_np(*_np(q, centroids, csq), l2, nprobe)
    return torch.from_numpy(probes), torch.from_numpy(offsets)


def row_sqnorms_cpu(x: torch.Tensor) -> torch.Tensor:
    out = np.empty(x.shape[0], dtype=np.float32)
    _C.row_sqnorms(x.numpy(), out)
    return torch.from_numpy(out)


def row_project_cpu(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    out = np.empty((x.shape[0], W.shape[1]), dtype=np.float32)
    _C.row_project(x.numpy(), W.numpy(), out, threads())
    return torch.from_numpy(out)


def row_dots_cpu(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = np.empty(x.shape[0], dtype=np.float32)
    _C.row_dots(x.numpy(), v.numpy(), out)
    return torch.from_numpy(out)


RESCORE_METRIC_CODES = {"ip": 0, "l2": 1, "cosine": 2}  # kernels.h RescoreMetric


def rescore_topk_np(q: np.ndarray, x: np.ndarray, rows: np.ndarray, metric: str, k: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The kernel on numpy arrays (the refinement of every index search path calls this)."""
    vals, idx = _topk_out(q.shape[0], k, written=True)
    if q.shape[0]:
        _C.rescore_topk(q, x, rows, RESCORE_METRIC_CODES[metric], k, vals, idx, threads())
    return vals, idx


def rescore_topk_cpu(q: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, metric: str, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    vals, idx = rescore_topk_np(*_np(q, x, rows), metric, k)
    return torch.from_numpy(vals), torch.from_numpy(idx)


def compiled() -> object:
    """The compiled module (``tqvec._C``) for the prepared ops' factories
    (``prepared_cpu``)."""
    return _C


def rotation(parts: tuple) -> object:
    """A Hadamard rotation's (perms, signs, p) numpy parts as the kernels' ``Rotation``."""
    return _C.Rotation(*parts)


def code_refinement(parts: dict | None) -> object:
    """The compiled searchers' ``CodeRefinement`` from its keyword parts (its rotation a
    (perms, signs, p) tuple), or None."""
    if parts is None:
        return None
    parts = dict(parts)
    return _C.CodeRefinement(rotation=rotation(parts.pop("rotation")), **parts)
