"""An index's lifecycle: reset, adds from several threads, parameters changed while searches
run, and search snapshots that later changes leave as they were. Each test here failed before
the fix it holds (the layout kept across a reset, ids read outside the lock, a setter that
dropped the snapshot without it, a layout changed in place under older snapshots)."""

import threading

import numpy as np
import pytest

import tqvec
from tqvec import ops

# every index kind, at settings that take each scan route on small data
SPECS = ["TQ4", "TQ2", "TQ1", "TQ4,Refine(Flat)", "TQ2,Prefilter(10)", "TQ3,Refine(TQ8g)",
         "TQprod3", "QJL64", "Polar", "Center,TQ2f", "PCA,TQ3", "PCA,TQ2,Prefilter(4)",
         "IVF8,TQ2", "IVF8,TQ1,Refine(TQ8g)", "HNSW8,TQ2", "HNSW8,TQ2,Refine(Flat)"]


def _rows(n, d=32, seed=0):
    rng = np.random.default_rng(seed)
    c = 3 * rng.standard_normal((8, d))
    return (c[rng.integers(0, 8, n)] + rng.standard_normal((n, d))).astype(np.float32)


def _fresh(spec, train, metric="l2"):
    index = tqvec.index_factory(train.shape[1], spec, metric=metric, seed=3)
    if not index.is_trained:
        index.train(train)
    return index


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("second", [3000, 700])
def test_reset_then_add_is_a_fresh_index(spec, second, tmp_path):
    """add(A); search; reset(); add(B) answers as an index that only ever held B: searches,
    reconstructions and the file (a smaller second batch included)."""
    a, b, q = _rows(3000, seed=1), _rows(second, seed=2), _rows(20, seed=3)
    index = _fresh(spec, a)
    index.add(a)
    index.search(q, 10)
    index.search(q[:1], 10)
    index.reset()
    assert index.ntotal == 0 and index.next_id == 0
    index.add(b)
    fresh = _fresh(spec, a)
    fresh.add(b)
    for part in (q, q[:1]):
        D, I = index.search(part, 10)
        Df, If = fresh.search(part, 10)
        np.testing.assert_array_equal(I, If)
        np.testing.assert_array_equal(D, Df)
    np.testing.assert_array_equal(index.reconstruct(0), fresh.reconstruct(0))
    tqvec.write_index(index, tmp_path / "a.tqv")
    tqvec.write_index(fresh, tmp_path / "b.tqv")
    assert (tmp_path / "a.tqv").read_bytes() == (tmp_path / "b.tqv").read_bytes()


@pytest.mark.parametrize("spec", ["TQ4", "IVF8,TQ2", "HNSW8,TQ2"])
def test_adds_from_threads_get_distinct_ids(spec):
    """Ids are reserved with the append, under the lock: threads adding at once never share
    one, and removing an id removes one row."""
    rows = [_rows(1500, seed=10 + t) for t in range(4)]
    index = _fresh(spec, rows[0])
    start = threading.Barrier(len(rows))

    def add(x):
        start.wait()
        index.add(x)

    threads = [threading.Thread(target=add, args=(x,)) for x in rows]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert index.ntotal == 6000
    np.testing.assert_array_equal(np.sort(index.state()[1]["ids"]), np.arange(6000))
    assert index.remove_ids(np.array([0])) == 1
    assert index.ntotal == 5999


def test_nprobe_set_while_a_snapshot_is_made_is_not_lost():
    """A setter that runs while a search builds its snapshot waits for it, so the snapshot
    stored is never an older value's (it was dropped without the lock before)."""
    x, q = _rows(3000), _rows(20, seed=5)
    index = _fresh("IVF16,TQ2", x)
    index.add(x)
    index.nprobe = 1
    built = type(index)._snapshot
    setter = []

    def slow_snapshot(self):
        snap = built(self)
        if not setter:  # another thread changes nprobe while this one builds
            t = threading.Thread(target=setattr, args=(index, "nprobe", 16))
            setter.append(t)
            t.start()
            t.join(0.2)  # (blocks on the lock once fixed: the search goes on)
        return snap

    index._snapshot = slow_snapshot.__get__(index)
    index.search(q, 10)
    setter[0].join()
    del index._snapshot
    assert index.nprobe == 16
    ref = _fresh("IVF16,TQ2", x)
    ref.add(x)
    ref.nprobe = 16
    np.testing.assert_array_equal(index.search(q, 10)[1], ref.search(q, 10)[1])


@pytest.mark.skipif(not ops.has_cpu_kernels(), reason="compiled kernels not built")
@pytest.mark.parametrize("change", ["prefilter", "add", "remove", "reset"])
def test_a_snapshot_keeps_its_layout(change):
    """A search that took its snapshot before a change answers from the rows it started with:
    later layouts never change the one it reads (a prefilter change replaced the blocked codes
    in place before, and the composed path read the live prefilter)."""
    x, q = _rows(4000), _rows(30, seed=5)
    index = tqvec.index_factory(32, "TQ2,Prefilter(10)", seed=3)
    index.add(x)
    before = index.search(q, 10)
    snap = index._current()  # what a search in flight holds
    if change == "prefilter":
        index.prefilter = 0
    elif change == "add":
        index.add(_rows(100, seed=9))
    elif change == "remove":
        index.remove_ids(np.arange(0, 4000, 2))
    else:
        index.reset()
        index.add(_rows(3000, seed=9))
    index.search(q, 10)  # the new state's layout is built
    qp, off = index._queries(q)
    D, I = index._search_queries(qp, off, snap, 10, None)
    np.testing.assert_array_equal(I, before[1])
    np.testing.assert_array_equal(D, before[0])
    got = index.reconstruct_n(0, 5) if index.ntotal else None
    if change == "prefilter":
        np.testing.assert_array_equal(got, tqvec.index_factory(32, "TQ2", seed=3).codec.decode(
            index.codec.encode(x[:5]), like=x))


@pytest.mark.parametrize("metric", ["l2", "cosine", "ip"])
@pytest.mark.parametrize("spec", ["TQ4", "TQ2,Refine(Flat)", "IVF8,TQ2", "HNSW8,TQ2", "PCA,TQ3"])
def test_a_finite_query_whose_norm_overflows_is_refused_as_add_refuses_it(spec, metric):
    """Values of ~2e19 are finite but their squared norm is not: add refuses such rows, and a
    search now does too (it returned all -1 silently)."""
    x = _rows(500)
    index = _fresh(spec, x, metric)
    index.add(x)
    big = np.full((2, 32), 2e19, np.float32)
    with pytest.raises(ValueError, match="norm fits in float32"):
        index.add(big)
    for q in (big, big.astype(np.float64), big[:, ::1].copy(order="F")):
        with pytest.raises(ValueError, match="norm fits in float32"):
            index.search(q, 5)
    ok = np.full((2, 32), 1e17, np.float32)  # large, but within float32
    assert (index.search(ok, 5)[1] >= 0).all()


def test_user_probes_are_checked():
    """An IVF search given probes (a coordinator's ``probe``) refuses lists out of range,
    repeated lists, wrong dtypes and shapes (one route skipped list numbers past nlist, the
    other wrapped -2 to another list)."""
    x, q = _rows(2000), _rows(3, seed=4)
    index = _fresh("IVF8,TQ2,Refine(Flat)", x)
    index.add(x)
    index.nprobe = 3
    lists, off = index.probe(q)
    want = index.search_candidates(q, 5, probes=(lists, off))
    np.testing.assert_array_equal(want[2], index.search_candidates(q, 5)[2])
    bad = [((lists + 8, off), "0..7"), ((np.where(lists == lists[0, 0], -2, lists), off), "0..7"),
           ((lists.astype(np.int32), off), "int64"), ((lists[:2], off[:2]), r"\(3, P\)"),
           ((lists, off.astype(np.float64)), "float32"),
           ((np.repeat(lists[:, :1], 3, axis=1), off), "at most once"),
           ((lists, np.full_like(off, np.nan)), "finite"), (lists, "pair")]
    for probes, msg in bad:
        for call in (index.search_candidates, index.scan_candidates):
            with pytest.raises(ValueError, match=msg):
                call(q, 5, probes=probes)
