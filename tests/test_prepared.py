"""The prepared ops as rows of the dispatch table: every prepared row maps its argument struct to
a runner chosen by ``pick``; the compiled runner gives the reference's results; a kernel that
cannot take a struct leaves it to the reference; a fused row's reference is "no fused form"."""

import numpy as np
import pytest
import torch

from tqvec import ops
from tqvec.ops import dispatch

needs_cpu = pytest.mark.skipif("cpu" not in ops.available_backends(),
                               reason="tqvec._C not built")

PREPARED = ["hadamard_rotate_prepared", "fast_scan_prepared", "ivf_fast_scan_prepared",
            "ivf_probe_prepared"]
FUSED = ["flat_search_fused", "terms_search_fused", "ivf_search_fused", "graph_search"]


def test_every_prepared_row_has_a_reference_and_a_cpu_kernel():
    for name in PREPARED + FUSED:
        op = dispatch.OPS[name]
        assert callable(op.ref) and callable(op.cpu), name
    for name in FUSED:
        assert dispatch.OPS[name].ref(object()) is None


def _codes(rng, n, d, b):
    idx = torch.from_numpy(rng.integers(0, 1 << b, (n, d)).astype(np.uint8))
    packed = ops.pack_bits(idx, b)
    c = torch.from_numpy(np.sort(rng.standard_normal(1 << b)).astype(np.float32))
    mult = torch.from_numpy(rng.uniform(0.5, 1.5, n).astype(np.float32))
    return packed, ops.block_codes(packed, d, b), c, mult


def _scans(rng, n=300, d=40):
    """(name, FastScan under backend, query terms, k1) for each of the scan's forms."""
    add = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    p2, bl2, c2, m2 = _codes(rng, n, d, 2)
    p3, bl3, c3, m3 = _codes(rng, n, 24, 3)
    _, bl1, c1, _ = _codes(rng, n, d, 1)
    q = [torch.from_numpy(rng.standard_normal((5, w)).astype(np.float32)) for w in (d, 24)]
    one = [ops.ScanTerm(bl2, c2, m2, 2)]
    two = [ops.ScanTerm(bl2, c2, m2, 2, p2), ops.ScanTerm(bl3, c3, m3, 3, p3)]
    full = ops.FullCodes(p2, 2, c2)
    return [("one term", lambda be: ops.FastScan(one, n, add, be), q[:1], None),
            ("two terms", lambda be: ops.FastScan(two, n, add, be), q, None),
            ("first of two", lambda be: ops.FastScan(two, n, add, be, first=1), q, 60),
            ("signs then full", lambda be: ops.FastScan([ops.ScanTerm(bl1, c1, m2, 1)], n, add,
                                                        be, full=full), q[:1], 60)]


@needs_cpu
def test_fast_scan_compiled_runner_gives_the_references_results(rng):
    for name, make, qs, k1 in _scans(rng):
        cpu, ref = make("auto"), make("ref")
        assert cpu.compiled and not ref.compiled, name
        vc, pc = cpu.search(qs, 10, k1=k1)
        vr, pr = ref.search(qs, 10, k1=k1)
        torch.testing.assert_close(vc, vr, rtol=1e-4, atol=1e-4, msg=name)
        assert (pc == pr).float().mean() > 0.95, name
        # numpy query terms reach the compiled runner with the same bits
        vn, pn = cpu.search([t.numpy() for t in qs], 10, k1=k1)
        assert torch.equal(vn, vc) and torch.equal(pn, pc), name
        with pytest.raises(TypeError, match="numpy"):
            ref.search([t.numpy() for t in qs], 10, k1=k1)


@needs_cpu
def test_a_kernel_that_cannot_take_a_struct_leaves_it_to_the_reference(rng, monkeypatch):
    name, make, qs, k1 = _scans(rng)[0]
    expected = make("ref").search(qs, 10)
    row = dispatch.OPS["fast_scan_prepared"]
    monkeypatch.setitem(dispatch.OPS, "fast_scan_prepared",
                        dispatch.Op(row.ref, lambda struct: None))
    scan = make("auto")
    assert not scan.compiled
    got = scan.search(qs, 10)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@needs_cpu
def test_rotation_probe_and_ivf_scan_runners_agree_with_the_reference(rng):
    d, nlist, n = 48, 6, 320
    perms = torch.from_numpy(np.stack([rng.permutation(d) for _ in range(3)]).astype(np.int64))
    signs = torch.from_numpy((rng.integers(0, 2, (3, d)) * 2 - 1).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((7, d)).astype(np.float32))
    rc, rr = ops.HadamardRotate(perms, signs, 32), ops.HadamardRotate(perms, signs, 32, "ref")
    assert rc.compiled and not rr.compiled
    for inverse in (False, True):
        torch.testing.assert_close(rc(x, inverse), rr(x, inverse), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rc(x.double()), rr(x), rtol=1e-5, atol=1e-5)  # any float dtype
    with pytest.raises(ValueError, match="device"):
        rc(x.to("meta"))
    cents = torch.from_numpy(rng.standard_normal((nlist, d)).astype(np.float32))
    csq = (cents * cents).sum(1)
    q = rng.standard_normal((4, d)).astype(np.float32)
    for l2 in (True, False):
        pc, pr = ops.IVFProbe(cents, csq, l2), ops.IVFProbe(cents, csq, l2, "ref")
        assert pc.compiled and not pr.compiled
        (a, sa), (b, sb) = pc.probe(q, 3), pr.probe(q, 3)
        assert np.array_equal(a, b)
        np.testing.assert_allclose(sa, sb, rtol=1e-5, atol=1e-4)
        with pytest.raises(ValueError, match="nprobe"):
            pc.probe(q, nlist + 1)
    # inverted lists: 10 blocks of 32 rows, list l holds blocks [lb[l], lb[l + 1])
    packed, blocked, c, mult = _codes(rng, n, d, 2)
    add = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    lb = torch.tensor([0, 2, 3, 5, 8, 9, 10])
    probes = np.array([[0, 3, 5], [1, 2, 4], [5, 4, 3], [0, 1, 2]], np.int64)
    offsets = rng.standard_normal((4, 3)).astype(np.float32)
    qr = rng.standard_normal((4, d)).astype(np.float32)
    sc, sr = (ops.IVFFastScan(blocked, c, mult, add, lb, 2, be) for be in ("auto", "ref"))
    assert sc.compiled and not sr.compiled
    (vc, ic), (vr, ir) = sc.search(qr, probes, offsets, 10), sr.search(qr, probes, offsets, 10)
    np.testing.assert_allclose(vc, vr, rtol=1e-4, atol=1e-4)
    assert (ic == ir).mean() > 0.95


def test_fused_rows_give_no_fused_form_on_the_reference(rng):
    _, make, _, _ = _scans(rng)[0]
    scan = make("ref")
    d = 40
    rot = ops.HadamardRotate(torch.arange(d)[None], torch.ones(1, d), 32, "ref")
    args = ops.FlatSearchArgs(scan, np.arange(scan.n), "l2", rotate=rot)
    assert ops.prepare("flat_search_fused", args, torch.device("cpu"), "ref") is None
    # on the compiled kernels too where a part is the reference's
    if "cpu" in ops.available_backends():
        assert ops.prepare("flat_search_fused", args, torch.device("cpu"), "auto") is None
