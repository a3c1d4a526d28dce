"""CUDA kernels (csrc/cuda): compile checks (nvcc, NVRTC), the kernels' logic on a CPU
emulation of the CUDA execution model, and, on a GPU, every op and codec against the reference.

* ``nvcc``: every .cu builds for sm_80 and sm_90 with warnings as errors.
* NVRTC (skips when libnvrtc is absent): every kernel compiles with the exact options the run-time
  loader uses, with no headers, and exports the extern "C" name the loader asks for.
* emulation (needs g++ with C++20): the real kernel sources, compiled for the CPU against
  tests/cuda_emu/emu.cpp, driven through tqvec.ops.cuda's own host code (grid, shared-memory
  sizing, final merge) with CPU tensors: checks indexing, bit layout, selection and barriers.
* ``gpu``: the kernels on a real device: ops and codecs bit-exact / within tolerance.
"""

import contextlib
import ctypes
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tqvec
from tests.conftest import attn_case, scan_case
from tqvec import ops
from tqvec.ops import cuda as C
from tqvec.random import make_rotation

ROOT = Path(__file__).resolve().parents[1]
CU = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))


def test_every_source_is_known_and_shipped():
    assert {p.name for p in CU} == set(C.SOURCES)
    cmake = (ROOT / "CMakeLists.txt").read_text()
    for p in CU:
        assert f"csrc/cuda/{p.name}" in cmake, f"{p.name} is not installed into tqvec/_cuda"
        src = p.read_text()
        assert "#include" not in src, f"{p.name} must be header-free (NVRTC, no include path)"
        for k in C.SOURCES[p.name]:
            assert re.search(rf'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?'
                             rf'\s+{k}\(', src), f"{p.name} does not define extern \"C\" {k}"
    assert "csrc/cuda/common.cuh" in cmake and "#include" not in C.kernel_source("scan.cu")[0]


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("src", CU, ids=[p.name for p in CU])
def test_nvcc_compiles_without_warnings(src, arch, tmp_path):
    full = tmp_path / src.name  # what NVRTC compiles: the prelude, then the file
    full.write_text(C.kernel_source(src.name)[0])
    cmd = ["nvcc", "-std=c++17", f"-arch=sm_{arch}", "-Werror", "all-warnings",
           "-Xptxas", "-Werror", "-c", str(full), "-o", str(tmp_path / "k.o")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.nvcc
@pytest.mark.parametrize("file,kernel,defines", [
    ("attention.cu", "tq_decode_attention", {"TQA_D": 128, "TQA_KB": 3, "TQA_VB": 3}),
    ("attention.cu", "tq_decode_attention", {"TQA_D": 256, "TQA_KB": 4, "TQA_VB": 4}),
    ("scan.cu", "tq_mma_scan", {"TQS_D": 128, "TQS_B": 4, "TQS_K": 16}),
    ("scan.cu", "tq_mma_scan", {"TQS_D": 1536, "TQS_B": 2, "TQS_K": 16}),
], ids=["attention-d128", "attention-d256", "scan-d128", "scan-d1536"])
def test_tensor_core_kernels_do_not_spill(file, kernel, defines, tmp_path):
    """The measured variants (attention at the default launch shape) keep their registers:
    a spill to local memory would cost more than any instruction saved."""
    if file == "attention.cu":
        warps, min_blocks, qreg = C.ATTENTION_LAUNCH
        defines = {**defines, "TQA_WARPS": warps, "TQA_MINB": min_blocks,
                   "TQA_QREG": int(qreg)}
    full = tmp_path / file
    full.write_text(C.kernel_source(file)[0])
    r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v",
                        *(f"-D{k}={v}" for k, v in defines.items()), *C.NVRTC_OPTIONS[file],
                        str(full), "-o", str(tmp_path / "k.cubin")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    report = r.stderr[r.stderr.index(f"Compiling entry function '{kernel}'"):]
    report = report.split("Compiling entry function")[1]
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report


_NVRTC = None


def _nvrtc():
    global _NVRTC
    if _NVRTC is None:
        from tests.nvrtc import load_nvrtc
        _NVRTC = load_nvrtc() or False
    return _NVRTC


@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("src", CU, ids=[p.name for p in CU])
def test_nvrtc_compiles_with_the_runtime_options(src, arch):
    lib = _nvrtc()
    if not lib:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc to run this check)")
    from tests.nvrtc import compile_source
    kernels = list(C.SOURCES[src.name])
    ok, log, lowered = compile_source(lib, C.kernel_source(src.name)[0], kernels, arch,
                                      C.NVRTC_OPTIONS[src.name])
    assert ok, log
    assert lowered == {k: k for k in kernels}  # extern "C": unmangled names


@pytest.mark.parametrize("d,kb,vb,warps,min_blocks,qreg", [
    (32, 1, 1, 8, 1, 0), (64, 4, 2, 4, 1, 1), (128, 3, 3, 8, 2, 0), (128, 4, 4, 4, 2, 1),
    (160, 2, 4, 8, 1, 0), (256, 4, 4, 4, 1, 1)])
def test_nvrtc_compiles_every_attention_shape(d, kb, vb, warps, min_blocks, qreg):
    """tq_decode_attention is compiled per (D, KB, VB, launch shape) through -D options: the
    corners of what attention_kernel_applies admits."""
    lib = _nvrtc()
    if not lib:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc to run this check)")
    from tests.nvrtc import compile_source
    assert C.attention_kernel_applies(16, d, kb, vb)
    opts = C.NVRTC_OPTIONS["attention.cu"] + [
        f"-DTQA_D={d}", f"-DTQA_KB={kb}", f"-DTQA_VB={vb}", f"-DTQA_WARPS={warps}",
        f"-DTQA_MINB={min_blocks}", f"-DTQA_QREG={qreg}"]
    ok, log, _ = compile_source(lib, C.kernel_source("attention.cu")[0],
                                ["tq_decode_attention"], "90", opts)
    assert ok, log


# -- CPU emulation of the kernels ----------------------------------------------------------------
@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    so = tmp_path_factory.mktemp("emu") / "emu.so"
    r = subprocess.run(["g++", "-std=c++20", "-O2", "-shared", "-fPIC", "-pthread",
                        "-ffp-contract=off", "-Wall", "-Werror", "-Wno-unknown-pragmas",
                        str(ROOT / "tests" / "cuda_emu" / "emu.cpp"), "-o", str(so)],
                       capture_output=True, text=True)
    if r.returncode != 0 and "barrier" in r.stderr:
        pytest.skip(f"g++ lacks C++20 <barrier>: {r.stderr[:200]}")
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(str(so))
    lib.emu_launch.restype = ctypes.c_int
    return lib


class _EmuLauncher:
    def __init__(self, lib, name, defines=()):
        self.lib, self.name, self.defines = lib, name, dict(defines)

    def __call__(self, grid, block, args, smem=0):
        if self.name == "tq_decode_attention":
            self.lib.emu_variant(*(self.defines[k] for k in ("TQA_D", "TQA_KB", "TQA_VB",
                                                             "TQA_WARPS", "TQA_QREG")))
        if self.name == "tq_mma_scan":
            self.lib.emu_variant(*(self.defines[k] for k in ("TQS_D", "TQS_B", "TQS_K",
                                                             "TQS_WARPS")), 0)
        keep, ptrs = [], []
        for a in args:
            if isinstance(a, torch.Tensor):
                v = ctypes.c_void_p(a.data_ptr())
            elif isinstance(a, float):
                v = ctypes.c_double(a)
            else:
                v = ctypes.c_int(a)
            keep.append(v)
            ptrs.append(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p))
        arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
        rc = self.lib.emu_launch(self.name.encode(), grid[0], grid[1], block[0],
                                 ctypes.c_longlong(smem), arr)
        assert rc == 0, f"emu_launch({self.name}) returned {rc}"


@pytest.fixture
def emulated(emu, monkeypatch):
    """tqvec.ops.cuda's host code, with the kernels running on the CPU emulation (a small
    device: 4 multiprocessors, 100 KB of shared memory per block)."""
    monkeypatch.setattr(C, "_kernel", lambda file, name, device, defines=():
                        _EmuLauncher(emu, name, defines))
    monkeypatch.setattr(C, "_props", lambda device: (4, 100 * 1024))
    return C


@pytest.mark.parametrize("b", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("d", [1, 7, 100, 128])
def test_emulated_pack_unpack_quantize_are_bit_exact(emulated, b, d, rng):
    n = 37
    idx = torch.from_numpy(rng.integers(0, 1 << b, (n, d)).astype(np.uint8))
    ref = ops.pack_bits(idx, b, backend="ref")
    assert torch.equal(emulated.pack_bits_cuda(idx, b), ref)
    assert torch.equal(emulated.unpack_bits_cuda(ref, d, b), idx)
    y = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
    scale = torch.from_numpy(rng.uniform(0.1, 3, n).astype(np.float32))
    thr = torch.from_numpy(np.sort(rng.standard_normal((1 << b) - 1)).astype(np.float32))
    y[0, : min(d, len(thr))] = thr[: min(d, len(thr))] / scale[0]  # ties go up
    assert torch.equal(emulated.quantize_pack_cuda(y, scale, thr, b),
                       ops.quantize_pack(y, scale, thr, b, backend="ref"))


@pytest.mark.parametrize("d", [2, 3, 100, 128, 384])
def test_emulated_hadamard_is_bit_exact(emulated, d, rng):
    rot = make_rotation("hadamard", d, 3)
    x = torch.from_numpy(rng.standard_normal((9, d)).astype(np.float32))
    ref = ops.hadamard_rotate(x, rot.perms, rot.signs, rot.p, backend="ref")
    got = emulated.hadamard_rotate_cuda(x, rot.perms, rot.signs, rot.p)
    assert torch.equal(got, ref)
    back = emulated.hadamard_rotate_cuda(got, rot.perms, rot.signs, rot.p, inverse=True)
    assert torch.equal(back, ops.hadamard_rotate(got, rot.perms, rot.signs, rot.p, inverse=True,
                                                 backend="ref"))
    for dt in (torch.float16, torch.bfloat16):  # 16-bit rows are read and converted in-kernel
        xh = x.to(dt)
        assert torch.equal(emulated.hadamard_rotate_cuda(xh, rot.perms, rot.signs, rot.p),
                           ops.hadamard_rotate(xh.float(), rot.perms, rot.signs, rot.p,
                                               backend="ref"))


def _scan_case(rng, nq, n, d, b):
    return scan_case(rng, nq, n, d, b, excluded_every=7)


def _assert_same_topk(got, ref, n_excluded_every=7):
    (vc, pc), (vr, pr) = got, ref
    torch.testing.assert_close(vc, vr, rtol=1e-4, atol=1e-4)
    differ = pc != pr
    assert torch.equal(vc[differ].isfinite(), vr[differ].isfinite())  # ties only
    assert (pc[~torch.isfinite(vc)] == -1).all()
    fin = torch.isfinite(vc)
    assert (pc[fin] % n_excluded_every != 0).all()
    # no row twice in a query's results
    for row in pc:
        r = row[row >= 0]
        assert r.unique().numel() == r.numel()


@pytest.mark.parametrize("d,b,n,nq,k", [
    (128, 4, 3000, 1, 10),      # one lane group per row, many tiles, one query
    (100, 3, 1000, 5, 12),      # b = 3 straddles bytes, d not a multiple of 8
    (96, 2, 700, 11, 1),        # k = 1; two query groups (8 + 3)
    (384, 1, 500, 3, 37),       # k not a power of two
    (1536, 4, 130, 2, 5),       # wide rows: 32 lanes per row
    (64, 8, 300, 9, 100),       # b = 8, many queue merges per tile
    (7, 4, 20, 2, 30),          # k > rows: -inf / -1 padding
])
def test_emulated_lut_scan_matches_reference(emulated, monkeypatch, d, b, n, nq, k, rng):
    monkeypatch.setattr(C, "MMA_SCAN", False)  # the LUT kernel
    case = _scan_case(rng, nq, n, d, b)
    ref = ops.lut_scan(*case, b, k, backend="ref")
    got = emulated.lut_scan_cuda(*case, b, k)
    _assert_same_topk(got, ref)


@pytest.mark.parametrize("d,b,n,nq,k", [
    (128, 4, 3000, 1, 10),      # one query, many tiles and chunks
    (96, 3, 1000, 21, 12),      # two query tiles (16 + 5), b = 3 straddles words
    (64, 2, 700, 3, 1),         # k = 1
    (256, 1, 300, 17, 30),      # 1-bit codes, k near the 32 limit, 17 queries
    (32, 4, 20, 2, 8),          # fewer rows than a tile
    (128, 4, 5, 4, 30),         # k > rows: -inf / -1 padding
])
def test_emulated_mma_scan_matches_reference(emulated, monkeypatch, d, b, n, nq, k, rng):
    """The tensor-core scan (fp16 hi/lo split operands, per-lane register top-k lists)."""
    assert C.mma_scan_applies(d, b, min(k, n))
    calls, real = [], C._mma_scan
    monkeypatch.setattr(C, "_mma_scan", lambda *a: calls.append(1) or real(*a))
    case = _scan_case(rng, nq, n, d, b)
    _assert_same_topk(emulated.lut_scan_cuda(*case, b, k),
                      ops.lut_scan(*case, b, k, backend="ref"))
    assert calls


@pytest.mark.parametrize("qscale", [1e6, 1e-6])
def test_emulated_mma_scan_is_scale_free(emulated, qscale, rng):
    """Queries far outside fp16's range (either way) are scaled by powers of two first."""
    qr, *rest = _scan_case(rng, 3, 500, 128, 4)
    case = (qr * qscale, *rest)
    (vg, pg), (vr, pr) = (emulated.lut_scan_cuda(*case, 4, 10),
                          ops.lut_scan(*case, 4, 10, backend="ref"))
    _assert_same_topk((vg / qscale, pg), (vr / qscale, pr))  # on the unscaled scores' scale


def test_emulated_lut_scan_large_k_takes_the_gemm_path(emulated, rng):
    case = _scan_case(rng, 3, 2000, 32, 4)
    got = emulated.lut_scan_cuda(*case, 4, 300)  # kp = 512 > kernel limit: blocked GEMM
    _assert_same_topk(got, ops.lut_scan(*case, 4, 300, backend="ref"))


def assert_attention_close(got, ref):
    """The tensor-core kernel against the float32 reference: fp16 operands (queries, centroids,
    weights), fp32 accumulation. m within 2e-3 of the score scale; the normalized output within
    3e-3 of its scale; l within 1e-2 relative (a sum of weights each ~1e-3 off)."""
    (m1, l1, a1), (m0, l0, a0) = got, ref
    fin = torch.isfinite(m0)
    assert torch.equal(torch.isfinite(m1), fin)
    assert torch.equal(l1[~fin], l0[~fin]) and not a1[~fin].any()
    torch.testing.assert_close(m1[fin], m0[fin], rtol=2e-3, atol=2e-3)
    # l and acc are relative to exp(m): put both on the reference's max before comparing
    r = torch.exp(m1[fin] - m0[fin])
    torch.testing.assert_close(l1[fin] * r, l0[fin], rtol=1e-2, atol=1e-6)
    out0 = a0[fin] / l0[fin][..., None]
    out1 = a1[fin] / l1[fin][..., None]
    scale = out0.abs().amax(-1, keepdim=True)
    assert ((out1 - out0).abs() / scale).max() < 3e-3


@pytest.mark.parametrize("bh,g,d,t,kb,vb,splits,launch", [
    (3, 4, 128, 700, 3, 3, None, None),     # GQA 4, several splits, d = 128, default launch
    (3, 4, 128, 700, 3, 3, None, (4, 1, True)),  # 4 warps per block, Q in registers
    (2, 1, 64, 300, 4, 2, 1, None),         # a single query, one split
    (4, 8, 96, 257, 2, 4, 3, (4, 2, True)),  # G = 8, d = 96, T not a multiple of the tile
    (2, 16, 256, 190, 4, 4, None, None),    # G = 16 (both halves of the mma tile), d = 256
    (2, 12, 32, 50, 1, 1, 7, (4, 2, False)),  # more splits than tiles; 1-bit codes
    (3, 5, 160, 333, 3, 1, 2, None),        # d = 160 (10 key steps), 1-bit values
])
def test_emulated_decode_attention_matches_reference(emulated, monkeypatch, bh, g, d, t, kb, vb,
                                                     splits, launch, rng):
    if launch is not None:
        monkeypatch.setattr(C, "ATTENTION_LAUNCH", launch)
    case = attn_case(rng, bh, g, d, t, kb, vb)
    assert C.attention_kernel_applies(g, d, kb, vb)
    assert_attention_close(emulated.decode_attention_cuda(*case, splits=splits),
                           ops.decode_attention(*case, backend="ref"))


def test_decode_attention_outside_the_kernel_runs_the_reference(emulated, rng):
    """G > 16, d not a multiple of 32 or 5..8-bit codes: the reference, bit for bit."""
    for bh, g, d, t, kb, vb in ((2, 17, 64, 40, 3, 3), (2, 4, 80, 40, 3, 3),
                                (2, 4, 64, 40, 8, 3)):
        assert not C.attention_kernel_applies(g, d, kb, vb)
        case = attn_case(rng, bh, g, d, t, kb, vb)
        for x, y in zip(emulated.decode_attention_cuda(*case),
                        ops.decode_attention(*case, backend="ref"), strict=True):
            assert torch.equal(x, y)


def test_emulated_launches_past_the_grid_limit_are_split(emulated, monkeypatch, rng):
    """More query groups / (batch x KV head) rows than gridDim.y holds: split launches give the
    one-launch answer (the limit lowered to 2 so that the emulation can afford it)."""
    monkeypatch.setattr(emulated, "_GRID_Y_MAX", 2)
    case = _scan_case(rng, 5, 600, 64, 3)
    _assert_same_topk(emulated.lut_scan_cuda(*case, 3, 7), ops.lut_scan(*case, 3, 7,
                                                                        backend="ref"))
    case = attn_case(rng, 5, 2, 64, 200, 3, 3)
    assert_attention_close(emulated.decode_attention_cuda(*case),
                           ops.decode_attention(*case, backend="ref"))


def test_kernels_refuse_a_dtype_they_would_misread(emulated, rng):
    case = list(_scan_case(rng, 2, 50, 32, 4))
    for i, name in ((0, "qr"), (2, "centroids"), (3, "mult")):
        bad = list(case)
        bad[i] = bad[i].to(torch.bfloat16)
        with pytest.raises(TypeError, match=f"{name} must be torch.float32.*bfloat16"):
            emulated.lut_scan_cuda(*bad, 4, 3)
    att = list(attn_case(rng, 2, 2, 64, 30, 3, 3))
    att[3] = att[3].half()  # key norms in float16, as a cache might hold them
    with pytest.raises(TypeError, match="knorm must be torch.float32.*float16"):
        emulated.decode_attention_cuda(*att)
    with pytest.raises(ValueError, match="qr must be contiguous"):
        emulated.lut_scan_cuda(case[0].T.contiguous().T, *case[1:], 4, 3)


def test_loader_falls_back_to_cupy_then_reports_both_failures(monkeypatch):
    """A torch whose compile route raises (no CUDA_HOME on a pip-only install) falls back to
    CuPy; with neither, the error names both - and unavailable_reason's probe turns it into
    "unavailable" instead of a failure in every op."""
    def broken(*a, **k):
        raise OSError("CUDA_HOME environment variable is not set")

    monkeypatch.setattr(C, "_torch_compiler", lambda: broken)
    monkeypatch.setitem(sys.modules, "cupy", None)  # "not installed"
    with pytest.raises(RuntimeError, match="cannot compile tq_pack_bits: "
                       "torch.cuda._compile_kernel: OSError: CUDA_HOME.*CuPy is not installed"):
        C._Launcher("", "tq_pack_bits", "90", [])

    class FakeCupy:
        class RawModule:
            def __init__(self, code, options):
                self.options = options

            def get_function(self, name):
                return ("cupy", name, self.options)

    monkeypatch.setitem(sys.modules, "cupy", FakeCupy)
    k = C._Launcher("src", "tq_pack_bits", "90", ["--fmad=false"])
    assert k._k == ("cupy", "tq_pack_bits", ("-std=c++17", "-arch=sm_90", "--fmad=false"))
    assert k._cupy is FakeCupy


def test_unavailable_reason_probes_a_compile(monkeypatch):
    monkeypatch.setattr(C.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(C.torch.cuda, "current_device", lambda: 0)

    def no_compile(file, name, device):
        raise RuntimeError(f"cannot compile {name}: CuPy is not installed")

    monkeypatch.setattr(C, "_kernel", no_compile)
    C.unavailable_reason.cache_clear()
    try:
        assert C.unavailable_reason() == ("the probe kernel does not compile: cannot compile "
                                          "tq_pack_bits: CuPy is not installed")
        monkeypatch.setattr(C, "_kernel", lambda file, name, device: object())
        C.unavailable_reason.cache_clear()
        assert C.unavailable_reason() is None
    finally:
        C.unavailable_reason.cache_clear()


def test_kernel_cache_is_per_device(monkeypatch):
    """A module is loaded into one device's context: the same kernel on another device is
    another entry (simulated: two devices of one compute capability)."""
    made = []

    class Props:
        major, minor = 9, 0

    monkeypatch.setattr(C.torch.cuda, "get_device_properties", lambda device: Props)
    monkeypatch.setattr(C.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(C, "_Launcher", lambda src, name, arch, opts: made.append(name) or
                        object())
    monkeypatch.setattr(C, "_compiled", {})
    a = C._kernel("pack.cu", "tq_pack_bits", torch.device("cuda", 0))
    assert C._kernel("pack.cu", "tq_pack_bits", torch.device("cuda", 0)) is a
    b = C._kernel("pack.cu", "tq_pack_bits", torch.device("cuda", 1))
    assert b is not a and made == ["tq_pack_bits", "tq_pack_bits"]


@pytest.mark.hf
def test_kv_adapter_through_the_emulated_kernel(emulated, monkeypatch):
    """The KV adapter's path with the CUDA kernel's own code (CPU emulation): a tiny Llama decoding
    from a compressed cache gives the per-segment path's logits."""
    pytest.importorskip("transformers")
    from tests.test_kv import llama
    from tests.test_kv_step import fused_and_plain

    model = llama(head_dim=32)  # 2 query heads per KV head, head_dim 32: the kernel's shape
    assert C.attention_kernel_applies(2, 32, 3, 2)
    ids = torch.randint(0, 97, (2, 26), generator=torch.Generator().manual_seed(4))
    cfg = dict(key_bits=3, value_bits=2, residual_length=3, sink_length=2)
    plain, fused, calls = fused_and_plain(model, ids, cfg, 12, "ref", monkeypatch,
                                          kernel=lambda *a, **k: emulated.decode_attention_cuda(*a))
    assert calls >= 2 * 14
    torch.testing.assert_close(fused, plain, atol=2e-3, rtol=2e-3)  # fp16 operands


def test_decode_attention_reference_is_softmax_attention(rng):
    """The reference against a direct decode-then-softmax computation."""
    qr, qbias, kp, kn, kc, kb, vp, vn, vc, vb, lo, hi, scale = attn_case(rng, 3, 2, 32, 50, 3, 2)
    m, l, acc = ops.decode_attention(qr, qbias, kp, kn, kc, kb, vp, vn, vc, vb, lo, hi, scale)
    for b in range(3):
        if lo[b] >= hi[b]:
            assert torch.isinf(m[b]).all() and (l[b] == 0).all() and (acc[b] == 0).all()
            continue
        sl = slice(int(lo[b]), int(hi[b]))
        kh = kc[ops.unpack_bits(kp[b, sl].contiguous(), 32, kb).long()] * kn[b, sl, None]
        vh = vc[ops.unpack_bits(vp[b, sl].contiguous(), 32, vb).long()] * vn[b, sl, None]
        s = scale * qr[b] @ kh.T + qbias[b][:, None]
        torch.testing.assert_close(acc[b] / l[b][:, None], torch.softmax(s, -1) @ vh,
                                   rtol=1e-5, atol=1e-5)


def test_scan_shared_memory_fits_for_supported_shapes():
    """Every (d, b, k <= 256) the kernel accepts fits the 100 KB budget with at least one
    query per block (else lut_scan_cuda falls back to the GEMM path, also correct)."""
    for d in (2, 64, 96, 100, 128, 384, 768, 1536, 4096):
        for b in range(1, 9):
            for kp in (1, 16, 256):
                assert C._scan_smem(d, b, 1, kp) <= C._SCAN_SMEM_TARGET


def test_cuda_backend_reports_why_it_is_missing():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert "cuda" not in tqvec.available_backends()
    assert C.unavailable_reason() == "torch sees no CUDA device"
    with pytest.raises(ValueError, match="sees no CUDA device"):
        tqvec.index_factory(16, "TQ4", device="cuda")


# -- on a GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("codec", [
    lambda d: tqvec.TurboQuant(d, 1), lambda d: tqvec.TurboQuant(d, 2),
    lambda d: tqvec.TurboQuant(d, 3), lambda d: tqvec.TurboQuant(d, 4),
    lambda d: tqvec.TurboQuant(d, 3, "prod"), lambda d: tqvec.QJL(d, 2 * d),
    lambda d: tqvec.PolarQuant(d if d % 16 == 0 else 128),
], ids=["tq1", "tq2", "tq3", "tq4", "tqprod3", "qjl", "polar"])
@pytest.mark.parametrize("d", [64, 96, 100, 128, 384, 1536])
def test_gpu_encode_matches_cpu(codec, d, rng):
    """Codes from the GPU equal the CPU's except where a value sits within float rounding of a
    quantizer threshold (norms and GEMMs round differently on the two devices)."""
    cd = codec(d)
    x = rng.standard_normal((1000, cd.dim)).astype(np.float32)
    cpu = cd.encode(x)
    gpu = cd.encode(torch.from_numpy(x).cuda())
    same = (gpu.payload.cpu() == cpu.payload).all(1)
    assert same.float().mean() >= 0.99, f"{(~same).sum()} of 1000 rows differ"
    for k, v in cpu.scalars.items():  # 16-bit scalars: one unit in the last place apart
        rtol = 1e-3 if v.dtype in (torch.float16, torch.bfloat16) else 1e-4
        torch.testing.assert_close(gpu.scalars[k].cpu().float(), v.float(), rtol=rtol,
                                   atol=1e-5)
    # decoded rows: as close as their scalars (a 16-bit radius one unit in the last place off)
    tol = 2e-3 if any(v.dtype == torch.float16 for v in cpu.scalars.values()) else 1e-4
    torch.testing.assert_close(cd.decode(gpu).cpu()[same], cd.decode(cpu)[same], rtol=tol,
                               atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
@pytest.mark.parametrize("d,n,nq", [(128, 20_001, 1), (100, 5000, 32), (384, 3001, 1000)])
def test_gpu_index_matches_cpu_index(metric, d, n, nq, rng):
    xb = rng.standard_normal((n, d)).astype(np.float32)
    xq = rng.standard_normal((nq, d)).astype(np.float32)
    cpu = tqvec.index_factory(d, "TQ4", metric)
    gpu = tqvec.index_factory(d, "TQ4", metric, device="cuda")
    cpu.add(xb)
    gpu.add(xb)
    Dc, Ic = cpu.search(xq, 10)
    Dg, Ig = gpu.search(xq, 10)
    assert Dg.dtype == np.float32 and Ig.dtype == np.int64
    np.testing.assert_allclose(Dg, Dc, rtol=1e-3, atol=1e-3)
    assert (Ig == Ic).mean() > 0.98  # equal up to ties / threshold-adjacent codes


@pytest.mark.gpu
@pytest.mark.parametrize("bh,g,d,t,kb,vb", [(8, 4, 128, 5000, 3, 3), (2, 8, 64, 777, 4, 2),
                                            (4, 1, 256, 3000, 2, 2), (1, 4, 128, 1, 3, 3),
                                            (3, 16, 96, 2049, 1, 4), (70000, 2, 32, 20, 2, 3)])
def test_gpu_decode_attention_matches_reference(bh, g, d, t, kb, vb, rng):
    case = [c.cuda() if isinstance(c, torch.Tensor) else c
            for c in attn_case(rng, bh, g, d, t, kb, vb)]
    assert_attention_close(ops.decode_attention(*case, backend="cuda"),
                           ops.decode_attention(*case, backend="ref"))


@pytest.mark.gpu
@pytest.mark.hf
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("residual_bits", [None, 8])
def test_gpu_kv_adapter_uses_the_kernel(dtype, residual_bits, monkeypatch):
    """On a CUDA model the adapter runs the code segment through the CUDA kernel ("auto") and
    matches the per-segment torch path, with an exact or an 8-bit window (the recommended
    setting), in each of the dtypes models run in."""
    pytest.importorskip("transformers")
    from tests.test_kv import llama
    from tests.test_kv_step import fused_and_plain

    model = llama(head_dim=32).to("cuda", dtype)  # the kernel's shape (d % 32 == 0)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(5)).cuda()
    cfg = dict(key_bits=3, value_bits=3, residual_length=4, sink_length=2,
               residual_bits=residual_bits)
    plain, fused, calls = fused_and_plain(model, ids, cfg, 16, "auto", monkeypatch)
    assert calls
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(fused.float(), plain.float(), atol=tol, rtol=tol)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
