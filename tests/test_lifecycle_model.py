"""Random sequences of add / add_with_ids / remove_ids / reset / train / write+read / search over
every index kind, checked after each step against a model of the same sequence: a dict of the
live rows by id. The index must hold exactly the model's ids (``ntotal``, ``next_id``, the ids
it stores), answer searches and reconstructions exactly as a fresh index given the model's rows
in one ``add_with_ids``, and read back from its file as itself. (The codes are data-oblivious:
a row's code does not depend on the other rows, so the fresh index is the brute-force answer.)
A graph is built in the order rows came, so for it the answers are checked for their ids."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tqvec

D = 16
K = 3
KINDS = ["TQ4", "TQ2,Prefilter(4)", "TQ3,Refine(Flat)", "TQprod3", "Center,TQ2f",
         "IVF4,TQ2,Refine(TQ8g)", "PCA,TQ3", "HNSW8,TQ2"]


def _rows(n, seed):
    rng = np.random.default_rng(seed)
    c = 3 * np.random.default_rng(7).standard_normal((4, D))
    return (c[rng.integers(0, 4, n)] + rng.standard_normal((n, D))).astype(np.float32)


_STEP = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 260), st.integers(0, 10**6)),
    st.tuples(st.just("add_with_ids"), st.integers(1, 120), st.integers(0, 10**6)),
    st.tuples(st.just("remove"), st.floats(0.0, 1.0), st.integers(0, 10**6)),
    st.tuples(st.just("reset"), st.just(0), st.just(0)),
    st.tuples(st.just("train"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("write"), st.booleans(), st.just(0)),
    st.tuples(st.just("search"), st.integers(1, 6), st.integers(0, 10**6)),
)


pytestmark = pytest.mark.usefixtures("one_thread_each")


def _index(spec, train_seed):
    index = tqvec.index_factory(D, spec, metric="l2", seed=3)
    if not index.is_trained:
        index.train(_rows(400, 100 + train_seed))
    return index


def _ids(index):
    return index.state()[1]["ids"] if index.ntotal else np.zeros(0, np.int64)


def _check(index, model, next_id, spec, train_seed, q):
    assert index.ntotal == len(model)
    assert index.next_id == next_id
    np.testing.assert_array_equal(_ids(index), np.fromiter(model, np.int64, len(model)))
    Dg, Ig = index.search(q, K)
    if spec.startswith("HNSW"):  # the graph depends on the order of adds: its ids only
        live = set(model)
        for row in Ig:
            got = [int(i) for i in row if i >= 0]
            assert set(got) <= live and len(set(got)) == len(got)
            assert len(got) == min(K, len(model))
        return
    fresh = _index(spec, train_seed)
    if model:
        fresh.add_with_ids(np.stack(list(model.values())), np.fromiter(model, np.int64))
    Df, If = fresh.search(q, K)
    np.testing.assert_array_equal(Ig, If)
    np.testing.assert_array_equal(Dg, Df)
    if model:
        key = next(iter(model))
        np.testing.assert_array_equal(index.reconstruct(key), fresh.reconstruct(key))


@pytest.mark.parametrize("spec", KINDS)
@settings(max_examples=20)
@given(steps=st.lists(_STEP, min_size=1, max_size=7))
def test_lifecycle_matches_the_model(spec, steps, tmp_path_factory):
    train_seed = 0
    index = _index(spec, train_seed)
    model: dict[int, np.ndarray] = {}
    next_id = 0
    q = _rows(4, 999)
    for kind, a, b in steps:
        if kind == "add":
            x = _rows(a, b)
            index.add(x)
            model.update(zip(range(next_id, next_id + a), x, strict=True))
            next_id += a
        elif kind == "add_with_ids":
            ids = np.arange(a, dtype=np.int64) * 3 + next_id + 5  # past every id so far
            x = _rows(a, b)
            index.add_with_ids(x, ids)
            model.update(zip(ids.tolist(), x, strict=True))
            next_id = int(ids.max()) + 1
        elif kind == "remove":
            rng = np.random.default_rng(b)
            live = np.fromiter(model, np.int64, len(model))
            gone = live[rng.random(len(live)) < a]
            extra = np.array([next_id + 10**6], np.int64)  # an absent id counts nothing
            assert index.remove_ids(np.concatenate([gone, extra])) == len(gone)
            for i in gone.tolist():
                del model[i]
        elif kind == "reset":
            index.reset()
            model, next_id = {}, 0
        elif kind == "train":
            if index.ntotal:
                continue  # an index trains only while empty (faiss's rule)
            index.train(_rows(400, 100 + a))
            train_seed = a
        elif kind == "write":
            path = tmp_path_factory.mktemp("w") / "i.tqv"
            tqvec.write_index(index, path)
            back = tqvec.read_index(path, mmap=a)
            np.testing.assert_array_equal(back.search(q, K)[1], index.search(q, K)[1])
            index = back  # go on with what was read
        else:
            q = _rows(a, b)
        _check(index, model, next_id, spec, train_seed, q)
