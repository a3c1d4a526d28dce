"""CUDA implementations of the ops; same arguments and results as ``ref.py``.

The kernels are the header-free sources in ``csrc/cuda/*.cu`` (shipped inside the package as
``tqvec/_cuda/*.cu`` by the build), compiled at run time by NVRTC: through
``torch.cuda._compile_kernel`` (torch >= 2.8; the only place tqvec touches that private API) or,
failing that, CuPy's ``RawModule``. Each kernel is compiled once per (file, kernel, compute
capability, source sha256) and process. Kernels run on torch's current stream and change no
device-wide setting.

Nothing here validates user input (``tqvec.ops`` and the codecs do); sizes must fit in int32
(the launcher passes Python ints as C ints), which the functions check.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .kvstep import compose_attention_step
from .ref import decode_attention_ref, row_bytes

__all__ = ["available", "unavailable_reason", "pack_bits_cuda", "unpack_bits_cuda",
           "quantize_pack_cuda", "hadamard_rotate_cuda", "hadamard_rotate_runner",
           "lut_scan_cuda",
           "decode_attention_cuda", "attention_step_cuda", "attention_kernel_applies",
           "ATTENTION_LAUNCH",
           "SOURCES", "PRELUDE", "NVRTC_OPTIONS", "kernel_source", "MMA_SCAN",
           "attention_smem", "mma_scan_smem",
           "mma_scan_applies",
           "source_path"]

#: kernel file -> kernels it defines (what the nvcc compile check and the loader know about).
SOURCES = {
    "pack.cu": ("tq_pack_bits", "tq_unpack_bits", "tq_quantize_pack"),
    "hadamard.cu": ("tq_hadamard_f32", "tq_hadamard_h16"),
    "scan.cu": ("tq_lut_scan", "tq_mma_scan"),
    "attention.cu": ("tq_decode_attention",),
}
# Bit-exact kernels must not contract a*b+c into an FMA (the reference rounds twice).
NVRTC_OPTIONS = {"pack.cu": ["--fmad=false"], "hadamard.cu": ["--fmad=false"], "scan.cu": [],
                 "attention.cu": []}
_INT32_MAX = 2**31 - 1
_lock = threading.Lock()
_compiled: dict[tuple, object] = {}


def source_path(name: str) -> Path:
    """The .cu file: inside the installed package, else the source tree's csrc/cuda."""
    here = Path(__file__).resolve().parent.parent
    for p in (here / "_cuda" / name, here.parent / "csrc" / "cuda" / name):
        if p.is_file():
            return p
    raise FileNotFoundError(f"CUDA source {name} is neither in {here / '_cuda'} nor in "
                            f"{here.parent / 'csrc' / 'cuda'}")


def _torch_compiler():
    """torch.cuda._compile_kernel when this torch has a usable one (>= 2.8), else None."""
    major, minor = (int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if (major, minor) < (2, 8):
        return None
    return getattr(torch.cuda, "_compile_kernel", None)


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when CUDA kernels can be compiled and launched here, else why not. Probes by
    compiling one small kernel (once per process), so that ``backend="auto"`` falls back to the
    reference instead of failing in every op where the compile route is broken (a pip-only
    install without a CUDA toolkit, say)."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if _torch_compiler() is None:
        try:
            import cupy  # noqa: F401
        except ImportError:
            return (f"torch {torch.__version__} has no torch.cuda._compile_kernel (needs >= 2.8) "
                    "and CuPy is not installed")
    try:
        for name in (PRELUDE, *SOURCES):
            source_path(name)
    except FileNotFoundError as e:
        return str(e)
    try:
        _kernel("pack.cu", "tq_pack_bits", torch.device("cuda", torch.cuda.current_device()))
    except Exception as e:  # noqa: BLE001 - any failure of the compile route means "unavailable"
        return f"the probe kernel does not compile: {e}"
    return None


def available() -> bool:
    return unavailable_reason() is None


class _Launcher:
    """A compiled kernel: ``launcher(grid, block, args, smem)`` on torch's current stream."""

    def __init__(self, src: str, name: str, arch: str, options: list[str]):
        self.name = name
        self._smem_configured = 0
        self._cupy = None
        failures = []
        compile_kernel = _torch_compiler()
        if compile_kernel is not None:
            try:
                self._k = compile_kernel(src, name, compute_capability=arch,
                                         nvcc_options=list(options))
                return
            except Exception as e:  # noqa: BLE001 - e.g. OSError: no CUDA_HOME (pip-only torch)
                failures.append(f"torch.cuda._compile_kernel: {type(e).__name__}: {e}")
        try:
            import cupy
        except ImportError:
            failures.append("CuPy is not installed")
            raise RuntimeError(f"cannot compile {name}: " + "; ".join(failures)) from None
        try:
            mod = cupy.RawModule(code=src, options=("-std=c++17", f"-arch=sm_{arch}", *options))
            self._k = mod.get_function(name)
        except Exception as e:  # noqa: BLE001
            failures.append(f"CuPy: {type(e).__name__}: {e}")
            raise RuntimeError(f"cannot compile {name}: " + "; ".join(failures)) from e
        self._cupy = cupy

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: list,
                 smem: int = 0) -> None:
        if smem >= 48 * 1024 and smem > self._smem_configured:
            if self._cupy is None:
                if hasattr(self._k, "set_shared_memory_config"):
                    self._k.set_shared_memory_config(smem)
                else:  # older torch: raise the kernel's dynamic shared-memory limit ourselves
                    from torch.cuda._utils import _get_gpu_runtime_library
                    max_dynamic_shared_size = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                    rc = _get_gpu_runtime_library().cuFuncSetAttribute(
                        self._k.func, max_dynamic_shared_size, smem)
                    if rc != 0:
                        raise RuntimeError(f"cuFuncSetAttribute({self.name}, {smem} B of shared "
                                           f"memory) failed with CUDA error {rc}")
            else:
                self._k.max_dynamic_shared_size_bytes = smem
            self._smem_configured = smem
        if self._cupy is None:
            self._k(grid=grid, block=block, args=args, shared_mem=smem)
            return
        import numpy as np
        cp = self._cupy
        conv = []
        for a in args:
            if isinstance(a, torch.Tensor):
                conv.append(cp.from_dlpack(a))
            elif isinstance(a, float):
                conv.append(np.float64(a))
            else:
                conv.append(np.int32(a))
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            self._k(grid, block, tuple(conv), shared_mem=smem)


def _props(device: torch.device) -> tuple[int, int]:
    """(multiprocessors, opt-in shared memory per block in bytes) of the device."""
    p = torch.cuda.get_device_properties(device)
    return p.multi_processor_count, getattr(p, "shared_memory_per_block_optin", 48 * 1024)


def _on(device: torch.device):
    """Make ``device`` current while launching (a no-op for the CPU emulation in the tests)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


#: Device helpers put in front of every kernel file (the files stay header-free: NVRTC runs
#: with no include path).
PRELUDE = "common.cuh"


@functools.cache
def kernel_source(file: str) -> tuple[str, str]:
    """(text, sha256) of what NVRTC compiles for a kernel file: the prelude, then the file
    (numbered from its own line 1 in compiler messages). Read once per process."""
    src = (source_path(PRELUDE).read_text() + f'\n#line 1 "{file}"\n'
           + source_path(file).read_text())
    return src, hashlib.sha256(src.encode()).hexdigest()


def _kernel(file: str, name: str, device: torch.device,
            defines: tuple[tuple[str, int], ...] = ()) -> _Launcher:
    """The compiled kernel; ``defines`` are compile-time shape parameters (-D options: one
    variant per value set)."""
    props = torch.cuda.get_device_properties(device)
    arch = f"{props.major}{props.minor}"
    src, sha = kernel_source(file)
    # A module is loaded into one device's context: the device index is part of the key.
    key = (file, name, arch, sha, device.index if device.index is not None
           else torch.cuda.current_device(), defines)
    with _lock:
        k = _compiled.get(key)
        if k is None:
            with torch.cuda.device(device):
                k = _Launcher(src, name, arch,
                              NVRTC_OPTIONS[file] + [f"-D{n}={v}" for n, v in defines])
            _compiled[key] = k
    return k


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_int32(**sizes: int) -> None:
    for name, v in sizes.items():
        if v > _INT32_MAX:
            raise ValueError(f"{name} must be < 2**31 for the CUDA kernels, got {v}")


def _typed(**args: tuple[torch.Tensor, torch.dtype]) -> None:
    """Each kernel reads raw row-major memory of one dtype: a tensor of another dtype (a float16
    norm where the kernel reads float32, say) would be misread silently, so refuse it."""
    for name, (t, dtype) in args.items():
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype} for the CUDA kernel, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the CUDA kernel "
                             f"(shape {tuple(t.shape)}, strides {t.stride()})")


# gridDim.y and gridDim.z are at most 65,535: launches with more query groups or (batch x KV
# head) rows than that are split.
_GRID_Y_MAX = 65535


def _grid_1d(total: int, device: torch.device, threads: int = 256) -> tuple[int, int, int]:
    sms = _props(device)[0]
    return (max(1, min(_cdiv(total, threads), sms * 32)), 1, 1)


def pack_bits_cuda(idx: torch.Tensor, b: int) -> torch.Tensor:
    n, d = idx.shape
    _typed(idx=(idx, torch.uint8))
    out = torch.empty((n, row_bytes(d, b)), dtype=torch.uint8, device=idx.device)
    if n:
        _check_int32(n=n, d=d)
        with _on(idx.device):
            _kernel("pack.cu", "tq_pack_bits", idx.device)(
                _grid_1d(out.numel(), idx.device), (256, 1, 1), [idx, out, n, d, b])
    return out


def unpack_bits_cuda(packed: torch.Tensor, d: int, b: int) -> torch.Tensor:
    n = packed.shape[0]
    _typed(packed=(packed, torch.uint8))
    out = torch.empty((n, d), dtype=torch.uint8, device=packed.device)
    if n:
        _check_int32(n=n, d=d)
        with _on(packed.device):
            _kernel("pack.cu", "tq_unpack_bits", packed.device)(
                _grid_1d(out.numel(), packed.device), (256, 1, 1), [packed, out, n, d, b])
    return out


def quantize_pack_cuda(y: torch.Tensor, scale: torch.Tensor, thresholds: torch.Tensor, b: int
                       ) -> torch.Tensor:
    n, d = y.shape
    _typed(y=(y, torch.float32), scale=(scale, torch.float32),
           thresholds=(thresholds, torch.float32))
    out = torch.empty((n, row_bytes(d, b)), dtype=torch.uint8, device=y.device)
    nthr = thresholds.numel()
    if n:
        _check_int32(n=n, d=d)
        with _on(y.device):
            _kernel("pack.cu", "tq_quantize_pack", y.device)(
                _grid_1d(out.numel(), y.device), (256, 1, 1),
                [y, scale, thresholds, nthr, out, n, d, b], smem=4 * max(1, nthr))
    return out


def hadamard_rotate_cuda(x: torch.Tensor, perms: torch.Tensor, signs: torch.Tensor, p: int,
                         inverse: bool = False) -> torch.Tensor:
    """float32, float16 or bfloat16 rows in, float32 rows out (the rotation of x.float())."""
    n, d = x.shape
    _typed(x=(x, x.dtype), perms=(perms, torch.int64), signs=(signs, torch.float32))
    out = torch.empty((n, d), dtype=torch.float32, device=x.device)
    if n == 0:
        return out
    _check_int32(n=n, d=d)
    # The reference's scale: float32(1 / sqrt(p)) from the same double.
    s = float(torch.tensor(1.0 / (p ** 0.5), dtype=torch.float32))
    rounds = perms.shape[0]
    threads = min(256, max(32, 1 << max(0, (p // 2 - 1).bit_length())))
    grid = (min(n, _props(x.device)[0] * 16), 1, 1)
    smem = 8 * d
    with _on(x.device):
        if x.dtype == torch.float32:
            _kernel("hadamard.cu", "tq_hadamard_f32", x.device)(
                grid, (threads, 1, 1), [x, perms, signs, out, n, d, p, rounds, int(inverse), s],
                smem=smem)
        elif x.dtype in (torch.float16, torch.bfloat16):
            _kernel("hadamard.cu", "tq_hadamard_h16", x.device)(
                grid, (threads, 1, 1),
                [x, perms, signs, out, n, d, p, rounds, int(inverse), s,
                 int(x.dtype == torch.bfloat16)], smem=smem)
        else:
            raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    return out


def hadamard_rotate_runner(r: Any) -> Callable | None:
    """A prepared rotation (``ops.HadamardRotate``) on the CUDA kernel; None off the GPU."""
    if r.perms.device.type != "cuda":
        return None

    def run(x: torch.Tensor, inverse: bool) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            x = x.float()
        return hadamard_rotate_cuda(x.contiguous(), r.perms, r.signs, r.p, inverse)
    return run


# -- LUT scan -----------------------------------------------------------------------------------
_SCAN_THREADS = 256
_SCAN_QB = (8, 4, 2, 1)
_SCAN_KMAX = 256  # kernel's per-block selection limit; larger k use the blocked GEMM path
_SCAN_SMEM_TARGET = 100 * 1024  # <= 2 blocks per SM on H100 (228 KB)


def _scan_shape(d: int, b: int) -> tuple[int, int, int]:
    """(g_log2, rows per tile, coordinates per lane): lanes per row so that a lane's slice of
    the row is about 8 bytes (nearly conflict-free shared-memory reads), at most 32."""
    rb = row_bytes(d, b)
    g_log2 = 0
    while _cdiv(rb, 1 << g_log2) > 8 and g_log2 < 5:
        g_log2 += 1
    cpt = (_cdiv(d, 1 << g_log2) + 7) & ~7
    return g_log2, _SCAN_THREADS >> g_log2, cpt


def _scan_smem(d: int, b: int, qb: int, kp: int) -> int:
    """Dynamic shared memory of tq_lut_scan, in the kernel's order (see scan.cu)."""
    g_log2, tr, cpt = _scan_shape(d, b)
    return (4 * qb * (cpt + 1) * (1 << g_log2) + 4 * 256 + 4 * qb * tr + 8 * qb * 2 * kp
            + 8 * qb + tr * row_bytes(d, b) + 64)


def _padded_topk(v: torch.Tensor, p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(nq, m <= k) best-first candidates -> (nq, k) with the reference's -inf / -1 padding
    (also where a candidate's score is not finite)."""
    nq, m = v.shape
    vals = torch.full((nq, k), -math.inf, dtype=torch.float32, device=v.device)
    pos = torch.full((nq, k), -1, dtype=torch.int64, device=v.device)
    ok = torch.isfinite(v)
    vals[:, :m] = torch.where(ok, v, vals[:, :m])
    pos[:, :m] = torch.where(ok, p, pos[:, :m])
    return vals, pos


def lut_scan_cuda(qr: torch.Tensor, packed: torch.Tensor, centroids: torch.Tensor,
                  mult: torch.Tensor, add: torch.Tensor, b: int, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    nq, d = qr.shape
    n = packed.shape[0]
    dev = qr.device
    _typed(qr=(qr, torch.float32), packed=(packed, torch.uint8),
           centroids=(centroids, torch.float32), mult=(mult, torch.float32),
           add=(add, torch.float32))
    if nq > _GRID_Y_MAX:  # at most one query per grid row
        parts = [lut_scan_cuda(qr[s:s + _GRID_Y_MAX], packed, centroids, mult, add, b, k)
                 for s in range(0, nq, _GRID_Y_MAX)]
        return torch.cat([v for v, _ in parts]), torch.cat([i for _, i in parts])
    if n == 0 or nq == 0:
        return _padded_topk(torch.empty((nq, 0), device=dev),
                            torch.empty((nq, 0), dtype=torch.int64, device=dev), k)
    _check_int32(n=n, d=d, nq=nq)
    kk = min(k, n)
    if (MMA_SCAN and mma_scan_applies(d, b, kk) and packed.data_ptr() % 4 == 0
            and mma_scan_smem(d, b, _MMA_SCAN_WARPS) <= _props(dev)[1]):  # 4-byte row loads
        return _mma_scan(qr, packed, centroids, mult, add, b, k, kk)
    kp = 1 << max(0, (kk - 1).bit_length())
    if kp > _SCAN_KMAX:
        return _blocked_gemm_scan(qr, packed, centroids, mult, add, b, k)
    qb = next((q for q in _SCAN_QB if q <= max(1, nq) and _scan_smem(d, b, q, kp)
               <= _SCAN_SMEM_TARGET), 1)
    smem = _scan_smem(d, b, qb, kp)
    sms, limit = _props(dev)
    if smem > limit:
        return _blocked_gemm_scan(qr, packed, centroids, mult, add, b, k)
    g_log2, tr, _ = _scan_shape(d, b)
    groups = _cdiv(nq, qb)
    target = 8 * sms
    chunks = max(1, min(_cdiv(n, tr), _cdiv(target, groups)))
    rows_per_chunk = _cdiv(_cdiv(n, chunks), tr) * tr  # whole tiles per block
    chunks = _cdiv(n, rows_per_chunk)
    cand_v = torch.empty((nq, chunks, kk), dtype=torch.float32, device=dev)
    cand_i = torch.empty((nq, chunks, kk), dtype=torch.int64, device=dev)
    with _on(dev):
        _kernel("scan.cu", "tq_lut_scan", dev)(
            (chunks, groups, 1), (_SCAN_THREADS, 1, 1),
            [qr, packed, centroids, mult, add, nq, n, d, b, kk, kp, qb, g_log2,
             rows_per_chunk, cand_v, cand_i], smem=smem)
    top = torch.topk(cand_v.reshape(nq, chunks * kk), kk, dim=1)
    return _padded_topk(top.values, torch.gather(cand_i.reshape(nq, chunks * kk), 1,
                                                 top.indices), k)


#: The tensor-core scan (tq_mma_scan) wherever it applies; False forces the LUT kernel
#: (tq_lut_scan) - benchmarks time both side by side.
MMA_SCAN = True
_MMA_SCAN_WARPS = 8
_MMA_SCAN_K_MAX = 32


def mma_scan_applies(d: int, b: int, k: int) -> bool:
    """Whether tq_mma_scan covers (d, b, k): d % 32 == 0, 1 <= b <= 4, k <= 32."""
    return d % 32 == 0 and 1 <= b <= 4 and 1 <= k <= _MMA_SCAN_K_MAX


def mma_scan_smem(d: int, b: int, warps: int) -> int:
    """Dynamic shared memory of tq_mma_scan, in the kernel's order (see scan.cu)."""
    return 8 * (1 << 2 * b) + 2 * (d // 16) * 32 * 16 + warps * (16 * row_bytes(d, b) + 16)


def _mma_scan(qr: torch.Tensor, packed: torch.Tensor, centroids: torch.Tensor,
              mult: torch.Tensor, add: torch.Tensor, b: int, k: int, kk: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    nq, d = qr.shape
    n = packed.shape[0]
    dev = qr.device
    lk = 1 << max(0, (kk - 1).bit_length())  # each lane's list: a power of two >= k
    warps = _MMA_SCAN_WARPS
    qtiles = _cdiv(nq, 16)
    sms, _ = _props(dev)
    step = 16 * warps
    chunks = max(1, min(_cdiv(n, step), _cdiv(4 * sms, qtiles)))  # ~4 blocks per SM
    rows_per_chunk = _cdiv(_cdiv(n, chunks), step) * step
    chunks = _cdiv(n, rows_per_chunk)
    lists = chunks * warps * 4
    out_v = torch.empty((nq, lists, lk), dtype=torch.float32, device=dev)
    out_i = torch.empty((nq, lists, lk), dtype=torch.int64, device=dev)
    # each query scaled by a power of two (exact) so that its largest coordinate is in [0.5, 1]:
    # the kernel's fp16 operands cannot overflow; no host read
    qscale = torch.exp2(torch.ceil(torch.log2(qr.abs().amax(1).clamp_min(2.0 ** -100))))
    with _on(dev):
        _kernel("scan.cu", "tq_mma_scan", dev,
                (("TQS_D", d), ("TQS_B", b), ("TQS_K", lk), ("TQS_WARPS", warps)))(
            (chunks, qtiles, 1), (32 * warps, 1, 1),
            [qr / qscale[:, None], packed, centroids, mult, add, qscale, nq, n,
             rows_per_chunk, out_v, out_i], smem=mma_scan_smem(d, b, warps))
    top = torch.topk(out_v.reshape(nq, lists * lk), kk, dim=1)
    return _padded_topk(top.values, torch.gather(out_i.reshape(nq, lists * lk), 1, top.indices),
                        k)


def _blocked_gemm_scan(qr: torch.Tensor, packed: torch.Tensor, centroids: torch.Tensor,
                       mult: torch.Tensor, add: torch.Tensor, b: int, k: int,
                       block: int = 1 << 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Large k (or a row too wide for shared memory): unpack a block of codes, score it with a
    float32 GEMM, keep a running top-k. Decodes one block at a time (block x d floats)."""
    nq, d = qr.shape
    n = packed.shape[0]
    dev = qr.device
    best_v = torch.empty((nq, 0), dtype=torch.float32, device=dev)
    best_p = torch.empty((nq, 0), dtype=torch.int64, device=dev)
    for s in range(0, n, block):
        e = min(n, s + block)
        yhat = centroids[unpack_bits_cuda(packed[s:e], d, b).long()]
        sc = (qr @ yhat.T) * mult[None, s:e] + add[None, s:e]
        v = torch.cat([best_v, sc], 1)
        p = torch.cat([best_p, torch.arange(s, e, device=dev).expand(nq, -1)], 1)
        top = torch.topk(v, min(k, v.shape[1]), dim=1)
        best_v, best_p = top.values, torch.gather(p, 1, top.indices)
    return _padded_topk(best_v, best_p, k)


# -- decode attention ---------------------------------------------------------------------------
#: tq_decode_attention's launch shape: (warps per block, blocks per multiprocessor that the
#: register allocation must allow, Q's fragments in registers). Each warp is one partial of
#: the split-K merge.
ATTENTION_LAUNCH = (8, 1, False)
_ATTN_TILE = 16       # tokens per warp and step
_ATTN_G_MAX = 16      # query rows of the mma tile
_ATTN_D_MAX = 256
_ATTN_BITS = (1, 2, 3, 4)


def attention_kernel_applies(g: int, d: int, kb: int, vb: int) -> bool:
    """Whether tq_decode_attention covers the shape (else the reference runs on the GPU)."""
    return (g <= _ATTN_G_MAX and d % 32 == 0 and 0 < d <= _ATTN_D_MAX and kb in _ATTN_BITS
            and vb in _ATTN_BITS)


def attention_smem(d: int, kb: int, vb: int, warps: int) -> int:
    """Dynamic shared memory of tq_decode_attention, in the kernel's order (see attention.cu)."""
    per_warp = 16 * (row_bytes(d, kb) + row_bytes(d, vb)) + 32
    return 4 * (1 << 2 * kb) + 4 * (1 << 2 * vb) + (d // 16) * 32 * 16 + warps * per_warp


def decode_attention_cuda(qr: torch.Tensor, qbias: torch.Tensor, kpacked: torch.Tensor,
                          knorm: torch.Tensor, kcent: torch.Tensor, kb: int,
                          vpacked: torch.Tensor, vnorm: torch.Tensor, vcent: torch.Tensor,
                          vb: int, lo: torch.Tensor, hi: torch.Tensor, scale: float,
                          splits: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash-decoding over the codes on the tensor cores: blocks of (split of the tokens, batch x
    KV head), each warp of a block writing a partial (m, l, acc); the partials are merged here
    by log-sum-exp. Scores and values go through fp16 operands with fp32 accumulation (the
    codebook's centroids and the queries rounded to fp16: relative error ~1e-3 against the
    float32 reference)."""
    bh, g, d = qr.shape
    t = kpacked.shape[1]
    dev = qr.device
    _typed(qr=(qr, torch.float32), qbias=(qbias, torch.float32), kpacked=(kpacked, torch.uint8),
           knorm=(knorm, torch.float32), kcent=(kcent, torch.float32),
           vpacked=(vpacked, torch.uint8), vnorm=(vnorm, torch.float32),
           vcent=(vcent, torch.float32), lo=(lo, torch.int32), hi=(hi, torch.int32))
    if bh > _GRID_Y_MAX:  # one (batch, KV head) row per grid row
        parts = [decode_attention_cuda(qr[s:e], qbias[s:e], kpacked[s:e], knorm[s:e], kcent, kb,
                                       vpacked[s:e], vnorm[s:e], vcent, vb, lo[s:e], hi[s:e],
                                       scale, splits)
                 for s, e in ((s, min(bh, s + _GRID_Y_MAX)) for s in range(0, bh, _GRID_Y_MAX))]
        return tuple(torch.cat(xs) for xs in zip(*parts, strict=True))
    if (not attention_kernel_applies(g, d, kb, vb) or kpacked.data_ptr() % 4
            or vpacked.data_ptr() % 4):  # the kernel loads codes 4 bytes at a time
        return decode_attention_ref(qr, qbias, kpacked, knorm, kcent, kb, vpacked, vnorm, vcent,
                                     vb, lo, hi, scale)
    _check_int32(tokens=bh * t)
    sms, limit = _props(dev)
    warps, min_blocks, q_in_registers = ATTENTION_LAUNCH
    smem = attention_smem(d, kb, vb, warps)
    if smem > limit:
        return decode_attention_ref(qr, qbias, kpacked, knorm, kcent, kb, vpacked, vnorm, vcent,
                                     vb, lo, hi, scale)
    step = _ATTN_TILE * warps  # tokens a block covers per step
    if splits is None:  # enough blocks for ~16 warps per multiprocessor
        splits = max(1, min(_cdiv(max(t, 1), step), _cdiv(16 * sms // warps, max(bh, 1))))
    per_split = _cdiv(_cdiv(max(t, 1), splits), step) * step
    splits = _cdiv(max(t, 1), per_split)
    parts = splits * warps
    pm = torch.empty((bh, parts, g), dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    pacc = torch.empty((bh, parts, g, d), dtype=torch.float32, device=dev)
    if bh:
        with _on(dev):
            _kernel("attention.cu", "tq_decode_attention", dev,
                    (("TQA_D", d), ("TQA_KB", kb), ("TQA_VB", vb), ("TQA_WARPS", warps),
                     ("TQA_MINB", min_blocks), ("TQA_QREG", int(q_in_registers))))(
                (splits, bh, 1), (32 * warps, 1, 1),
                [qr, qbias, kpacked, knorm, kcent, vpacked, vnorm, vcent, lo, hi, g, t,
                 per_split, float(scale), pm, pl, pacc], smem=smem)
    m = pm.amax(1)                                             # (bh, g)
    w = torch.exp(pm - torch.where(torch.isfinite(m), m, torch.zeros_like(m))[:, None])
    w = torch.where(torch.isfinite(pm), w, torch.zeros_like(w))  # empty partials weigh 0
    return m, (w * pl).sum(1), (w[..., None] * pacc).sum(1)


def attention_step_cuda(q: torch.Tensor, scale: float, plan, ranges, exact, bias=None
                        ) -> torch.Tensor:
    """``ops.attention_step`` on a GPU: the composition over the CUDA ``decode_attention``
    kernel (one fused step kernel is the GPU KV cache's to write)."""
    return compose_attention_step(decode_attention_cuda, q, scale, plan, ranges, exact, bias)
