"""to_faiss(): tqvec TurboQuant-mse codes in faiss's SQtqmse index, same codes and codebook."""

import numpy as np
import pytest

import tqvec

faiss = pytest.importorskip("faiss")


def _unit(a):
    return (a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(11)
    c = 3 * rng.standard_normal((10, 96))
    xb = (c[rng.integers(0, 10, 2000)] + rng.standard_normal((2000, 96))).astype(np.float32)
    xq = (c[rng.integers(0, 10, 40)] + rng.standard_normal((40, 96))).astype(np.float32)
    return xb, xq


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_l2_over_unit_vectors_gives_the_same_results(data, bits):
    xb, xq = _unit(data[0]), data[1]
    index = tqvec.index_factory(96, f"TQ{bits}", "l2")
    index.add(xb)
    f = index.to_faiss()
    assert f.ntotal == index.ntotal and f.d == 96 and f.is_trained
    D, I = index.search(xq, 10)
    Df, If = f.search(xq, 10)
    np.testing.assert_allclose(Df, D, rtol=1e-5, atol=1e-4)
    assert (If == I).mean() >= 0.99  # float-rounding ties aside, the same order


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("grid", ["", "g"])
def test_faiss_decodes_our_reconstructions(data, bits, grid):
    """The codebook is ours (faiss's own table is a Gaussian approximation; the uniform grid of
    TQ{b}g goes the same way) and the codes are bit-identical: faiss's decoder gives back
    exactly what tqvec decodes."""
    xb = _unit(data[0][:300])
    index = tqvec.index_factory(96, f"TQ{bits}{grid}", "l2")
    index.add(xb)
    f = index.to_faiss()
    ours = index.reconstruct_n(0, 300)
    payload = index.state()[1]["codes.payload"]
    np.testing.assert_allclose(f.sa_decode(payload), ours, atol=2e-6)
    enc = f.sa_encode(xb)
    assert enc.shape == payload.shape
    # faiss rotates with a float32 GEMM, tqvec with the Hadamard butterflies: a coordinate
    # sitting on a threshold may round the other way, nothing more.
    assert (enc == payload).mean() > 0.999


@pytest.mark.parametrize("metric", ["cosine", "ip"])
def test_ip_and_cosine_use_faiss_estimator_on_the_same_codes(data, metric):
    xb, xq = data
    if metric == "ip":
        xb = _unit(xb)
    index = tqvec.index_factory(96, "TQ4", metric)
    index.add(xb)
    with pytest.raises(ValueError, match="faiss_estimator=True"):
        index.to_faiss()
    f = index.to_faiss(faiss_estimator=True)
    Df, If = f.search(xq, 10)
    # The codes hold the direction of x (its norm is stored apart): x_hat / ||x|| = Pi^T c[idx].
    rec = index.reconstruct_n(0, index.ntotal) / np.linalg.norm(xb, axis=1, keepdims=True)
    q = xq / np.linalg.norm(xq, axis=1, keepdims=True)
    # faiss: inner product of the normalized query with that (no division by ||c[idx]||)
    want = np.take_along_axis((q if metric == "cosine" else xq) @ rec.T, If, axis=1)
    np.testing.assert_allclose(Df, want, atol=1e-4)
    # faiss's estimator ranks worse than tqvec's cosine to the reconstruction (why the export
    # asks for faiss_estimator=True)
    xn = xb / np.linalg.norm(xb, axis=1, keepdims=True)
    gt = np.argsort(-(q @ xn.T), axis=1)[:, :10]
    _, I = index.search(xq, 10)

    def recall(res):
        return np.mean([len(set(a) & set(b)) / 10 for a, b in zip(res, gt, strict=True)])
    assert recall(I) > recall(If) + 0.1


def test_ids_removal_and_refine_flat(data):
    xb, xq = _unit(data[0]), data[1]
    ids = np.arange(2000, dtype=np.int64) * 7 + 3
    for spec in ("TQ2", "TQ2,Refine(Flat)"):
        index = tqvec.index_factory(96, spec, "l2")
        index.add_with_ids(xb, ids)
        index.remove_ids(ids[:100])
        f = index.to_faiss()
        assert isinstance(f, faiss.IndexIDMap2) and f.ntotal == 1900
        D, I = index.search(xq, 10)
        Df, If = f.search(xq, 10)
        assert set(If.ravel()) <= set(ids[100:].tolist())
        np.testing.assert_allclose(Df, D, rtol=1e-5, atol=1e-4)
        assert (If == I).mean() >= 0.99
        # faiss's IndexRefine reconstructs from its exact vectors, the plain index from codes
        want = index.reconstruct(int(ids[500])) if spec == "TQ2" else xb[500]
        np.testing.assert_allclose(f.reconstruct(int(ids[500])), want, atol=2e-6)


def test_refine_flat_cosine(data):
    xb, xq = data
    index = tqvec.index_factory(96, "TQ1,Refine(Flat)", "cosine", k_factor=8)
    index.add(xb)
    f = index.to_faiss(faiss_estimator=True)
    assert isinstance(f, faiss.IndexRefine) and f.k_factor == 8
    D, I = index.search(xq, 10)
    Df, If = f.search(xq, 10)
    np.testing.assert_allclose(Df, D, atol=1e-5)  # exact cosines of the same candidates
    assert (If == I).mean() >= 0.99


def test_faiss_file_keeps_our_codebook(data, tmp_path):
    xb, xq = _unit(data[0]), data[1]
    index = tqvec.index_factory(96, "TQ3", "l2")
    index.add(xb)
    f = index.to_faiss()
    faiss.write_index(f, str(tmp_path / "f.index"))
    g = faiss.read_index(str(tmp_path / "f.index"))
    np.testing.assert_array_equal(g.search(xq, 10)[1], f.search(xq, 10)[1])
    # vectors added later are coded by the same quantizer
    g.add(xb[:5])
    assert g.ntotal == 2005
    np.testing.assert_allclose(g.reconstruct_n(2000, 5), index.reconstruct_n(0, 5), atol=1e-5)


def test_empty_index_exports():
    index = tqvec.index_factory(32, "TQ4", "cosine")
    f = index.to_faiss(faiss_estimator=True)
    assert f.ntotal == 0
    f.add(np.eye(32, dtype=np.float32))
    assert f.search(np.eye(32, dtype=np.float32)[:2], 1)[1].ravel().tolist() == [0, 1]


@pytest.mark.parametrize("spec", ["TQprod3", "QJL96", "Polar", "TQ5", "TQ2u", "TQ2f",
                                  "TQ2,Refine(TQ8)", "IVF4,TQ2"])
def test_unexportable_indexes_are_refused(data, spec):
    index = tqvec.index_factory(96, spec, "cosine")
    with pytest.raises(ValueError, match="to_faiss"):
        index.to_faiss(faiss_estimator=True)


def test_non_unit_vectors_refused_for_ip_and_l2(data):
    for metric in ("ip", "l2"):
        index = tqvec.index_factory(96, "TQ4", metric)
        index.add(data[0][:50])
        with pytest.raises(ValueError, match="unit-norm.*metric='cosine'"):
            index.to_faiss(faiss_estimator=True)
