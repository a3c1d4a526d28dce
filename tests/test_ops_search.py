"""The IVF and re-scoring ops (ivf_fast_scan, ivf_probe, rescore_topk, row_sqnorms, row_dots)
against tests/oracle.py and their torch references, as tests/test_ops.py does for the rest."""

import numpy as np
import pytest
import torch

from tests import oracle
from tests.conftest import on, scan_case
from tqvec import ops


@pytest.mark.parametrize("b", [1, 2, 3, 4])
@pytest.mark.parametrize("nq,d,nlist,nprobe,k", [(1, 64, 8, 3, 10), (7, 100, 5, 5, 7),
                                                 (37, 784, 16, 4, 20), (300, 33, 40, 6, 5)])
def test_ivf_fast_scan_matches_reference(backend, b, nq, d, nlist, nprobe, k):
    """Lists of random sizes (some empty) padded to 32-row blocks with add = -inf, filtered
    rows, a missing probe (-1), random offsets: same top-k as the reference."""
    if backend == "cuda":
        pytest.skip("ivf_fast_scan is a CPU kernel (the GPU IVF scan is not built)")
    rng = np.random.default_rng(nq * 1000 + d + b)
    sizes = torch.from_numpy(rng.integers(0, 90, nlist))
    list_blocks = torch.cat([torch.zeros(1, dtype=torch.int64), ((sizes + 31) // 32).cumsum(0)])
    nb = int(list_blocks[-1])
    qr, packed, c, mult, add = scan_case(rng, nq, 32 * nb, d, b, excluded_every=13)
    for li in range(nlist):
        add[int(list_blocks[li]) * 32 + int(sizes[li]):int(list_blocks[li + 1]) * 32] = \
            -float("inf")
    probes = torch.from_numpy(np.stack([rng.permutation(nlist)[:nprobe] for _ in range(nq)]))
    probes[0, -1] = -1
    offsets = torch.from_numpy(3 * rng.standard_normal((nq, nprobe)).astype(np.float32))
    blocked = ops.block_codes(packed, d, b, backend="ref")
    args = (blocked, c, mult, add, list_blocks, probes, offsets)
    v0, p0 = ops.ref.ivf_fast_scan_ref(qr, *args, b, k)
    v1, p1 = ops.ivf_fast_scan(*on(backend, qr, *args), b, k, backend=backend)
    if backend == "cpu" and nq < 100:  # a refinement's first stage: table scores, no re-score
        va, pa = ops.ivf_fast_scan(qr, *args, b, k, backend="cpu", approx=True)
        full, fp = ops.ref.ivf_fast_scan_ref(qr, *args, b, 32 * nb)  # every probed row
        exact = {(i, int(r)): float(v) for i in range(nq)
                 for v, r in zip(full[i], fp[i], strict=True) if r >= 0}
        spread = float(v0[torch.isfinite(v0)].abs().max())
        for i in range(nq):
            got = [(float(v), int(r)) for v, r in zip(va[i], pa[i], strict=True) if r >= 0]
            assert len(got) == int((p0[i] >= 0).sum())  # as many results, padded alike
            assert all(np.isclose(v, exact[(i, r)], atol=0.05 * spread) for v, r in got)
            if got:  # and no pick far below the exact k-th best
                kth = float(v0[i][p0[i] >= 0][-1])
                assert all(exact[(i, r)] >= kth - 0.1 * spread for _, r in got)
    # the oracle: a probed row's exact score plus its list's offset, -inf elsewhere
    s, bound = oracle.lut_scores(qr, packed, c, mult, add, b)
    row_list = np.repeat(np.arange(nlist), np.diff(list_blocks.numpy()) * 32)
    probed = np.full(s.shape, -np.inf)
    for r in range(nprobe):
        hit = (row_list[None, :] == probes[:, r:r + 1].numpy()) & (probes[:, r:r + 1].numpy() >= 0)
        probed = np.where(hit, offsets[:, r:r + 1].numpy().astype(np.float64), probed)
    s = s + probed
    oracle.check_topk(v1, p1, s, bound + 2 * oracle.U * np.abs(np.where(np.isfinite(s), s, 0)), k)
    if backend != "ref":
        torch.testing.assert_close(v1.cpu(), v0, rtol=1e-5, atol=1e-4)
        assert torch.equal(p1.cpu(), p0)
    assert (p0 >= 0).any()


@pytest.mark.parametrize("nq,nlist,d,nprobe", [(1, 256, 784, 4), (5, 10, 7, 10), (9, 33, 64, 1)])
@pytest.mark.parametrize("l2", [False, True])
def test_ivf_probe_matches_reference(backend, nq, nlist, d, nprobe, l2, rng):
    """The nearest lists best first, ties to the lower list (duplicated centroids), scores
    within float-summation tolerance."""
    q = torch.from_numpy(rng.standard_normal((nq, d)).astype(np.float32))
    c = torch.from_numpy(rng.standard_normal((nlist, d)).astype(np.float32))
    c[3] = c[1]  # a tie
    q[0] = c[1]
    csq = (c * c).sum(1)
    p0, s0 = ops.ref.ivf_probe_ref(q, c, csq, l2, nprobe)
    p1, s1 = ops.ivf_probe(*on(backend, q, c, csq), l2, nprobe, backend=backend)
    # the oracle: <q, c> or -||q - c||^2 in float64; float32 forms it from d-term sums (and,
    # for l2, ||c||^2 and ||q||^2 of the same size): within 2 gamma(d) (|q||c| + ||q||^2 +
    # ||c||^2) each
    qn, cn = oracle.np64(q), oracle.np64(c)
    s = qn @ cn.T
    bound = oracle.gamma(d) * (np.abs(qn) @ np.abs(cn).T)
    if l2:
        s = -((qn[:, None, :] - cn[None]) ** 2).sum(-1)
        bound = 2 * (2 * bound + oracle.gamma(d) * ((qn * qn).sum(1)[:, None]
                                                    + (cn * cn).sum(1)[None, :]))
    oracle.check_topk(s1, p1, s, 2 * bound + 1e-6, nprobe)
    if backend != "ref":
        torch.testing.assert_close(s1.cpu(), s0, rtol=1e-5, atol=1e-3)
        assert torch.equal(p1.cpu(), p0) or torch.allclose(  # or equal scores where they differ
            torch.gather(s0, 1, p1.cpu()), s0, rtol=1e-5, atol=1e-3)
    if nprobe > 1 and l2:
        assert p1[0, 0] == 1 and p1[0, 1] == 3  # the two copies of q[0]: lower list first
    with pytest.raises(ValueError, match="nprobe"):
        ops.ivf_probe(q, c, csq, l2, nlist + 1, backend=backend)


@pytest.mark.parametrize("d", [5, 40, 784])
def test_ivf_probe_batch_equals_one_query_at_a_time(d, rng):
    """Many queries are probed in register tiles (4 queries x 3 lists), a query alone 8 lists
    at a time, leftovers pair by pair: the same float operations per pair, so the same bits —
    the IVF index's one-query and batch paths rely on it (10 queries: two tiles and two left
    over; 11 lists: three tiles and two, or one 8-list tile and three)."""
    if "cpu" not in ops.available_backends():
        pytest.skip("tqvec._C not built")
    q = rng.standard_normal((10, d)).astype(np.float32)
    c = rng.standard_normal((11, d)).astype(np.float32)
    csq = (c * c).sum(1)
    for l2 in (False, True):
        probe = ops.IVFProbe(torch.from_numpy(c), torch.from_numpy(csq), l2)
        pb, sb = probe.probe(q, 11)
        for i in range(10):
            p1, s1 = probe.probe(q[i:i + 1], 11)
            np.testing.assert_array_equal(p1[0], pb[i])
            np.testing.assert_array_equal(s1[0], sb[i])


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
@pytest.mark.parametrize("nq,n,d,kk,k", [(1, 10, 7, 3, 5), (50, 3000, 784, 40, 10),
                                         (3, 100, 1, 200, 200)])
def test_rescore_topk_matches_reference(backend, metric, nq, n, d, kk, k, rng):
    """Refine(Flat)'s exact re-rank: the metric's similarity of each candidate row, best k first
    (ties to the earlier candidate), -inf / -1 padding past the valid ones (k > kk included);
    sums in a different order than the reference's einsum."""
    if backend == "cuda":
        pytest.skip("rescore_topk is a CPU kernel (exact vectors live in host memory)")
    q = torch.from_numpy(rng.standard_normal((nq, d)).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
    x[0] = 0  # a zero row: cosine 0, not NaN
    rows = torch.from_numpy(rng.integers(-1, n, (nq, kk)))
    want_v, want_i = ops.ref.rescore_topk_ref(q, x, rows, metric, k)
    got_v, got_i = ops.rescore_topk(q, x, rows, metric, k, backend=backend)
    assert got_v.shape == got_i.shape == (nq, k)
    # the oracle: each candidate's similarity in float64 (a candidate listed twice counts
    # twice), the best k values; float32 forms them from d-term sums: within
    # gamma(d) (|q||x| + ||q||^2 + ||x||^2) plus a division's rounding, x4 slack
    qn, xn = oracle.np64(q), oracle.np64(x)
    r = rows.numpy()
    cand = xn[np.maximum(r, 0)]
    dot = np.einsum("qd,qkd->qk", qn, cand)
    sqn = (cand * cand).sum(-1)
    s = {"l2": -((qn[:, None, :] - cand) ** 2).sum(-1), "ip": dot,
         "cosine": dot / np.maximum(np.sqrt(sqn), 1e-30)}[metric]
    s = np.where(r >= 0, s, -np.inf)
    bound = 4 * (oracle.gamma(d) * (np.abs(np.einsum("qd,qkd->qk", np.abs(qn), np.abs(cand)))
                                    + (qn * qn).sum(1)[:, None] + sqn)
                 / (np.maximum(np.sqrt(sqn), 1e-30) if metric == "cosine" else 1) + 2e-7)
    want = np.sort(s, axis=1)[:, ::-1][:, :k]
    want = np.concatenate([want, np.full((nq, max(0, k - want.shape[1])), -np.inf)], 1)
    got = got_v.numpy().astype(np.float64)
    assert (np.isfinite(got) == np.isfinite(want)).all()
    assert (got_i.numpy() < 0).tolist() == (~np.isfinite(got)).tolist()
    fin = np.isfinite(want)
    assert (np.abs(got[fin] - want[fin]) <= 2 * bound.max()).all()
    for i in range(nq):  # each returned value is its row's similarity
        for j in range(k):
            if got_i[i, j] >= 0:
                cand_j = np.nonzero(r[i] == int(got_i[i, j]))[0]
                assert np.abs(s[i, cand_j] - got[i, j]).min() <= bound[i, cand_j].max()
    if backend != "ref":
        tol = 1e-4 * d ** 0.5 * (4 if metric == "l2" else 1)
        torch.testing.assert_close(got_v, want_v, rtol=1e-5, atol=tol)
        assert torch.equal(got_i < 0, want_i < 0)
        for i in range(nq):  # the same rows, or rows of (nearly) equal similarity
            for j in range(k):
                if got_i[i, j] != want_i[i, j]:
                    assert abs(float(got_v[i, j]) - float(want_v[i, j])) <= tol
    vals_np, idx_np = ops.rescore_topk_np(q.numpy(), x.numpy(), rows.numpy(), metric, k)
    if backend == "cpu":  # the numpy entry runs the compiled kernel
        assert np.array_equal(idx_np, got_i.numpy()) and np.array_equal(vals_np, got_v.numpy())
    with pytest.raises(ValueError, match="metric"):
        ops.rescore_topk(q, x, rows, "hamming", k, backend=backend)
    with pytest.raises(ValueError, match="rows"):
        ops.rescore_topk(q, x, rows[:, 0], metric, k, backend=backend)


def test_rescore_topk_ties_keep_candidate_order(backend):
    """Equal similarities (duplicate rows, a candidate listed twice) keep the first stage's
    order, as the stable sort of the reference does."""
    if backend == "cuda":
        pytest.skip("rescore_topk is a CPU kernel")
    x, q = torch.ones(4, 3), torch.ones(1, 3)
    v, i = ops.rescore_topk(q, x, torch.tensor([[2, 0, -1, 3, 2, 1]]), "l2", 6, backend=backend)
    assert i.tolist() == [[2, 0, 3, 2, 1, -1]] and (v[0, :5] == 0).all() and v[0, 5] == -np.inf


def test_row_sqnorms_matches_reference(backend, rng):
    """||x_i||^2 per row (an L2 search's ||q||^2, one function for every search path): within
    float-summation tolerance of the torch sum; a wrong rank is refused."""
    for n, d in [(1, 784), (5, 7), (3, 0), (0, 16)]:
        x = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
        got = ops.row_sqnorms(on(backend, x), backend=backend).cpu()
        assert got.shape == (n,) and got.dtype == torch.float32
        xn = oracle.np64(x)  # a d-term float32 sum: within gamma(d) sum x^2 (+ the squares')
        want = (xn * xn).sum(1)
        assert (np.abs(oracle.np64(got) - want) <= (oracle.gamma(d) + oracle.U) * want).all()
    with pytest.raises(ValueError, match=r"x must be \(n, d\)"):
        ops.row_sqnorms(torch.zeros(3), backend=backend)


def test_row_dots_matches_reference(backend, rng):
    """<x_i, v> per row (a centred inner-product index's <q, mu>, one function for every search
    path): within float-summation tolerance of the torch sum; wrong shapes are refused."""
    for n, d in [(1, 784), (5, 7), (3, 0), (0, 16), (9, 384)]:
        x = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
        v = torch.from_numpy(rng.standard_normal(d).astype(np.float32))
        got = ops.row_dots(on(backend, x), on(backend, v), backend=backend).cpu()
        assert got.shape == (n,) and got.dtype == torch.float32
        xn, vn = oracle.np64(x), oracle.np64(v)  # within gamma(d) sum |x v| (+ the products')
        want = xn @ vn
        bound = (oracle.gamma(d) + oracle.U) * (np.abs(xn) @ np.abs(vn))
        assert (np.abs(oracle.np64(got) - want) <= bound).all()
    with pytest.raises(ValueError, match=r"x must be \(n, d\) and v \(d,\)"):
        ops.row_dots(torch.zeros(3, 4), torch.zeros(3), backend=backend)


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("distinct", [3, None])
def test_ivf_fast_scan_approx_is_the_table_top_k(b, distinct):
    """A refinement's first stage (table scores, no re-score): its top k is exactly the first k
    of all probed rows ranked by the same scores, ties to the lower row — with hundreds of tied
    rows (3 distinct codes) and with 200 queries split between threads."""
    if "cpu" not in ops.available_backends():
        pytest.skip("tqvec._C not built")
    rng = np.random.default_rng(b)
    nq, d, nlist, nprobe, k = 200, 64, 12, 4, 10
    sizes = torch.from_numpy(rng.integers(0, 300, nlist))
    list_blocks = torch.cat([torch.zeros(1, dtype=torch.int64), ((sizes + 31) // 32).cumsum(0)])
    nb = int(list_blocks[-1])
    qr, packed, c, mult, add = scan_case(rng, nq, 32 * nb, d, b, excluded_every=13)
    if distinct is not None:
        packed = packed[torch.from_numpy(rng.integers(0, distinct, 32 * nb))]
        mult = torch.ones_like(mult)
        add = torch.zeros_like(add)
    for li in range(nlist):
        add[int(list_blocks[li]) * 32 + int(sizes[li]):int(list_blocks[li + 1]) * 32] = \
            -float("inf")
    probes = torch.from_numpy(np.stack([rng.permutation(nlist)[:nprobe] for _ in range(nq)]))
    offsets = torch.zeros((nq, nprobe)) if distinct else torch.from_numpy(
        rng.standard_normal((nq, nprobe)).astype(np.float32))
    args = (ops.block_codes(packed, d, b, backend="ref"), c, mult, add, list_blocks, probes,
            offsets)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        va, pa = ops.ivf_fast_scan(qr, *args, b, k, backend="cpu", approx=True)
        vall, pall = ops.ivf_fast_scan(qr, *args, b, 32 * nb, backend="cpu", approx=True)
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_array_equal(va.numpy(), vall[:, :k].numpy())
    np.testing.assert_array_equal(pa.numpy(), pall[:, :k].numpy())
    ok = pall >= 0  # every probed row is listed once, best first, ties to the lower row
    for i in range(0, nq, 37):
        v, p = vall[i][ok[i]].numpy(), pall[i][ok[i]].numpy()
        assert len(set(p.tolist())) == len(p)
        assert all((v[j] > v[j + 1]) or (v[j] == v[j + 1] and p[j] < p[j + 1])
                   for j in range(len(v) - 1))
