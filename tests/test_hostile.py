"""Hostile parameters and files: a correct answer or a clear error, never a crash, a hang or an
unbounded allocation. Each case here once crashed, hung, leaked or answered wrongly.

Cases that used to kill the process run in a subprocess (``run_isolated``), so that a
regression fails its test instead of the whole run.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import tqvec
from tqvec import FormatError
from tqvec import _validate as V
from tqvec.cli import main
from tqvec.io import MAGIC, read_container, write_container

ROOT = Path(__file__).resolve().parents[1]


def run_isolated(code: str, timeout: float = 120, memory_gb: float | None = None
                 ) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (optionally under an address-space limit); a crash
    shows as a negative return code instead of killing pytest."""
    pre = ""
    if memory_gb is not None:
        pre = (f"import resource\nlim = int({memory_gb!r} * 2**30)\n"
               "resource.setrlimit(resource.RLIMIT_AS, (lim, lim))\n")
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c",
                           pre + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def craft(path: Path, mutate) -> None:
    """Rewrite a container's raw header through ``mutate(doc)`` (or with the bytes it returns)
    under a valid checksum, keeping the bytes after it: what an attacker can do to a file (the
    checksums guard against damage, not against intent)."""
    data = path.read_bytes()
    hlen = struct.unpack("<I", data[12:16])[0]
    doc = json.loads(data[16:16 + hlen])
    body = data[16 + hlen + 32:]
    header = mutate(doc)
    header = header if isinstance(header, bytes) else json.dumps(doc).encode()
    path.write_bytes(MAGIC + struct.pack("<II", 1, len(header)) + header
                     + hashlib.sha256(header).digest() + body)


def craft_meta(path: Path, kind: str, edit) -> None:
    """Rewrite a container with ``edit(meta)`` applied, laid out and checksummed as tqvec
    writes it: only the header's values are hostile."""
    meta, arrays, _ = read_container(path, kind)
    edit(meta)
    write_container(path, kind, meta, {k: np.array(v) for k, v in arrays.items()})


@pytest.fixture
def prefilter_file(tmp_path, rng):
    x = rng.standard_normal((2000, 32)).astype(np.float32)
    index = tqvec.index_factory(32, "TQ2,Prefilter(10)", "l2")
    index.add(x)
    tqvec.write_index(index, tmp_path / "p.tqv")
    return tmp_path / "p.tqv", x


# -- 1. parameters that reach a kernel ---------------------------------------------------------

def test_huge_prefilter_never_reaches_the_kernel():
    out = run_isolated("""
        import numpy as np, tqvec
        x = np.random.default_rng(0).standard_normal((2000, 32)).astype(np.float32)
        for spec in ("TQ1", "TQ2", "TQ4"):
            index = tqvec.index_factory(32, spec + ",Prefilter(10)", "l2")
            index.add(x)
            exact = tqvec.index_factory(32, spec, "l2")
            exact.add(x)
            for bad in (2**60, 922337203685477581, 10**9):
                try:
                    index.prefilter = bad
                    raise SystemExit(f"prefilter={bad} accepted")
                except ValueError as e:
                    assert "prefilter must be in 0..1048576" in str(e), e
            index.prefilter = 2**20  # every row a candidate: the exact full-code ranking
            for nq in (1, 2, 7):
                D, I = index.search(x[:nq], 10)
                De, Ie = exact.search(x[:nq], 10)
                assert (I == Ie).all() and (I >= 0).all(), (spec, nq)
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_prefilter_in_a_crafted_header_is_refused(prefilter_file):
    path, _ = prefilter_file

    craft_meta(path, "index", lambda meta: meta.update(prefilter=1099511627776))
    with pytest.raises(FormatError, match="prefilter must be in 0..1048576"):
        tqvec.read_index(path)


@pytest.mark.parametrize("k", [True, 1.5, "3", None])
@pytest.mark.parametrize("spec", ["TQ4", "PCA,TQ2", "IVF4,TQ2", "Center,TQ2,Prefilter(4)"])
def test_k_must_be_an_int_for_every_index(spec, k, rng):
    x = rng.standard_normal((300, 16)).astype(np.float32)
    index = tqvec.index_factory(16, spec, "l2")
    index.train(x)
    index.add(x)
    with pytest.raises(TypeError, match="k must be an int"):
        index.search(x[:2], k)


def test_k_beyond_the_padding_limit_is_a_value_error(rng):
    x = rng.standard_normal((2000, 16)).astype(np.float32)
    index = tqvec.index_factory(16, "TQ4", "l2")
    index.add(x)
    with pytest.raises(ValueError, match="k must be in 1..65536"):
        index.search(x[:2], 10**9)
    D, I = index.search(x[:1], 2500)  # padding beyond ntotal, as faiss
    assert (I[0, 2000:] == -1).all() and (I[0, :2000] >= 0).all()


def test_candidate_factors_and_nprobe_are_bounded(rng):
    index = tqvec.index_factory(16, "TQ2,Refine(Flat)", "l2")
    with pytest.raises(ValueError, match="k_factor must be in 1..1048576"):
        index.k_factor = 2**40
    with pytest.raises(TypeError, match="k_factor must be an int"):
        index.k_factor = 2.0
    ivf = tqvec.index_factory(16, "IVF4,TQ2", "l2")
    with pytest.raises(ValueError, match="nprobe must be in 1..16777216"):
        ivf.nprobe = 2**40
    x = rng.standard_normal((400, 16)).astype(np.float32)
    ivf.train(x)
    ivf.add(x)
    ivf.nprobe = 1000  # more lists than there are: all of them, as faiss
    assert (ivf.search(x[:3], 5)[1] >= 0).all()


def test_kernel_shape_errors_name_the_parameter_the_expected_and_the_given_shape():
    """Every binding checks shapes with one helper: the ValueError names the function, the
    parameter, the shape expected and the shape that came; the one-call searchers take their
    arguments by keyword only (a positional call cannot put an array in the wrong slot)."""
    _C = pytest.importorskip("tqvec._C")
    n, d, b, k = 40, 64, 4, 3
    q = np.zeros((2, d), np.float32)
    c, one = np.zeros(16, np.float32), np.ones(n, np.float32)
    vals, idx = np.empty((2, k), np.float32), np.empty((2, k), np.int64)
    with pytest.raises(ValueError, match=r"^fast_scan: blocked codes must have shape "
                                         r"\(2, 32, 32\), got \(1, 32, 32\)$"):
        _C.fast_scan(q, np.zeros((1, 32, 32), np.uint8), n, c, one, one, b, k, False, vals,
                     idx, 1)
    with pytest.raises(ValueError, match=r"^fast_scan: mult must have shape \(40,\), "
                                         r"got \(39,\)$"):
        _C.fast_scan(q, np.zeros((2, 32, 32), np.uint8), n, c, one[1:], one, b, k, False, vals,
                     idx, 1)
    with pytest.raises(ValueError, match=r"^lut_scan: out_idx must have shape \(2, 3\), "
                                         r"got \(2, 4\)$"):
        _C.lut_scan(q, np.zeros((n, 32), np.uint8), c, one, one, b, k, vals,
                    np.empty((2, 4), np.int64), 1)
    perms = np.tile(np.arange(d, dtype=np.int64), (2, 1))
    signs = np.ones((2, d), np.float32)
    with pytest.raises(ValueError, match=r"^Rotation: signs must have shape \(2, 64\), "
                                         r"got \(2, 63\)$"):
        _C.Rotation(perms, signs[:, 1:], 64)
    with pytest.raises(ValueError, match="Rotation: perms holds an entry outside"):
        _C.Rotation(perms + 1, signs, 64)
    rot = _C.Rotation(perms, signs, 64)
    with pytest.raises(TypeError):
        _C.FlatSearcher(rot, np.zeros((2, 32, 32), np.uint8), n, b, c, one, one,
                        np.arange(n), 1)
    with pytest.raises(ValueError, match=r"^FlatSearcher: ids must have shape \(40,\)"):
        _C.FlatSearcher(rotation=rot, blocked=np.zeros((2, 32, 32), np.uint8), n=n, bits=b,
                        centroids=c, mult=one, add=one, ids=np.arange(n - 1), metric=1)
    searcher = _C.FlatSearcher(rotation=rot, blocked=np.zeros((2, 32, 32), np.uint8), n=n,
                               bits=b, centroids=c, mult=one, add=one, ids=np.arange(n),
                               metric=1)
    with pytest.raises(ValueError, match=r"^FlatSearcher.search: q must have shape \(\*, 64\), "
                                         r"got \(2, 63\)$"):
        searcher.search(q[:, 1:], vals, idx, 1, 1)
    assert searcher.search(q, vals, idx, 1, 1) and (idx >= 0).all()


def test_negative_extents_are_refused_not_taken_for_the_wildcard():
    """A negative size (d = -1) matches no shape: it once passed as check_shape's "any extent"
    and unpack_bits copied SIZE_MAX bytes (SIGSEGV)."""
    out = run_isolated("""
        import numpy as np
        from tqvec import _C
        packed = np.zeros((4, 0), np.uint8)
        for call in (lambda: _C.unpack_bits(packed, -1, 1, np.zeros((4, 0), np.uint8), 1),
                     lambda: _C.unpack_bits(packed, -9, 4, np.zeros((4, 0), np.uint8), 1),
                     lambda: _C.centroid_stats(packed, -1, 2, np.zeros(4, np.float32), None,
                                               None, np.zeros(4, np.float32), None, 1)):
            try:
                call()
            except ValueError as e:
                print("ValueError", str(e).split(":")[0])
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ValueError", "unpack_bits", "ValueError", "unpack_bits",
                                  "ValueError", "centroid_stats"], out.stdout


def test_kernels_refuse_or_clamp_hostile_sizes():
    """The compiled entry points re-check what the Python side lets through: a bad size is a
    ValueError, a candidate count beyond the rows means every row - never undefined
    behaviour."""
    out = run_isolated("""
        import numpy as np, torch
        from tqvec import ops, _C
        rng = np.random.default_rng(0)
        n, d, b, k = 300, 32, 2, 5
        packed = ops.pack_bits(torch.from_numpy(rng.integers(0, 4, (n, d)).astype(np.uint8)),
                               b, backend="ref")
        blocked = ops.block_codes(packed, d, b).numpy()
        signs = ops.block_codes(ops.pack_bits(torch.from_numpy(
            rng.integers(0, 2, (n, d)).astype(np.uint8)), 1, backend="ref"), d, 1).numpy()
        q = rng.standard_normal((2, d)).astype(np.float32)
        c = np.sort(rng.standard_normal(4)).astype(np.float32)
        c1 = np.array([-1, 1], np.float32)
        one = np.ones(n, np.float32)
        vals, idx = np.empty((2, k), np.float32), np.empty((2, k), np.int64)
        refused = 0
        def expect_refusal(f):
            global refused
            try:
                f()
            except ValueError:
                refused += 1
                return
            raise SystemExit("accepted: " + repr(f))
        # sizes that disagree with the arrays
        expect_refusal(lambda: _C.fast_scan(q, blocked, n + 64, c, one, one, b, k, False,
                                            vals, idx, 1))
        expect_refusal(lambda: _C.fast_scan(q, blocked, -1, c, one, one, b, k, False,
                                            vals, idx, 1))
        expect_refusal(lambda: _C.fast_scan(q, blocked, n, c, one, one, 9, k, False,
                                            vals, idx, 1))
        expect_refusal(lambda: _C.fast_scan(q, blocked, n, c[:3], one, one, b, k, False,
                                            vals, idx, 1))
        expect_refusal(lambda: _C.fast_scan(q, blocked, n, c, one, one, b, k + 1, False,
                                            vals, idx, 1))
        expect_refusal(lambda: _C.fast_scan_two_stage(q, signs, n, c1, packed.numpy(), b, c,
                                                      one, one, one, 0, k, vals, idx, 1))
        expect_refusal(lambda: _C.fast_scan_two_stage(q, signs, n, c1, packed.numpy(), b, c,
                                                      one, one, one, -(2**62), k, vals, idx, 1))
        # a first pass asked for more candidates than there are rows: every row
        for k1 in (n, n + 1, 2**40, 2**62):
            _C.fast_scan_two_stage(q, signs, n, c1, packed.numpy(), b, c, one, one, one, k1, k,
                                   vals, idx, 1)
            assert (idx >= 0).all() and (idx < n).all()
        print("ok", refused)
    """)
    assert out.returncode == 0 and out.stdout.split()[0] == "ok", out.stderr[-2000:]


# -- 2. loading is bounded by the file -----------------------------------------------------

@pytest.mark.parametrize("params, match", [
    ({"dim": 20000, "rotation": "haar"}, "dim must be at most 4096 for rotation='haar'"),
    ({"dim": 4097, "rotation": "haar"}, "dim must be at most 4096 for rotation='haar'"),
    ({"dim": 2**40}, "dim must be in 2..1048576"),
    ({"variant": "prod", "sketch_dim": 2**31, "jl": "orthogonal"}, "sketch_dim must be in"),
    ({"dim": 4096, "variant": "prod", "sketch_dim": 2**20, "jl": "gaussian"},
     "at most 67108864 elements"),
    ({"backend": "cuda"}, "must not hold 'backend'"),
    ({"bits": 2.0}, "bits must be an int"),
    ({"rounds": 3, "bits": True}, "bits must be an int"),
    ({"extra": 1}, "unexpected keyword"),
])
def test_header_params_that_would_allocate_or_misbehave(codes_file, params, match,
                                                        refuse_draws):
    """Checksum-valid headers whose params ask for terabytes, hours, a CUDA device or a
    non-canonical form: a FormatError before anything is drawn (any draw fails the test)."""
    craft_meta(codes_file, "codes", lambda meta: meta["params"].update(params))
    refuse_draws()
    with pytest.raises(FormatError, match=match):
        tqvec.load_codes(codes_file)


def test_a_crafted_haar_header_fails_fast_under_a_memory_limit(codes_file):
    def edit(meta):
        meta["params"].update(dim=20000, rotation="haar")
        meta["params"].pop("rounds")
    craft_meta(codes_file, "codes", edit)
    out = run_isolated(f"""
        import tqvec
        try:
            tqvec.load_codes({str(codes_file)!r})
        except tqvec.FormatError as e:
            print("FormatError", e)
    """, memory_gb=4, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("FormatError"), out.stderr[-2000:]


@pytest.mark.parametrize("edit", [
    lambda d: d["arrays"][0].update(shape=[2**32, 2**32]),
    lambda d: d["arrays"][0].update(dtype=["uint8"]),
    lambda d: d.update(arrays=5),
    lambda d: d["arrays"][0].update(offset=1e400),
    lambda d: d["arrays"][0].update(offset=-64),
    lambda d: d["arrays"][0].update(nbytes=2**70),
    lambda d: d["arrays"][0].update(name=7),
    lambda d: d["arrays"].append(dict(d["arrays"][0])),
    lambda d: d.update(meta=[]),
    lambda d: d["meta"].update(n=-1),
    lambda d: d["meta"].update(n=49),
    lambda d: d["meta"].update(code_size="8"),
    lambda d: d["meta"].pop("fingerprint"),
    lambda d: d["meta"].update(params={"codec": "no-such"}),
    lambda d: d["meta"].update(params=[1, 2]),
    lambda d: b"[" * 100000 + b"]" * 100000,
    lambda d: b'{"kind": "codes", "meta": {"n": NaN}, "arrays": []}',
    lambda d: b"\xff\xfe not utf-8",
    lambda d: b'{"kind": "codes", "meta": {"n": ' + b"9" * 5000 + b"}, \"arrays\": []}",
])
def test_malformed_headers_are_format_errors(codes_file, edit):
    craft(codes_file, edit)
    with pytest.raises(FormatError):
        tqvec.load_codes(codes_file)


def test_counts_must_agree_with_the_arrays(tmp_path, rng):
    x = rng.standard_normal((500, 16)).astype(np.float32)
    index = tqvec.index_factory(16, "TQ4", "l2")
    index.add(x)
    tqvec.write_index(index, tmp_path / "i.tqv")

    craft_meta(tmp_path / "i.tqv", "index", lambda meta: meta.update(ntotal=0))
    with pytest.raises(FormatError, match="says it holds 0 vectors"):
        tqvec.read_index(tmp_path / "i.tqv")


@pytest.mark.parametrize("what", ["codes", "index"])
def test_trailing_bytes_are_refused(tmp_path, codes_file, what, rng):
    path = codes_file
    if what == "index":
        index = tqvec.index_factory(16, "TQ4", "l2")
        index.add(rng.standard_normal((50, 16)).astype(np.float32))
        path = tmp_path / "i.tqv"
        tqvec.write_index(index, path)
    with open(path, "ab") as f:
        f.write(b"\0" * 64)
    with pytest.raises(FormatError, match="arrays end at byte"):
        (tqvec.load_codes if what == "codes" else tqvec.read_index)(path)


@pytest.mark.parametrize("mmap", [False, True])
def test_every_byte_of_a_file_is_checked(codes_file, mmap):
    """A flip anywhere - magic, version, header, its checksum, padding, arrays - is caught."""
    data = codes_file.read_bytes()
    for pos in range(0, len(data), 7):
        bad = bytearray(data)
        bad[pos] ^= 0x10
        codes_file.write_bytes(bytes(bad))
        with pytest.raises(FormatError):
            tqvec.load_codes(codes_file, mmap=mmap)


def test_only_regular_files_are_read(tmp_path, capsys):
    """A FIFO is refused at once (reading one blocks until a writer comes); devices too."""
    fifo = tmp_path / "f.tqv"
    os.mkfifo(fifo)
    result: list = []

    def read():
        for f in (tqvec.read_index, tqvec.load_codes):
            try:
                f(fifo)
            except FormatError as e:
                result.append(str(e))
        for cmd in (["info", str(fifo)], ["decode", str(fifo), str(tmp_path / "o.npy")],
                    ["encode", str(fifo), str(tmp_path / "o.tqc")]):
            result.append(main(cmd))
    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # unblock the reader so the test run can go on
        with open(fifo, "wb"):
            pass
        pytest.fail("reading a FIFO blocked")
    assert result[:2] == [f"{str(fifo)!r} is not a tqvec file: it is a FIFO, not a regular "
                          "file"] * 2
    assert result[2:] == [2, 2, 2]
    with pytest.raises(FormatError, match="character device"):
        tqvec.load_codes("/dev/zero")
    with pytest.raises(IsADirectoryError):
        tqvec.read_index(tmp_path)


# -- 4. sketches without a d x d matrix --------------------------------------------------------

def test_a_short_sketch_needs_no_square_matrix():
    """QJL(65536, sketch_dim=256) drew a 65,536 x 65,536 float64 matrix (32 GiB) for 256 rows;
    now O(m d): under a 2 GiB address-space limit it builds, and its rows are orthogonal
    with the E[chi_d] norm."""
    out = run_isolated("""
        import numpy as np, torch, tqvec
        from tqvec.random import jl_row_scale
        c = tqvec.QJL(65536, sketch_dim=256, seed=1)
        S = c._arr.get("S", torch.device("cpu")).double().numpy()
        G = S @ S.T / jl_row_scale(65536) ** 2
        assert S.shape == (256, 65536) and np.abs(G - np.eye(256)).max() < 1e-4
        t = tqvec.TurboQuant(65536, 3, "prod", sketch_dim=128)
        print("ok", c.params["jl_version"])
    """, memory_gb=3, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["ok", "2"], out.stderr[-2000:]


def test_dense_matrices_beyond_the_limit_are_refused_before_drawing(monkeypatch, refuse_draws):
    refuse_draws()
    with pytest.raises(ValueError, match="at most 67108864 elements"):
        tqvec.TurboQuant(65536, 3, "prod")  # sketch_dim = d: a 65,536^2 JL matrix
    with pytest.raises(ValueError, match="dim must be at most 4096 for rotation='haar'"):
        tqvec.TurboQuant(8193, 2, rotation="haar")
    with pytest.raises(ValueError, match="use jl='gaussian'"):  # 4 QRs of 4,096 x 4,096
        tqvec.QJL(4096, 4 * 4096)
    with pytest.raises(ValueError, match="use jl='gaussian'"):  # version 1: a 8,191^2 Haar draw
        tqvec.QJL(8193, 24, outliers=[2, 5], jl_version=1)
    monkeypatch.undo()
    tqvec.QJL(4096, 4 * 4096, jl="gaussian")  # no orthogonalization: only the memory bound


def test_short_sketches_stay_unbiased(rng):
    """The thin draw's rows have the law of a Haar matrix's rows: the estimator stays unbiased
    (mean over seeds within 4 standard errors of the truth)."""
    d, m = 64, 16
    x = rng.standard_normal((1, d)).astype(np.float32)
    q = rng.standard_normal((1, d)).astype(np.float32)
    est = np.array([tqvec.QJL(d, m, seed=s).score(q, tqvec.QJL(d, m, seed=s).encode(x))[0, 0]
                    for s in range(400)])
    truth = float(q[0] @ x[0])
    assert abs(est.mean() - truth) < 4 * est.std() / np.sqrt(len(est))


# -- 5. API edges ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["TQ2,Prefilter(10)", "TQ1,Prefilter(10)",
                                  "Center,TQ4,Prefilter(5)", "PCA,TQ2,Prefilter(5)"])
def test_removing_every_row_leaves_an_empty_index_that_searches(spec, rng):
    x = rng.standard_normal((3000, 32)).astype(np.float32)
    index = tqvec.index_factory(32, spec, "l2")
    index.train(x)
    index.add(x)
    assert index.remove_ids(np.arange(3000)) == 3000
    D, I = index.search(x[:2], 5)
    assert (I == -1).all() and (D == np.finfo(np.float32).max).all()


def test_tensors_that_require_grad_are_accepted(rng):
    x = torch.from_numpy(rng.standard_normal((200, 16)).astype(np.float32)).requires_grad_()
    c = tqvec.TurboQuant(16, 3)
    codes = c.encode(x)
    assert c.score(x[:2], codes).shape == (2, 200)
    index = tqvec.index_factory(16, "TQ3", "l2")
    index.add(x)
    assert index.search(x[:2], 3)[1].shape == (2, 3)


def test_meta_tensors_are_a_value_error():
    with pytest.raises(ValueError, match="x must be on the 'cpu' or a 'cuda' device"):
        tqvec.TurboQuant(16, 2).encode(torch.empty((3, 16), device="meta"))


def test_ivf_add_before_train_is_a_value_error(rng):
    ivf = tqvec.index_factory(16, "IVF4,TQ2", "l2")
    with pytest.raises(ValueError, match="must be trained before add"):
        ivf.add(rng.standard_normal((10, 16)).astype(np.float32))


@pytest.mark.parametrize("spec", ["TQ4", "IVF4,TQ2", "PCA,TQ2"])
def test_ids_must_be_integers_within_int64(spec, rng):
    x = rng.standard_normal((300, 16)).astype(np.float32)
    index = tqvec.index_factory(16, spec, "l2")
    index.train(x)
    index.add(x)
    with pytest.raises(TypeError, match="ids must be an integer array, got dtype float64"):
        index.remove_ids(np.array([1.5]))
    with pytest.raises(TypeError, match="key must be an int id"):
        index.reconstruct(1.5)
    with pytest.raises(TypeError, match="allowed_ids must be an integer array"):
        index.search(x[:1], 3, allowed_ids=np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="ids must be int64 values"):
        index.remove_ids([2**70])
    with pytest.raises(TypeError, match="ids must be an integer array"):
        index.remove_ids([1, "2"])
    assert index.ntotal == 300 and index.remove_ids([1]) == 1
    assert index.remove_ids(np.array([], dtype=np.int64)) == 0 and index.remove_ids([]) == 0


def test_ids_up_to_int64_max_and_add_after_them(rng):
    x = rng.standard_normal((4, 16)).astype(np.float32)
    index = tqvec.index_factory(16, "TQ4", "l2")
    index.add_with_ids(x[:2], np.array([5, V.INT64_MAX]))
    with pytest.raises(ValueError, match="do not fit in int64; use add_with_ids"):
        index.add(x[2:])
    index.add_with_ids(x[2:], np.array([7, 8]))
    assert sorted(index.search(x, 4)[1][0].tolist()) == [5, 7, 8, V.INT64_MAX]
    with pytest.raises(ValueError, match=r"ids must be in 0..2\*\*63-1, got -1"):
        index.add_with_ids(x[:1], np.array([-1]))


def test_range_search_radius_must_be_finite(rng):
    index = tqvec.index_factory(16, "TQ4", "l2")
    index.add(rng.standard_normal((10, 16)).astype(np.float32))
    with pytest.raises(ValueError, match="radius must be finite"):
        index.range_search(np.ones((1, 16), np.float32), float("nan"))
