"""IVFIndex: residual codes in k-means lists, checked against brute force over c + r_hat."""

import numpy as np
import pytest
import torch

import tqvec
from tests.conftest import assert_numpy_path_matches
from tqvec import FormatError
from tqvec.index import IVFIndex

faiss = pytest.importorskip("faiss")


def _clustered(rng, n=3000, d=32, nq=20, centers=12):
    c = 4 * rng.standard_normal((centers, d))
    xb = c[rng.integers(0, centers, n)] + rng.standard_normal((n, d))
    xq = c[rng.integers(0, centers, nq)] + rng.standard_normal((nq, d))
    return xb.astype(np.float32), xq.astype(np.float32)


def _trained(spec, metric, xb, nprobe, **kw):
    index = tqvec.index_factory(xb.shape[1], spec, metric, **kw)
    assert isinstance(index, IVFIndex) and not index.is_trained
    index.train(xb)
    index.nprobe = nprobe
    index.add(xb)
    return index


def _oracle(index, xq, k, xb):
    """Brute force over the reconstructions c + r_hat, within the probed lists: for the biased
    mse codes the index's estimator is exactly the metric on x_hat (module docstring), for the
    inner product <q, x_hat> + a <c, r> - <c, r_hat> with a = <r, r_hat> / ||r||^2 (only
    <q - c, r> comes from the codes)."""
    rec = index.reconstruct_n(0, index.ntotal).astype(np.float64)
    q = xq.astype(np.float64)
    if index.metric_type == tqvec.index.METRIC_COSINE:
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
    cent = index.centroids.numpy().astype(np.float64)
    lists = index.assignments
    if index.metric_type == tqvec.index.METRIC_INNER_PRODUCT:
        c = cent[lists]
        r, r_hat = xb.astype(np.float64) - c, rec - c
        a = (r * r_hat).sum(1) / (r * r).sum(1)
        corr = a * (c * r).sum(1) - (c * r_hat).sum(1)
        s, probe = q @ rec.T + corr[None, :], q @ cent.T
    else:
        s = -((q[:, None, :] - rec[None]) ** 2).sum(-1)
        probe = -((q[:, None, :] - cent[None]) ** 2).sum(-1)
    near = np.argsort(-probe, axis=1)[:, :index.nprobe]
    s = np.where(np.isin(lists[None, :], near) if len(q) == 1 else
                 np.stack([np.isin(lists, near[i]) for i in range(len(q))]), s, -np.inf)
    top = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, top, 1), top


@pytest.mark.parametrize("spec", ["IVF16,TQ2", "IVF16,TQ4", "IVF16,TQ3", "IVF16,Polar"])
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_search_equals_brute_force_over_the_reconstruction(spec, metric, rng):
    xb, xq = _clustered(rng)
    index = _trained(spec, metric, xb, nprobe=4)
    D, I = index.search(xq, 10)
    assert D.dtype == np.float32 and I.dtype == np.int64 and D.shape == (20, 10)
    s, top = _oracle(index, xq, 10, xb)
    want = -s if metric == "l2" else (1 + s / 2 if metric == "cosine" else s)
    for i in range(len(xq)):  # tie-aware: where ids differ the distances agree
        if not np.array_equal(I[i], top[i]):
            np.testing.assert_allclose(D[i], want[i], rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(D, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("spec", ["IVF16,TQ2", "IVF16,Polar"])
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_search_after_remove_ids_equals_the_oracle_and_a_fresh_index(spec, metric, rng):
    """After removals the per-row terms must follow the rows: the oracle (computed from the
    kept vectors) and an index built afresh from them (same centroids) agree with the index."""
    xb, xq = _clustered(rng)
    index = _trained(spec, metric, xb, nprobe=4)
    gone = np.arange(0, len(xb), 3)
    assert index.remove_ids(gone) == len(gone)
    keep = np.setdiff1d(np.arange(len(xb)), gone)
    D, I = index.search(xq, 10)
    s, top = _oracle(index, xq, 10, xb[keep])
    np.testing.assert_allclose(D, -s if metric == "l2" else s, rtol=1e-4, atol=1e-3)
    fresh = tqvec.index_factory(xb.shape[1], spec, metric)
    fresh.train(xb)  # faiss k-means with the same seed: the same centroids
    np.testing.assert_array_equal(fresh.centroids.numpy(), index.centroids.numpy())
    fresh.nprobe = 4
    fresh.add_with_ids(xb[keep], keep)
    D2, I2 = fresh.search(xq, 10)
    np.testing.assert_array_equal(I, I2)
    if spec.endswith("TQ2"):  # the fast scan's integer sums: bit for bit
        np.testing.assert_array_equal(D, D2)
    else:  # torch's GEMMs: rounding may follow a row's place in memory (seen on AVX-512 hosts)
        np.testing.assert_allclose(D, D2, rtol=1e-6, atol=0)


@pytest.mark.parametrize("b", [1, 2, 3, 4])
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_fast_scan_and_per_list_paths_agree(b, metric, rng, monkeypatch):
    """TQ1-4 on CPU take ops.ivf_fast_scan; every other codec the codec's scorer per list."""
    xb, xq = _clustered(rng, n=2000, d=48, nq=30)
    fast = _trained(f"IVF16,TQ{b}", metric, xb, nprobe=5)
    slow = _trained(f"IVF16,TQ{b}", metric, xb, nprobe=5)
    monkeypatch.setattr(slow, "_fast_ok", lambda: False)
    slow._scan = None
    allowed = np.arange(0, 2000, 3)
    for kw in ({}, {"allowed_ids": allowed}):
        D1, I1 = fast.search(xq, 20, **kw)
        D2, I2 = slow.search(xq, 20, **kw)
        assert fast._scan.scanner is not None and slow._scan.scanner is None
        # the same ranking up to the order of ties (1-bit scores tie often; the two paths sum
        # the inner product's row correction in another order)
        mis = I1 != I2
        assert mis.mean() < 0.01
        np.testing.assert_allclose(D1[mis], D2[mis], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(D1, D2, rtol=1e-5, atol=1e-3)
    assert set(I1[I1 >= 0].tolist()) <= set(allowed.tolist())


@pytest.mark.parametrize("spec", ["IVF16,TQ1", "IVF16,TQ3", "IVF16,TQ2,Refine(Flat)",
                                  "IVF16,TQ1,Refine(TQ8)", "IVF16,TQ1,Refine(TQ8g)"])
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_numpy_fast_path_equals_general_path(spec, metric, rng):
    """float32 numpy queries take IVFIndex._search_fast_numpy, torch queries the general path:
    bit-identical results (one probe function, one re-rank); filters and bad input take the
    general path."""
    xb, xq = _clustered(rng, n=2000, d=48, nq=9)
    index = _trained(spec, metric, xb, nprobe=3)
    index.remove_ids(np.arange(0, 2000, 7))
    # one compiled call (ops.IVFSearch), with no refinement, exact vectors or TurboQuant codes
    if "cpu" in tqvec.available_backends():
        assert index.snapshot().scan.fused is not None
    for q in (xq[:1], xq[:8], xq):
        _, I1 = assert_numpy_path_matches(index, [q])
        assert (I1 >= 0).all() and not np.isin(I1, np.arange(0, 2000, 7)).any()
    for q in (xq[:2], xq):
        D1, I1 = index.search(q, 3000)  # more than the probed lists hold: padded
        assert (I1 == -1).any() and (D1[I1 == -1] == (3.4028235e38 if metric == "l2"
                                                      else -3.4028235e38)).all()
        D2, I2 = index.search(torch.from_numpy(q), 3000)
        np.testing.assert_array_equal(I1, I2)
        np.testing.assert_array_equal(D1, D2)
    with index._lock:
        assert index._fused_search(xq.astype(np.float64), index._snapshot(), 10) is None
    bad = xq.copy()
    bad[2, 5] = np.inf
    with pytest.raises(ValueError, match="must be finite"):
        index.search(bad, 10)
    bad[2, 5] = np.nan  # the compiled one-call search checks its queries itself
    with pytest.raises(ValueError, match="must be finite"):
        index.search(bad[2:3], 10)


def test_residual_codes_beat_flat_codes_at_equal_bits(rng):
    """The point of IVF-ADC for a data-oblivious codec: residuals have smaller norms."""
    xb, xq = _clustered(rng, n=4000, d=32, nq=50)
    exact = faiss.IndexFlatL2(32)
    exact.add(xb)
    _, gt = exact.search(xq, 10)

    def recall(index):
        _, I = index.search(xq, 10)
        return np.mean([len(set(I[i]) & set(gt[i])) / 10 for i in range(len(xq))])

    flat = tqvec.index_factory(32, "TQ2", "l2")
    flat.add(xb)
    ivf = _trained("IVF12,TQ2", "l2", xb, nprobe=12)
    assert ivf.code_size == flat.code_size
    assert recall(ivf) > recall(flat) + 0.1
    one = _trained("IVF12,TQ2", "l2", xb, nprobe=1)
    assert recall(one) <= recall(ivf)
    assert recall(_trained("IVF12,TQ2,Refine(Flat)", "l2", xb, nprobe=12)) > recall(ivf) + 0.1


def test_nprobe_restricts_results_to_the_nearest_lists(rng):
    xb, xq = _clustered(rng, n=1500)
    index = _trained("IVF8,TQ4", "l2", xb, nprobe=1)
    _, I = index.search(xq, 5000)
    cent = index.centroids.numpy()
    lists = index.assignments
    for i in range(len(xq)):
        nearest = np.argmin(((xq[i] - cent) ** 2).sum(1))
        got = I[i][I[i] >= 0]
        assert len(got) == (lists == nearest).sum()  # the whole list, nothing else, -1 after
        assert (lists[got] == nearest).all()


def test_ids_removal_reconstruct_range_search(rng):
    xb, xq = _clustered(rng, n=800, d=16, nq=4)
    index = tqvec.index_factory(16, "IVF8,TQ8", "l2")
    index.train(xb)
    index.nprobe = 8
    ids = np.arange(5000, 5800, dtype=np.int64)
    index.add_with_ids(xb, ids)
    np.testing.assert_allclose(index.reconstruct(5003), xb[3], atol=0.05)
    D, I = index.search(xb[:5], 1)
    np.testing.assert_array_equal(I[:, 0], ids[:5])
    assert index.remove_ids(np.array([5000, 5001, 7])) == 2 and index.ntotal == 798
    _, I = index.search(xb[:2], 3)
    assert 5000 not in I and 5001 not in I
    np.testing.assert_allclose(index.reconstruct(5003), xb[3], atol=0.05)
    with pytest.raises(KeyError):
        index.reconstruct(5000)
    lims, Dr, Ir = index.range_search(xq, 30.0)
    Dk, Ik = index.search(xq, 800)
    for i in range(len(xq)):
        assert set(Ir[lims[i]:lims[i + 1]].tolist()) == set(Ik[i][Dk[i] < 30.0].tolist())
    assert 1.0 <= index.imbalance_factor < 8
    index.reset()
    assert index.ntotal == 0 and index.is_trained  # centroids survive reset, as in faiss


@pytest.mark.parametrize("spec", ["IVF8,TQ4", "IVF8,TQ3,Refine(TQ8)", "IVF8,QJL64,Refine(Flat)"])
@pytest.mark.parametrize("metric", ["l2", "cosine", "ip"])
def test_write_read_round_trip(tmp_path, spec, metric, rng):
    xb, xq = _clustered(rng, n=600)
    index = _trained(spec, metric, xb, nprobe=3)
    index.remove_ids(np.arange(0, 600, 7))
    tqvec.write_index(index, tmp_path / "i.tqv")
    back = tqvec.read_index(tmp_path / "i.tqv", mmap=True)
    assert isinstance(back, IVFIndex) and back.nprobe == 3 and back.ntotal == index.ntotal
    D1, I1 = index.search(xq, 7)
    D2, I2 = back.search(xq, 7)
    np.testing.assert_array_equal(I1, I2)
    # the per-row terms are recomputed on read (l2, cosine: in a different float order) or
    # stored (ip: a <c, r> - est<c, r> needs the vectors; 4 bytes per row)
    np.testing.assert_allclose(D1, D2, rtol=1e-6, atol=1e-5)
    if metric == "ip":
        np.testing.assert_array_equal(back._rows.term("rowterm").numpy(),
                                      index._rows.term("rowterm").numpy())
        assert index.code_size == tqvec.index_factory(32, spec, "l2").code_size + 4
    untrained = tqvec.index_factory(32, spec, metric)
    tqvec.write_index(untrained, tmp_path / "u.tqv")
    assert not tqvec.read_index(tmp_path / "u.tqv").is_trained


def test_hostile_ivf_file(tmp_path, rng, monkeypatch):
    """A file whose list numbers point outside the lists fails cleanly (checksums pass)."""
    xb, _ = _clustered(rng, n=200)
    index = _trained("IVF4,TQ2", "l2", xb, nprobe=2)
    lists = index._rows.per_row["lists"].clone()
    lists[3] = 9
    index._rows.per_row["lists"] = lists
    tqvec.write_index(index, tmp_path / "i.tqv")
    with pytest.raises(FormatError, match="lists must be"):
        tqvec.read_index(tmp_path / "i.tqv")


def test_training_and_configuration_errors(rng):
    xb, _ = _clustered(rng, n=100)
    index = tqvec.index_factory(32, "IVF16,TQ4")
    with pytest.raises(ValueError, match="must be trained before add"):
        index.add(xb)
    with pytest.raises(ValueError, match="at least nlist=16 rows"):
        index.train(xb[:10])
    with pytest.raises(ValueError, match="x must"):
        index.train(xb[:, :5])
    index.train(xb)
    index.add(xb)
    with pytest.raises(ValueError, match="must be empty to be trained again"):
        index.train(xb)
    with pytest.raises(ValueError, match="nprobe must be in 1..16777216, got 0"):
        index.nprobe = 0
    with pytest.raises(ValueError, match="spec must look like 'IVF1024,TQ4'"):
        tqvec.index_factory(32, "IVFx,TQ4")
    bad = xb.copy()
    bad[3, 2] = np.nan
    with pytest.raises(ValueError, match="finite"):
        index.add(bad)


def test_torch_and_half_inputs(rng):
    xb, xq = _clustered(rng, n=500)
    index = _trained("IVF8,TQ4", "ip", torch.from_numpy(xb).to(torch.bfloat16), nprobe=8)
    D, I = index.search(torch.from_numpy(xq[:1]), 3)
    assert I.shape == (1, 3) and (I >= 0).all()
