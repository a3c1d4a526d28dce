"""Searching parts of a collection and merging (``tqvec.index.merge_candidates``) gives one
index's result: the same ids (ties aside) and distances within float tolerance, for every
metric, with and without a refinement, centred, IVF and PCA indexes, 1, 2, 3 and 7 parts
with an empty part, and k above the rows of a part; so does the merge that re-ranks after
it (``merge_scans``, each part's ``refine_candidates``, ``merge_refined``)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tqvec
from tqvec.index import merge_candidates, merge_ranges, merge_refined, merge_scans

N, D_, NQ = 2400, 48, 30
RNG = np.random.default_rng(11)
X = RNG.standard_normal((N, D_)).astype(np.float32)
Q = RNG.standard_normal((NQ, D_)).astype(np.float32)
IDS = np.arange(N, dtype=np.int64) * 5 + 3


def _index(spec, metric):
    ix = tqvec.index_factory(D_, spec, metric, seed=4)
    if not ix.is_trained:
        ix.train(X[:800])
    if hasattr(ix, "nprobe"):
        ix.nprobe = 5
    return ix


def _parts(spec, metric, n_parts):
    bounds = np.linspace(0, N, n_parts + 1).astype(int)
    if n_parts > 2:
        bounds[1] = 0  # an empty part first
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        ix = _index(spec, metric)
        ix.add_with_ids(X[a:b], IDS[a:b])
        out.append(ix)
    return out


def same_results(D, I, D2, I2):
    """Equal up to the order of tied distances (and which tie a boundary keeps)."""
    np.testing.assert_allclose(D2, D, rtol=1e-5, atol=1e-4)
    for i in range(len(I)):
        if not np.array_equal(I[i], I2[i]):  # only tied distances may differ in order, and
            at = dict(zip(I[i], D[i], strict=True))  # only a tie at the k-th in membership
            at2 = dict(zip(I2[i], D2[i], strict=True))
            for j in set(at) ^ set(at2):
                assert np.isclose(at.get(j, at2.get(j)), D[i][-1], rtol=1e-6), (i, j)
            for a, b, d in zip(I[i], I2[i], D[i], strict=True):
                assert a == b or np.isclose(at2.get(a, d), d, rtol=1e-6), (i, a, b)


def two_rounds(parts, q, k, candidates, metric_type, probes=None, allowed=None):
    """The merge that re-ranks after it: the parts' scans merged, then each part re-ranks its
    own rows among the merged best (holes of -1 where another part's rows are)."""
    got = [p.scan_candidates(q, k, rows=N, probes=probes, allowed_ids=allowed) for p in parts]
    part, pos, ids = merge_scans(got, candidates)
    final = np.full(part.shape, -np.inf, np.float32)
    for j, p in enumerate(parts):
        mine = part == j
        final[mine] = p.refine_candidates(q, np.where(mine, pos, -1))[mine]
    return merge_refined(final, ids, k, metric_type)


SPECS = ["TQ4", "TQ2,Refine(Flat)", "TQ1,Refine(TQ8)", "Center,TQ3,Refine(Flat)",
         "IVF12,TQ4", "IVF12,TQ2,Refine(TQ6)", "PCA,TQ2", "PCA,TQ2,Refine(Flat)",
         ]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("n_parts", [1, 2, 3, 7])
def test_merged_parts_equal_one_index(spec, metric, n_parts):
    one = _index(spec, metric)
    one.add_with_ids(X, IDS)
    parts = _parts(spec, metric, n_parts)
    kf = one.k_factor
    refined = (one.index if hasattr(one, "index") else one).refine is not None
    for k in (1, 10, 400):  # 400 > the rows of a 7-part split's part (342)
        D, I = one.search(Q, k)
        # an IVF index's lists probed once for all parts (as a coordinator does), and by each
        probes = [None, one.probe(Q)] if hasattr(one, "probe") else [None]
        for pr in probes:
            got = [p.search_candidates(Q, k, rows=N, probes=pr) for p in parts if p.ntotal]
            D2, I2 = merge_candidates(got, k, min(N, k * kf) if refined else k,
                                      one.metric_type)
            same_results(D, I, D2, I2)
            if refined:
                D3, I3 = two_rounds([p for p in parts if p.ntotal], Q, k, min(N, k * kf),
                                    one.metric_type, pr)
                same_results(D, I, D3, I3)


def test_k_above_a_part_and_the_padded_limit():
    """k may exceed a part's rows (and faiss's padding limit) when the collection holds k."""
    from tqvec import _validate as V
    small = _index("TQ4", "l2")
    small.add_with_ids(X[:5], IDS[:5])
    k = V.MAX_PADDED_K + 10
    s, f, i = small.search_candidates(Q[:2], k, rows=k)
    assert i.shape == (2, 5) and (i >= 0).all()
    with pytest.raises(ValueError, match="k"):
        small.search_candidates(Q[:2], k)


def test_filtered_merge_equals_filtered_search():
    allowed = IDS[::7]
    one = _index("TQ2,Refine(Flat)", "l2")
    one.add_with_ids(X, IDS)
    D, I = one.search(Q, 20, allowed_ids=allowed)
    got = [p.search_candidates(Q, 20, allowed_ids=allowed, rows=N)
           for p in _parts("TQ2,Refine(Flat)", "l2", 3) if p.ntotal]
    D2, I2 = merge_candidates(got, 20, min(N, 20 * one.k_factor), one.metric_type)
    same_results(D, I, D2, I2)
    assert np.isin(I2, allowed).all()
    D3, I3 = two_rounds([p for p in _parts("TQ2,Refine(Flat)", "l2", 3) if p.ntotal], Q, 20,
                        min(N, 20 * one.k_factor), one.metric_type, allowed=allowed)
    same_results(D, I, D3, I3)


def test_refine_candidates_refuses_bad_positions():
    one = _index("TQ2,Refine(TQ8)", "l2")
    one.add_with_ids(X, IDS)
    s, pos, i = one.scan_candidates(Q, 5)
    assert pos.shape == (NQ, 5 * one.k_factor) and (pos >= 0).all()
    np.testing.assert_array_equal(one.refine_candidates(Q, np.full((NQ, 3), -1)),
                                  np.full((NQ, 3), -np.inf, np.float32))
    with pytest.raises(ValueError, match="positions"):
        one.refine_candidates(Q, pos[:2])  # not one row per query
    with pytest.raises(ValueError, match="positions"):
        one.refine_candidates(Q, pos.astype(np.int32))
    with pytest.raises(ValueError, match="positions"):
        one.refine_candidates(Q, pos + N)  # past the rows
    with pytest.raises(ValueError, match="refinement"):
        _index("TQ4", "l2").refine_candidates(Q, pos)
    with pytest.raises(ValueError, match=r"parts\[0\]"):
        merge_scans([(s, pos[:, :2], i)], 3)


def test_more_results_than_rows_pad_as_faiss():
    parts = _parts("TQ4", "l2", 3)
    small = [p for p in parts if p.ntotal][:1]
    D, I = merge_candidates([small[0].search_candidates(Q, 5)], 5, 5, small[0].metric_type)
    assert I.shape == (NQ, 5) and (I >= 0).all()
    e = np.zeros((NQ, 0), np.float32)
    D, I = merge_candidates([(e, e, np.zeros((NQ, 0), np.int64))], 3, 3, 1)
    assert (I == -1).all() and (D == np.finfo(np.float32).max).all()


def test_merge_ranges_equals_one_range_search():
    one = _index("TQ4", "l2")
    one.add_with_ids(X, IDS)
    lims, D, I = one.range_search(Q, 60.0)
    got = [p.range_search(Q, 60.0) for p in _parts("TQ4", "l2", 3)]
    lims2, D2, I2 = merge_ranges(got)
    np.testing.assert_array_equal(lims, lims2)
    for i in range(NQ):
        a, b = lims[i], lims[i + 1]
        assert dict(zip(I[a:b], D[a:b], strict=True)) == pytest.approx(
            dict(zip(I2[a:b], D2[a:b], strict=True)))


def test_merge_refuses_mismatched_parts():
    s = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="parts"):
        merge_candidates([], 1, 1, 1)
    with pytest.raises(ValueError, match=r"parts\[0\]"):
        merge_candidates([(s, s[:1], np.zeros((2, 3), np.int64))], 1, 1, 1)


@settings(max_examples=60)
@given(n=st.integers(0, 60), k=st.integers(1, 12), kf=st.integers(1, 4),
       cuts=st.lists(st.integers(0, 60), max_size=6), seed=st.integers(0, 2**16),
       metric=st.sampled_from([0, 1]))
def test_merge_of_parts_is_the_global_two_stage_choice(n, k, kf, cuts, seed, metric):
    """Rows with distinct scan and refined scores, split anyhow into parts that each keep
    their best min(rows, k_factor k) by scan: the merge picks the collection's best
    min(n, k_factor k) by scan, then the k best of those by the refined score."""
    rng = np.random.default_rng(seed)
    nq = 3
    scan = rng.permutation(nq * n).reshape(nq, n).astype(np.float32)
    final = rng.permutation(nq * n).reshape(nq, n).astype(np.float32)
    ids = np.arange(n, dtype=np.int64) + 100
    kk = min(n, kf * k)
    bounds = sorted({0, n, *[c for c in cuts if c <= n]})
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        m = min(b - a, kk)
        top = np.argsort(-scan[:, a:b], axis=1)[:, :m] + a
        parts.append((np.take_along_axis(scan, top, 1), np.take_along_axis(final, top, 1),
                      ids[top]))
    if not parts:
        e = np.zeros((nq, 0), np.float32)
        parts = [(e, e, np.zeros((nq, 0), np.int64))]
    D, I = merge_candidates(parts, k, kk, metric)
    # the same rows as scan_candidates (positions: the row numbers) merged in two rounds
    part, pos, got = merge_scans([(p[0], p[2] - 100, p[2]) for p in parts], kk)
    D2, I2 = merge_refined(np.where(pos >= 0, np.take_along_axis(final, np.maximum(pos, 0), 1),
                                    -np.inf).astype(np.float32), got, k, metric)
    assert np.array_equal(I, I2) and np.array_equal(D, D2)
    for q in range(nq):
        chosen = np.argsort(-scan[q])[:kk]
        best = chosen[np.argsort(-final[q, chosen])][:k]
        want_d = -final[q, best] if metric == 1 else final[q, best]
        assert I[q, :len(best)].tolist() == ids[best].tolist()
        assert D[q, :len(best)].tolist() == want_d.tolist()
        assert (I[q, len(best):] == -1).all()
