import importlib.util
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

import tqvec

settings.register_profile("ci", derandomize=True, max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=40, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE",
                                                                           "ci"))

@pytest.fixture(scope="module")
def one_thread_each():
    """One faiss (OpenMP) and one torch thread: faiss's HNSW adds in parallel threads insert in
    a varying order, its k-means too, and a torch GEMM (the decoded-block route of small
    indexes) rounds by how many threads it gets, which varies with other threads' searches.
    Tests that compare an index with a replay of it need the same bits (the compiled kernels'
    results do not depend on threads: tests/test_threads.py)."""
    import faiss
    before = faiss.omp_get_max_threads(), torch.get_num_threads()
    faiss.omp_set_num_threads(1)
    torch.set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before[0])
    torch.set_num_threads(before[1])


@pytest.fixture
def refuse_draws(monkeypatch):
    """``refuse_draws(mp=monkeypatch)``: from then on any draw of a random matrix (a JL sketch,
    a Haar or Hadamard rotation) fails the test - what "refused before anything is drawn"
    means, checked without a clock."""
    import tqvec.random as R

    def refuse(*a, **k):
        raise AssertionError("a random matrix was drawn")

    def arm(mp=monkeypatch):
        for name in ("haar_frame", "haar_matrix", "jl_matrix", "make_rotation"):
            mp.setattr(R, name, refuse)
        for mod in (tqvec.codecs.qjl, tqvec.codecs.turbo, tqvec.codecs.polar):
            for name in ("jl_matrix", "make_rotation"):
                if hasattr(mod, name):
                    mp.setattr(mod, name, refuse)
    return arm


_NEEDS = {
    "gpu": (lambda: torch.cuda.is_available(), "no CUDA device"),
    "nvcc": (lambda: shutil.which("nvcc") is not None, "nvcc not found"),
    "hf": (lambda: importlib.util.find_spec("transformers") is not None,
           "transformers not installed"),
    "ray": (lambda: all(importlib.util.find_spec(m) for m in ("ray", "pyarrow")),
            "ray or pyarrow not installed (pip install 'tqvec[ray]')"),
    "arm": (lambda: all(shutil.which(t) for t in ("aarch64-linux-gnu-g++", "qemu-aarch64", "g++")),
            "no aarch64 cross compiler or qemu-aarch64 (Debian: g++-aarch64-linux-gnu qemu-user)"),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, (check, why) in _NEEDS.items():
            if marker in item.keywords and not check():
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(params=["ref", "cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def backend(request):
    """Each reference-vs-kernel test is written once and runs on every available backend."""
    if request.param == "cpu" and "cpu" not in tqvec.available_backends():
        pytest.skip("tqvec._C not built")
    if request.param == "cuda" and "cuda" not in tqvec.available_backends():
        pytest.skip(f"CUDA kernels unavailable: {tqvec.ops.cuda.unavailable_reason()}")
    return request.param


def on(backend, *tensors):
    """The tensors on the backend's device (CUDA kernels take CUDA tensors)."""
    out = tuple(t.cuda() if backend == "cuda" else t for t in tensors)
    return out if len(out) > 1 else out[0]


def scan_case(rng, nq, n, d, b, excluded_every):
    """(qr, packed, centroids, mult, add) for the LUT-scan ops: random b-bit rows, sorted
    centroids, positive multipliers, every ``excluded_every``-th row filtered (add = -inf)."""
    from tqvec import ops

    qr = torch.from_numpy(rng.standard_normal((nq, d)).astype(np.float32))
    idx = torch.from_numpy(rng.integers(0, 1 << b, (n, d)).astype(np.uint8))
    packed = ops.pack_bits(idx, b, backend="ref")
    c = torch.from_numpy(np.sort(rng.standard_normal(1 << b)).astype(np.float32))
    mult = torch.from_numpy(rng.uniform(0.5, 2, n).astype(np.float32))
    add = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    add[::excluded_every] = -float("inf")
    return qr, packed, c, mult, add


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def unit_rows(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def attn_case(rng, bh, g, d, t, kb, vb):
    """Arguments of ops.decode_attention: random codes, norms and sorted centroids, token
    ranges [lo, hi) per head (one full, one empty when bh > 2), scale 1/sqrt(d)."""
    from tqvec import ops

    qr = torch.from_numpy(rng.standard_normal((bh, g, d)).astype(np.float32))
    qbias = torch.from_numpy(rng.standard_normal((bh, g)).astype(np.float32))
    kp = ops.pack_bits(torch.from_numpy(rng.integers(0, 1 << kb, (bh * t, d)).astype(np.uint8)),
                       kb, backend="ref").reshape(bh, t, -1)
    vp = ops.pack_bits(torch.from_numpy(rng.integers(0, 1 << vb, (bh * t, d)).astype(np.uint8)),
                       vb, backend="ref").reshape(bh, t, -1)
    kn = torch.from_numpy(rng.uniform(0.5, 2, (bh, t)).astype(np.float32))
    vn = torch.from_numpy(rng.uniform(0.5, 2, (bh, t)).astype(np.float32))
    kc = torch.from_numpy(np.sort(rng.standard_normal(1 << kb)).astype(np.float32))
    vc = torch.from_numpy(np.sort(rng.standard_normal(1 << vb)).astype(np.float32))
    lo = torch.from_numpy(rng.integers(0, max(1, t // 3), bh).astype(np.int32))
    hi = torch.from_numpy(rng.integers(t // 2, t + 1, bh).astype(np.int32))
    hi[0] = t                       # one full row
    if bh > 2:
        lo[1], hi[1] = 5, 5         # an empty range: m = -inf, l = 0, acc = 0
    return qr, qbias, kp, kn, kc, kb, vp, vn, vc, vb, lo, hi, 1.0 / np.sqrt(d)


def assert_numpy_path_matches(index, queries, k=10):
    """Each query set as float32 numpy (the one compiled call where the index has it) and as a
    torch tensor (the composition of ops): bit-identical (D, I). Returns the last."""
    for q in queries:
        D1, I1 = index.search(q, k)
        D2, I2 = index.search(torch.from_numpy(q), k)
        np.testing.assert_array_equal(I1, I2)
        np.testing.assert_array_equal(D1, D2)
    return D1, I1


@pytest.fixture
def codes_file(tmp_path, rng):
    """A small TurboQuant codes file (tests/test_hostile*.py craft their cases from it)."""
    c = tqvec.TurboQuant(16, 2, seed=1)
    tqvec.save_codes(tmp_path / "c.tqc", c.encode(rng.standard_normal((50, 16))
                                                   .astype(np.float32)))
    return tmp_path / "c.tqc"
