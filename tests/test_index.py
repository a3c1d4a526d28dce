"""FlatIndex: faiss semantics, checked against faiss's exact index over the decoded vectors."""

import threading

import numpy as np
import pytest
import torch

import tqvec
from tests.conftest import assert_numpy_path_matches
from tqvec import FormatError
from tqvec.index import METRIC_INNER_PRODUCT, METRIC_L2

faiss = pytest.importorskip("faiss")
FLT_MAX = np.finfo(np.float32).max


def _data(rng, n=2000, d=32, nq=25):
    return rng.standard_normal((n, d)).astype(np.float32), \
        rng.standard_normal((nq, d)).astype(np.float32)


def _same_neighbours(I1, I2, D1, D2, tol):
    """Tie-aware: where the id lists differ, the distances must agree within tol."""
    for i in range(len(I1)):
        if not np.array_equal(I1[i], I2[i]):
            np.testing.assert_allclose(D1[i], D2[i], rtol=tol, atol=tol)


@pytest.mark.parametrize("spec", ["TQ2", "TQ4", "TQ3u", "TQ2f", "TQ3g", "TQprod3", "Polar",
                                  "QJL64"])
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_search_equals_brute_force_over_the_estimator(spec, metric, rng):
    """Oracle: brute force over the decoded vectors x_hat, with N(x) = ||x_hat||^2 for the
    biased (mse) estimators and the true ||x||^2 for unbiased ones; the biased TurboQuant codes
    rank inner products by <q, x_hat> rescaled to ||x|| (module docstring)."""
    xb, xq = _data(rng)
    index = tqvec.index_factory(32, spec, metric)
    index.add(xb)
    D, I = index.search(xq, 10)
    assert D.dtype == np.float32 and I.dtype == np.int64 and D.shape == I.shape == (25, 10)
    rec = index.reconstruct_n(0, index.ntotal).astype(np.float64)
    n_x = (xb.astype(np.float64) ** 2).sum(1) if index.codec.unbiased_ip else (rec**2).sum(1)
    ip = xq.astype(np.float64) @ rec.T
    if metric == "ip":
        rescaled = spec in ("TQ2", "TQ4", "TQ3g")  # biased codes that store ||x||
        sim = ip * (np.linalg.norm(xb, axis=1) / np.linalg.norm(rec, axis=1))[None, :] \
            if rescaled else ip
    elif metric == "l2":
        sim = -((xq.astype(np.float64) ** 2).sum(1)[:, None] - 2 * ip + n_x[None, :])
    else:
        sim = ip / np.linalg.norm(xq, axis=1)[:, None] / np.sqrt(n_x)[None, :]
    Ir = np.argsort(-sim, axis=1, kind="stable")[:, :10]
    Dr = np.take_along_axis(sim, Ir, 1) * (-1 if metric == "l2" else 1)
    np.testing.assert_allclose(D, Dr, rtol=2e-3, atol=2e-3)
    _same_neighbours(I, Ir, D, Dr, 2e-3)
    assert (I == Ir).mean() > 0.97


@pytest.mark.parametrize("spec", ["TQprod1", "QJL128", "TQ1", "TQ2", "TQ2u", "TQ2f"])
def test_l2_ranking_is_sound_for_every_estimator(spec, rng):
    """Regression: pairing an unbiased inner product with ||x_hat||^2 (noise included) or a
    biased one with the true ||x||^2 made L2 recall collapse (0.05 on Fashion). Data with a
    large common offset, like pixels, exposes both: the wrong pairing gives 0.72 / 0.65 for
    TQprod1 / QJL128 and 0.58 / 0.26 for TQ1 / TQ2 here."""
    n, d = 4000, 128
    mean = np.abs(rng.standard_normal(d)).astype(np.float32) * 4
    centers = mean + rng.standard_normal((40, d)).astype(np.float32)
    xb = centers[rng.integers(0, 40, n)] + 0.5 * rng.standard_normal((n, d)).astype(np.float32)
    xq = xb[:100] + 0.1 * rng.standard_normal((100, d)).astype(np.float32)
    exact = faiss.IndexFlatL2(d)
    exact.add(xb)
    _, It = exact.search(xq, 1)
    index = tqvec.index_factory(d, spec, "l2")
    index.add(xb)
    _, I = index.search(xq, 10)
    assert np.mean([It[i, 0] in I[i] for i in range(100)]) > 0.8


def test_metric_codes_match_faiss():
    assert METRIC_INNER_PRODUCT == faiss.METRIC_INNER_PRODUCT
    assert METRIC_L2 == faiss.METRIC_L2
    idx = tqvec.index_factory(8, "TQ4", faiss.METRIC_L2)
    assert idx.metric_type == faiss.METRIC_L2 and idx.is_trained and idx.d == 8


@pytest.mark.parametrize("metric,pad", [("ip", -FLT_MAX), ("l2", FLT_MAX)])
def test_k_larger_than_ntotal_pads_like_faiss(metric, pad, rng):
    xb, xq = _data(rng, n=3, d=8, nq=2)
    index = tqvec.index_factory(8, "TQ4", metric)
    index.add(xb)
    D, I = index.search(xq, 5)
    assert (I[:, 3:] == -1).all() and (D[:, 3:] == pad).all()
    assert sorted(I[0, :3]) == [0, 1, 2]
    empty = tqvec.index_factory(8, "TQ4", metric)
    D, I = empty.search(xq, 2)
    assert (I == -1).all() and (D == pad).all()


def test_ids_removal_reconstruct_and_filters(rng):
    xb, xq = _data(rng, n=500, d=16)
    index = tqvec.index_factory(16, "TQ8", "l2")
    ids = np.arange(1000, 1500, dtype=np.int64)
    index.add_with_ids(xb, ids)
    assert index.ntotal == 500
    D, I = index.search(xb[:5], 1)
    np.testing.assert_array_equal(I[:, 0], ids[:5])
    np.testing.assert_allclose(index.reconstruct(1003), xb[3], atol=0.05)
    assert index.remove_ids(np.array([1000, 1001, 7])) == 2 and index.ntotal == 498
    _, I = index.search(xb[:2], 3)
    assert 1000 not in I and 1001 not in I
    with pytest.raises(KeyError):
        index.reconstruct(1000)
    # a filter keeps the ranking: the unfiltered order of every row, cut to the allowed ids
    allowed = ids[100:130:2]
    D_all, I_all = index.search(xq, index.ntotal)
    keep = np.isin(I_all, allowed)
    want_D = np.stack([D_all[i][keep[i]][:10] for i in range(len(xq))])
    want_I = np.stack([I_all[i][keep[i]][:10] for i in range(len(xq))])
    D, I = index.search(xq, 10, allowed_ids=allowed)
    np.testing.assert_allclose(D, want_D, rtol=1e-6, atol=1e-6)
    unique = np.array([[np.sum(row == v) == 1 for v in row] for row in D])  # untied scores
    np.testing.assert_array_equal(I[unique], want_I[unique])
    D, I = index.search(xq, 17, allowed_ids=allowed)  # 15 allowed: padded after them
    assert (I[:, :15] >= 0).all() and (I[:, 15:] == -1).all()
    sel = faiss.IDSelectorBatch(allowed)
    D2, I2 = index.search(xq, 10, params=faiss.SearchParameters(sel=sel))
    np.testing.assert_allclose(D2, want_D, rtol=1e-6, atol=1e-6)
    index.add(xb[:3])  # plain add after ids continues after the largest id, like IndexIDMap2
    assert index.ntotal == 501
    assert index.search(xb[:1], 1)[1][0, 0] == 1500  # xb[0] again; its old id 1000 is gone
    np.testing.assert_allclose(index.reconstruct(1502), xb[2], atol=0.05)
    index.reset()
    assert index.ntotal == 0


def test_range_search_matches_search(rng):
    xb, xq = _data(rng, n=300, d=16, nq=4)
    for metric, radius in (("l2", 20.0), ("ip", 3.0)):
        index = tqvec.index_factory(16, "TQ4", metric)
        index.add(xb)
        lims, D, I = index.range_search(xq, radius)
        Dk, Ik = index.search(xq, 300)
        for i in range(len(xq)):
            inside = (Dk[i] < radius) if metric == "l2" else (Dk[i] > radius)
            assert set(I[lims[i]:lims[i + 1]].tolist()) == set(Ik[i][inside].tolist())


def test_refinement_improves_recall(rng):
    xb, xq = _data(rng, n=3000, d=32, nq=50)
    exact = faiss.IndexFlatL2(32)
    exact.add(xb)
    _, It = exact.search(xq, 10)

    def recall(spec):
        index = tqvec.index_factory(32, spec, "l2", k_factor=8)
        index.add(xb)
        _, I = index.search(xq, 10)
        return np.mean([len(set(I[i]) & set(It[i])) / 10 for i in range(len(xq))])

    assert recall("TQ2,Refine(Flat)") > recall("TQ2") + 0.2
    assert recall("TQ2,Refine(TQ8)") > recall("TQ2") + 0.2
    assert tqvec.index_factory(32, "TQ2,Refine(TQ8)").code_size == (8 + 4) + (32 + 4)


@pytest.mark.parametrize("spec", ["TQ1,Refine(TQ8)", "TQ2,Refine(TQ4)", "Center,TQ2,Refine(TQ8)",
                                  "IVF8,TQ2,Refine(TQ8)", "TQ1,Refine(TQ8g)",
                                  "IVF8,TQ2,Refine(TQ8g)"])
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_codec_refinement_rescored_in_the_rotated_domain(spec, metric, rng):
    """A TurboQuant-mse refinement re-scores candidates with ops.lut_rescore (rotated-domain
    tables); the same results as decoding them (the similarity to the reconstruction), and
    D is that similarity computed from the decoded refinement codes."""
    xb, xq = _data(rng, n=2000, d=48, nq=12)
    if metric == "ip":
        xb *= rng.uniform(0.5, 2.0, (len(xb), 1)).astype(np.float32)
    index = tqvec.index_factory(48, spec, metric)
    if not index.is_trained:
        index.train(xb)
    index.add(xb)
    D1, I1 = index.search(xq, 10)
    assert index._ref_lut is not None
    with index._lock:
        index._ref_lut = index._scan = None
    index._refine_lut = lambda: None  # the decode path
    D2, I2 = index.search(xq, 10)
    np.testing.assert_allclose(D1, D2, rtol=1e-4, atol=1e-4)
    assert (I1 == I2).mean() > 0.97
    D3, I3 = index.search(torch.from_numpy(xq), 10)  # general path, decode
    np.testing.assert_allclose(D1, D3, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", ["TQ3", "TQ2,Refine(TQ8)", "QJL64,Refine(Flat)"])
@pytest.mark.parametrize("mmap", [False, True])
def test_write_read_round_trip(tmp_path, spec, mmap, rng):
    xb, xq = _data(rng, n=400)
    index = tqvec.index_factory(32, spec, "l2")
    index.add_with_ids(xb, np.arange(400) * 3)
    tqvec.write_index(index, tmp_path / "i.tqv")
    back = tqvec.read_index(tmp_path / "i.tqv", mmap=mmap)
    D1, I1 = index.search(xq, 7)
    D2, I2 = back.search(xq, 7)
    np.testing.assert_array_equal(I1, I2)
    np.testing.assert_array_equal(D1, D2)
    assert back.ntotal == 400 and back.metric_type == index.metric_type


def test_hostile_index_files(tmp_path, rng):
    index = tqvec.index_factory(32, "TQ3")
    index.add(_data(rng, n=50)[0])
    path = tmp_path / "i.tqv"
    tqvec.write_index(index, path)
    data = path.read_bytes()
    for bad in (data[: len(data) // 2], b"junk" + data[4:], data[:-1] + bytes([data[-1] ^ 1])):
        path.write_bytes(bad)
        with pytest.raises(FormatError):
            tqvec.read_index(path)
    tqvec.save_codes(path, tqvec.TurboQuant(8, 2).encode(np.ones((2, 8), np.float32)))
    with pytest.raises(FormatError, match="holds a 'codes', expected 'index'"):
        tqvec.read_index(path)


def test_concurrent_searches_agree(rng):
    xb, xq = _data(rng, n=3000)
    index = tqvec.index_factory(32, "TQ4", "ip")
    index.add(xb)
    want = index.search(xq, 5)
    out = [None] * 4

    def run(i):
        out[i] = index.search(xq, 5)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _, I in out:
        np.testing.assert_array_equal(I, want[1])


def test_torch_inputs_and_single_query(rng):
    xb, _ = _data(rng, n=100)
    index = tqvec.index_factory(32, "TQ4")
    index.add(torch.from_numpy(xb).to(torch.bfloat16))
    D, I = index.search(torch.from_numpy(xb[:1]), 3)
    assert I.shape == (1, 3) and I[0, 0] == 0


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_refinement_rotation_shared_or_its_own(metric, rng):
    """index_factory gives the refinement the codes' seed, so the compiled call rotates each
    query once for both; a refinement with its own seed (files written before) is rotated
    separately. Either way the one-call results equal the general path's bit for bit, and
    IVF's too."""
    if "cpu" not in tqvec.available_backends():
        pytest.skip("compiled module missing")
    from tqvec.index import FlatIndex, IVFIndex

    xb, xq = _data(rng, n=3000, d=48, nq=9)
    shared = tqvec.index_factory(48, "TQ1,Refine(TQ8g)", metric)
    assert shared.refine.seed == shared.codec.seed
    own = FlatIndex(tqvec.TurboQuant(48, 1), metric,
                    refine=tqvec.TurboQuant(48, 8, seed=7, codebook="grid"))
    ivf = IVFIndex(tqvec.TurboQuant(48, 1), 8, metric, refine=tqvec.TurboQuant(48, 8, seed=7))
    ivf.train(xb)
    for index in (shared, own, ivf):
        index.add(xb)
        state = index.snapshot().scan
        assert state.fused is not None  # the compiled call, not the composition
        assert_numpy_path_matches(index, [xq[:1], xq])


@pytest.mark.parametrize("spec", ["IVF8,TQ2,Refine(TQ6)", "IVF8,TQ1,Refine(Flat)", "IVF8,TQ4"])
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_ivf_candidates_one_call_equals_the_composition(spec, metric, rng, monkeypatch):
    """search_candidates (what a sharded search merges) in one compiled call returns what the
    composed kernels return, bit for bit: probed here or given the coordinator's probes, a
    few queries (the kernels split) and many (each thread a share), k above the rows."""
    if "cpu" not in tqvec.available_backends():
        pytest.skip("compiled module missing")
    from tqvec.index import IVFIndex

    xb, xq = _data(rng, n=1500, d=40, nq=150)
    index = tqvec.index_factory(40, spec, metric, seed=3)
    index.train(xb)
    index.add(xb)
    index.nprobe = 3
    assert index.snapshot().scan.fused is not None
    cases = [(q, k, probes) for q in (xq[:1], xq[:9], xq) for k in (1, 10, 2000)
             for probes in (None, index.probe(q))]
    fused = [index.search_candidates(q, k, rows=4000, probes=p) for q, k, p in cases]
    monkeypatch.setattr(IVFIndex, "_fused_candidates", lambda *a: None)
    for (q, k, p), got in zip(cases, fused, strict=True):
        want = index.search_candidates(q, k, rows=4000, probes=p)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("spec,scale,codebook", [("TQ8g", "norm", "grid"),
                                               ("TQ2gu", "unbiased", "grid"),
                                               ("TQ3gf", "fit", "grid"),
                                               ("TQ3f", "fit", "lloyd-max")])
def test_factory_codebook_and_scale_suffixes(spec, scale, codebook):
    index = tqvec.index_factory(32, spec)
    assert (index.codec.scale, index.codec.codebook_kind) == (scale, codebook)
    b = int(spec[2])
    assert index.code_size == b * 4 + 4 + (2 if scale == "unbiased" else 0)


@pytest.mark.parametrize("spec,msg", [("PQ8", "is a faiss index type tqvec does not build"),
                                      ("TQ2ug", "index spec component must be one of"),
                                      ("IVF,TQ4", "for an IVF index"),
                                      ("Flat", "for exact search use faiss.s IndexFlat"),
                                      ("Flat,Refine(TQ8)", "Flat is only a refinement"),
                                      ("TQ4,Refine(TQ8", "spec must look like")])
def test_bad_factory_strings(spec, msg):
    with pytest.raises(ValueError, match=msg):
        tqvec.index_factory(32, spec)
    with pytest.raises(ValueError, match="metric must be one of"):
        tqvec.index_factory(32, "TQ4", "hamming")


@pytest.mark.parametrize("spec", ["TQ3,Refine(TQ8)", "TQprod3", "QJL64", "TQprod1", "TQ2u"])
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_lut_and_gemm_search_paths_agree(spec, metric, rng, monkeypatch):
    """The fast-scan kernel (every 1-4-bit term codec on CPU: mse codes, prod's mse codes +
    QJL signs, QJL alone), the plain LUT scan (mse) and the block GEMM over decoded codes
    give the same results, with a filter."""
    from tqvec.index import flat

    xb, xq = _data(rng, n=3000, d=48, nq=20)
    index = tqvec.index_factory(48, spec, metric)
    index.add(xb)
    allowed = np.arange(0, 3000, 2)
    D1, I1 = index.search(xq, 10, allowed_ids=allowed)
    assert index._scan.scanner is not None  # the fast-scan kernel ran
    monkeypatch.setattr(index, "_fast_scan_ok", lambda: False)
    index._scan = None
    paths = [index.search(xq, 10, allowed_ids=allowed)]  # LUT scan (mse) or GEMM
    monkeypatch.setattr(flat, "_LUT_MAX_QUERIES", 0)
    paths.append(index.search(xq, 10, allowed_ids=allowed))  # GEMM
    for D2, I2 in paths:
        np.testing.assert_allclose(D1, D2, rtol=1e-4, atol=1e-4)
        assert (I1 == I2).mean() > 0.98 and (I1 % 2 == 0).all()


@pytest.mark.parametrize("spec", ["TQ1", "TQ3", "TQ2,Prefilter(4)", "TQprod2", "QJL64",
                                  "Center,TQ2", "Center,TQ1u", "TQ3f", "TQ1,Refine(TQ8)",
                                  "Center,TQ2,Refine(TQ4)", "TQ2,Refine(Flat)", "TQ3g",
                                  "TQ1,Refine(TQ8g)"])
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_numpy_fast_path_equals_general_path(spec, metric, rng):
    """float32 numpy queries take the short CPU path (FlatIndex._search_fast_numpy; for
    TurboQuant-mse codes one compiled call, ops.FlatSearch, refinement included, k_factor read
    at each search), torch queries the general one: bit-identical results; bad input still
    gets the general errors."""
    xb, xq = _data(rng, n=3000, d=48, nq=7)
    index = tqvec.index_factory(48, spec, metric)
    index.train(xb)
    index.add_with_ids(xb, np.arange(3000) * 3 + 1)
    state = index._scan_state()
    one_call = "TQ" in spec and "prod" not in spec
    if state is not None and "cpu" in tqvec.available_backends():
        assert (state.fused is not None) == one_call
    assert_numpy_path_matches(index, [xq[:1], xq])
    assert_numpy_path_matches(index, [np.zeros((2, 48), np.float32)])  # cosine: zero rows stay 0
    if "Refine" in spec:
        index.k_factor = 2
        assert_numpy_path_matches(index, [xq[:3]])
    index.remove_ids(np.arange(0, 3000, 5) * 3 + 1)  # the state follows removals (and ids)
    _, I1 = assert_numpy_path_matches(index, [xq[:2]])
    assert not np.isin(I1, np.arange(0, 3000, 5) * 3 + 1).any()
    small = tqvec.index_factory(48, spec, metric)
    small.train(xb)
    small.add(xb[:40])
    D1, I1 = small.search(xq, 50)  # 40 rows < k: padded (general path: too few rows per result)
    assert (I1[:, 40:] == -1).all() and (I1[:, :40] >= 0).all()
    bad = xq.copy()
    bad[2, 5] = np.nan
    with pytest.raises(ValueError, match="must be finite"):
        index.search(bad, 10)
    bad[2, 5] = -np.inf  # the compiled one-call search checks its queries itself
    with pytest.raises(ValueError, match="must be finite"):
        index.search(bad[2:3], 10)
    with pytest.raises(ValueError, match="48 columns"):
        index.search(xq[:, :40], 10)


@pytest.mark.parametrize("spec", ["TQ1", "TQ1gf", "TQ2", "TQ3", "TQ4", "TQ6", "TQ8"])
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_sign_prefilter(spec, metric, rng, tmp_path):
    """prefilter = P: the sign plane picks P * k candidates, their full codes rank them (1-bit
    codes: the first half of the coordinates picks them). With P * k >= n every row is
    re-scored: the exact search's results. Small P keeps most of the exact top k on structured
    data; the sign plane follows adds and removes; it persists."""
    # Fashion-like: non-negative rows near a 6-dimensional subspace, norms spread 4x. A first
    # pass that mixed the 1-bit inner product with the full code's ||x_hat||^2 (L2) ranked
    # short rows first and kept ~50 % of the exact top 10 here (Fashion-MNIST: 17 %).
    z = rng.standard_normal((3020, 6)).astype(np.float32)
    x = np.abs(z @ rng.standard_normal((6, 48)).astype(np.float32)
               + 0.5 * rng.standard_normal((3020, 48)).astype(np.float32))
    x *= rng.uniform(0.5, 2.0, (3020, 1)).astype(np.float32)
    xb, xq = x[:3000], x[3000:]
    index = tqvec.index_factory(48, spec, metric)
    index.add(xb[:1000])
    index.search(xq, 10)
    index.add(xb[1000:])  # the exact scan state exists; the prefilter builds its own
    D0, I0 = index.search(xq, 10)
    index.prefilter = 300  # 3,000 candidates: all rows
    D1, I1 = index.search(xq, 10)
    assert index._scan.signs is not None and index._scan.scanner is None
    np.testing.assert_array_equal(I1, I0)
    np.testing.assert_allclose(D1, D0, rtol=1e-4, atol=1e-3)  # another summation order
    D2, I2 = index.search(torch.from_numpy(xq), 10)  # general path == numpy path
    np.testing.assert_array_equal(I2, I1)
    index.prefilter = 10
    _, I3 = index.search(xq, 10)
    assert np.mean([len(set(I3[i]) & set(I0[i])) / 10 for i in range(20)]) > 0.8
    index.remove_ids(np.arange(0, 3000, 2))
    index.prefilter = 300
    _, I4 = index.search(xq, 10)
    assert (I4 % 2 == 1).all()
    index.prefilter = 0
    np.testing.assert_array_equal(I4, index.search(xq, 10)[1])
    index.prefilter = 10
    tqvec.write_index(index, str(tmp_path / "p.tqv"))
    assert tqvec.read_index(str(tmp_path / "p.tqv")).prefilter == 10


@pytest.mark.parametrize("spec", ["TQ1", "TQ1u", "TQ1f", "TQ1g", "Center,TQ1", "Center,TQ1u",
                                  "Center,TQ1f", "TQ2u", "Center,TQ2u"])
def test_every_first_pass_variant_keeps_the_exact_top_k(spec, rng):
    """The first pass of every scale and centring (1 bit: the codes of the first half of the
    coordinates) keeps most of the exact scan's top 10 on Fashion-like data. An unbiased scale
    (u) scores ~d1/d of <q, x> from that prefix, so its L2 offset is d1/d of ||x||^2; ranked by
    the distance to its 1-bit reconstruction (a biased code's rule), whose norm the unbiased
    scale stretches, TQ1u kept 7 % of the exact top 10 here and 23 % on Fashion-MNIST."""
    z = rng.standard_normal((3020, 6)).astype(np.float32)
    x = np.abs(z @ rng.standard_normal((6, 48)).astype(np.float32)
               + 0.5 * rng.standard_normal((3020, 48)).astype(np.float32))
    x *= rng.uniform(0.5, 2.0, (3020, 1)).astype(np.float32)
    xb, xq = x[:3000], x[3000:]
    index = tqvec.index_factory(48, spec, "l2")
    index.train(xb)
    index.add(xb)
    _, exact = index.search(xq, 10)
    index.prefilter = 10
    _, first = index.search(xq, 10)
    kept = np.mean([len(set(first[i]) & set(exact[i])) / 10 for i in range(len(xq))])
    assert kept > 0.8, kept


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_centering(metric, rng, tmp_path):
    """Center,: codes of x - mu (mu fitted by train). Far from the origin it keeps more of the
    exact L2 neighbours; distances and similarities stay those of the original vectors (exact
    with Refine(Flat)); both query paths agree; the center survives write/read."""
    offset = 8.0 * np.abs(rng.standard_normal(48)).astype(np.float32)
    xb = rng.standard_normal((3000, 48)).astype(np.float32) + offset
    xq = rng.standard_normal((20, 48)).astype(np.float32) + offset
    index = tqvec.index_factory(48, "Center,TQ2", metric)
    assert not index.is_trained
    with pytest.raises(ValueError, match="must be trained before add"):
        index.add(xb)
    with pytest.raises(ValueError, match="must be trained before search"):
        index.search(xq, 5)
    index.train(xb)
    index.add(xb)
    plain = tqvec.index_factory(48, "TQ2", metric)
    plain.add(xb)
    exact = tqvec.index_factory(48, "TQ8,Refine(Flat)", metric)
    exact.add(xb)
    _, It = exact.search(xq, 10)
    hit = lambda I: np.mean([len(set(I[i]) & set(It[i])) / 10 for i in range(len(I))])  # noqa
    D, I = index.search(xq, 10)
    if metric == "l2":  # (ip / cosine neighbours of offset Gaussian data say little)
        assert hit(I) > hit(plain.search(xq, 10)[1]) + 0.05
    D2, I2 = index.search(torch.from_numpy(xq), 10)
    np.testing.assert_array_equal(I, I2)
    np.testing.assert_allclose(D, D2, rtol=1e-5, atol=1e-4)
    ref = tqvec.index_factory(48, "Center,TQ8,Refine(Flat)", metric)
    ref.train(xb)
    ref.add(xb)
    D, I = ref.search(xq[:3], 5)
    x, q = xb[I], xq[:3, None, :]
    true = {"l2": ((x - q) ** 2).sum(-1), "ip": (x * q).sum(-1),
            "cosine": (x * q).sum(-1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(q, axis=-1)}
    np.testing.assert_allclose(D, true[metric], rtol=2e-3, atol=2e-3)
    tqvec.write_index(index, str(tmp_path / "c.tqv"))
    back = tqvec.read_index(str(tmp_path / "c.tqv"))
    np.testing.assert_array_equal(back.center, index.center)
    np.testing.assert_array_equal(back.search(xq, 10)[1], I2)
    with pytest.raises(ValueError, match="index must be empty to fit"):
        index.train(xb)


@pytest.mark.parametrize("spec", ["Center,TQ2", "Center,TQ1u", "Center,QJL64"])
def test_centred_inner_product_correction(spec, rng, tmp_path):
    """A centred inner-product index scores <q, mu> + a <mu, y> + est<q - mu, y> (y = x - mu):
    only <q - mu, y> comes from the codes, so a query at the centre is scored ||mu||^2 +
    a <mu, y> — exactly <mu, x> for the unbiased estimators (a = 1), a = cos(y, y_hat) for the
    norm-rescaled mse codes — on every search path, after remove_ids and after write/read; the
    correction costs 4 bytes/row. A centred cosine index is the centred inner product of unit
    vectors."""
    d = 64
    xb = rng.standard_normal((2000, d)).astype(np.float32) + 2.0
    index = tqvec.index_factory(d, spec, "ip")
    index.train(xb)
    index.add(xb)
    assert index.code_size == tqvec.index_factory(d, spec[len("Center,"):], "ip").code_size + 4
    q = index.center[None, :]
    y, y_hat = xb - q, index.reconstruct_n(0, len(xb)) - q
    a = 1.0 if index.codec.unbiased_ip else (
        (y * y_hat).sum(1) / np.linalg.norm(y, axis=1) / np.linalg.norm(y_hat, axis=1))
    assert np.all(a > 0.5) and np.all(a <= 1.0)
    exact = (q * q).sum() + a * (y @ q[0])
    for query in (q, torch.from_numpy(q)):
        D, I = index.search(query, len(xb))
        np.testing.assert_allclose(D[0], exact[I[0]], rtol=1e-4, atol=1e-4)
    lims, D, I = index.range_search(q, -1e30)
    np.testing.assert_allclose(D, exact[I], rtol=1e-4, atol=1e-4)
    assert index.remove_ids(np.arange(0, 2000, 3)) == 667
    D, I = index.search(q, 50)
    np.testing.assert_allclose(D[0], exact[I[0]], rtol=1e-4, atol=1e-4)
    tqvec.write_index(index, str(tmp_path / "c.tqv"))
    back = tqvec.read_index(str(tmp_path / "c.tqv"))
    xq = np.concatenate([q, rng.standard_normal((5, d)).astype(np.float32) + 2.0])
    D, I = index.search(xq, 10)
    D2, I2 = back.search(xq, 10)
    np.testing.assert_array_equal(I2, I)
    np.testing.assert_array_equal(D2, D)
    rows = index._rows  # a file whose correction does not match its rows
    rows.per_row["ipcorr"] = rows.per_row["ipcorr"][:-1]
    tqvec.write_index(index, str(tmp_path / "bad.tqv"))
    with pytest.raises(FormatError, match="ipcorr"):
        tqvec.read_index(str(tmp_path / "bad.tqv"))
    cos = tqvec.index_factory(d, spec, "cosine")
    cos.train(xb)
    cos.add(xb)
    unit = xb / np.linalg.norm(xb, axis=1, keepdims=True)
    ip = tqvec.FlatIndex(cos.codec, "ip", center=cos.center)
    ip.add(unit)
    qu = xq / np.linalg.norm(xq, axis=1, keepdims=True)
    Dc, Ic = cos.search(xq, 10)
    Di, Ii = ip.search(qu, 10)
    np.testing.assert_array_equal(Ic, Ii)
    np.testing.assert_allclose(Dc, Di, rtol=1e-5, atol=1e-5)


def test_center_vector_and_rejections(rng):
    x = rng.standard_normal((500, 16)).astype(np.float32) + 5
    mu = x.mean(0)
    given = tqvec.FlatIndex(tqvec.TurboQuant(16, 3), "l2", center=mu)
    fitted = tqvec.index_factory(16, "Center,TQ3", "l2")
    fitted.train(x)
    given.add(x)
    fitted.add(x)
    np.testing.assert_allclose(given.center, fitted.center, rtol=1e-5, atol=1e-5)
    # the codes hold x - mu: the reconstruction's error is the codec's on x - mu (Lloyd-Max
    # cost at d = 16, 3 bits), not on x (25x larger here); 500 rows: within 20 % of it
    rec = given.reconstruct_n(0, 500)
    rel = ((rec - x) ** 2).sum(1).mean() / ((x - mu) ** 2).sum(1).mean()
    expect = tqvec.TurboQuant(16, 3).expected_mse
    assert 0.8 * expect < rel < 1.2 * expect, (rel, expect)
    np.testing.assert_array_equal(given.reconstruct(3), rec[3])
    lims, D, I = given.range_search(x[:2], 30.0)
    assert lims[-1] > 0 and (D < 30.0).all()
    with pytest.raises(ValueError, match="must not combine Center with IVF"):
        tqvec.index_factory(16, "Center,IVF4,TQ3")
    with pytest.raises(ValueError, match="center must be None, 'fit'"):
        tqvec.FlatIndex(tqvec.TurboQuant(16, 3), "l2", center="mean")
    with pytest.raises(ValueError, match="center must have 16 columns"):
        tqvec.FlatIndex(tqvec.TurboQuant(16, 3), "l2", center=np.zeros(8))
    with pytest.raises(ValueError, match="without center"):
        given.to_faiss()


def test_prefilter_factory_string():
    index = tqvec.index_factory(64, "TQ3,Prefilter(12),Refine(Flat)", "l2")
    assert index.prefilter == 12 and index.refine == "flat" and index.code_size == 24 + 4 + 256
    with pytest.raises(ValueError, match="must not combine IVF with Prefilter"):
        tqvec.index_factory(64, "IVF8,TQ4,Prefilter(4)")


def test_prefilter_rejected_where_it_cannot_apply():
    for spec in ("TQprod3", "QJL64", "Polar"):
        with pytest.raises(ValueError, match="prefilter must be 0"):
            tqvec.index_factory(64, spec).prefilter = 4
    with pytest.raises(ValueError, match="1-bit codes: d > 8"):  # no shorter prefix of 8
        tqvec.index_factory(8, "TQ1").prefilter = 4
    with pytest.raises(ValueError, match="prefilter must be in 0..1048576, got -1"):
        tqvec.index_factory(64, "TQ4").prefilter = -1
    with pytest.raises(ValueError, match="prefilter must be 0 for an IVF index"):
        tqvec.index_factory(64, "IVF8,TQ4").prefilter = 4


@pytest.mark.parametrize("spec", ["TQ1", "TQ2", "TQ3", "TQ4", "TQprod3", "QJL40"])
def test_fast_scan_layout_follows_adds_and_removes(spec):
    """The blocked copy is extended on add (partial last block included) and rebuilt after a
    removal: results always equal those of an index built in one go."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3000, 40)).astype(np.float32)
    q = rng.standard_normal((5, 40)).astype(np.float32)
    inc = tqvec.index_factory(40, spec, "l2")
    for s, e in ((0, 1000), (1000, 1017), (1017, 3000)):
        inc.add(x[s:e])
        inc.search(q, 10)  # builds / extends the fast-scan copy
    whole = tqvec.index_factory(40, spec, "l2")
    whole.add(x)
    for nq in (1, 5):
        D1, I1 = inc.search(q[:nq], 10)
        D2, I2 = whole.search(q[:nq], 10)
        np.testing.assert_array_equal(I1, I2)
        np.testing.assert_allclose(D1, D2, rtol=1e-6)
    inc.remove_ids(np.arange(0, 3000, 2))
    D3, I3 = inc.search(q, 10)
    assert (I3 % 2 == 1).all()
    ref = tqvec.index_factory(40, spec, "l2")
    ref.add_with_ids(x[1::2], np.arange(1, 3000, 2))
    np.testing.assert_array_equal(I3, ref.search(q, 10)[1])


@pytest.mark.parametrize("spec", ["TQ1", "TQ3", "TQprod3", "QJL40", "PCA,TQ2", "IVF8,TQ4",
                                  "IVF8,TQ3,Refine(Flat)"])
def test_codes_are_held_once(spec, tmp_path):
    """After a search the scan's blocked layout holds the codes and the row-major copy is gone;
    whatever reads row-major codes (reconstruction, files, removals, appends) gets them back
    from the layout, exactly."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3000, 40)).astype(np.float32)
    q = rng.standard_normal((4, 40)).astype(np.float32)
    index = tqvec.index_factory(40, spec, "l2")
    index.train(x)
    index.add(x[:2000])
    plain = index.reconstruct_n(0, 2000)
    D0, I0 = index.search(q, 10)
    inner = index.index if isinstance(index, tqvec.PCAIndex) else index
    assert inner._rows.released == 2000  # held by the layout only
    np.testing.assert_array_equal(index.reconstruct_n(0, 2000), plain)
    # (one row through a PCA basis product rounds apart from 2,000 rows' by a few ulps)
    np.testing.assert_allclose(index.reconstruct(1234), plain[1234], rtol=1e-6, atol=1e-6)
    tqvec.write_index(index, tmp_path / "i.tqv")
    back = tqvec.read_index(tmp_path / "i.tqv")
    np.testing.assert_array_equal(back.reconstruct_n(0, 2000), plain)
    np.testing.assert_array_equal(back.search(q, 10)[1], I0)
    index.add(x[2000:])  # appended row-major, then taken into the layout
    index.search(q, 10)
    assert inner._rows.released == 3000
    assert index.remove_ids(np.arange(0, 3000, 3)) == 1000
    whole = tqvec.index_factory(40, spec, "l2")
    whole.train(x)
    whole.add_with_ids(x[np.arange(3000) % 3 != 0], np.arange(3000)[np.arange(3000) % 3 != 0])
    D1, I1 = index.search(q, 10)
    D2, I2 = whole.search(q, 10)
    np.testing.assert_array_equal(I1, I2)
    np.testing.assert_allclose(D1, D2, rtol=1e-6, atol=1e-5)
