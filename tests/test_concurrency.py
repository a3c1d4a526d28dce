"""The index's concurrency contract (docs/search.md), held by an oracle by replay: searcher
threads search a fixed set of queries while one writer thread adds, removes, resets, changes
``nprobe`` / ``efSearch`` / ``prefilter`` / ``k_factor`` and writes the index to a file. Every
answer a searcher got must equal the answer of one of the states the writer passed through,
computed afterwards by replaying the writer's steps on a fresh index, with no other thread
running; every file written must read back as the state it was written in; no exception.

Bounded by the writer's step count (seeded), not by time: a slow or busy machine runs fewer
searches, never a different check."""

import threading

import numpy as np
import pytest

import tqvec

D = 32
K = 10

# (spec, the parameters the writer changes and the values it draws from)
CASES = [
    ("TQ4,Refine(Flat)", {"k_factor": [1, 2, 4]}),
    ("TQ2,Prefilter(10)", {"prefilter": [0, 4, 10]}),
    ("TQ3", {}),
    ("IVF8,TQ2,Refine(TQ8g)", {"nprobe": [1, 3, 8], "k_factor": [2, 4]}),
    ("PCA,TQ3", {"k_factor": [1, 4]}),
    ("HNSW8,TQ2,Refine(Flat)", {"efSearch": [16, 40, 80]}),
]


def _rows(n, seed):
    rng = np.random.default_rng(seed)
    c = 3 * np.random.default_rng(99).standard_normal((8, D))
    return (c[rng.integers(0, 8, n)] + rng.standard_normal((n, D))).astype(np.float32)


def _steps(params, seed, count=24):
    """The writer's seeded steps: ("add", rows) / ("remove", ids) / ("reset",) / ("set", name,
    value) / ("write",)."""
    rng = np.random.default_rng(seed)
    steps, next_id, live = [], 0, []
    kinds = ["add", "add", "remove", "set", "write", "reset"]
    for i in range(count):
        kind = kinds[int(rng.integers(len(kinds)))] if i else "add"
        if kind == "set" and not params:
            kind = "add"
        if kind == "add":
            n = int(rng.integers(200, 900))
            steps.append(("add", _rows(n, 1000 * seed + i)))
            live += range(next_id, next_id + n)
            next_id += n
        elif kind == "remove" and live:
            gone = rng.choice(live, size=min(len(live), int(rng.integers(1, 300))), replace=False)
            steps.append(("remove", np.sort(gone).astype(np.int64)))
            live = sorted(set(live) - set(gone.tolist()))
        elif kind == "reset":
            steps.append(("reset",))
            live, next_id = [], 0
        elif kind == "set":
            name = sorted(params)[int(rng.integers(len(params)))]
            steps.append(("set", name, params[name][int(rng.integers(len(params[name])))]))
        else:
            steps.append(("write",))
    return steps


def _index(spec):
    index = tqvec.index_factory(D, spec, metric="l2", seed=3)
    if not index.is_trained:
        index.train(_rows(2000, 7))
    return index


def _apply(index, step, path=None):
    if step[0] == "add":
        index.add(step[1])
    elif step[0] == "remove":
        index.remove_ids(step[1])
    elif step[0] == "reset":
        index.reset()
    elif step[0] == "set":
        setattr(index, step[1], step[2])
    elif path is not None:
        tqvec.write_index(index, path)


def _key(out):
    D_, I_ = out
    return I_.tobytes() + D_.tobytes()


@pytest.mark.parametrize("spec,params", CASES, ids=[c[0] for c in CASES])
def test_searches_during_changes_answer_from_a_state_the_index_passed_through(
        spec, params, tmp_path, one_thread_each):
    seed = sum(map(ord, spec))
    steps = _steps(params, seed)
    queries = [_rows(6, 5), _rows(1, 6)]
    index = _index(spec)
    seen: list[list[tuple[int, bytes]]] = [[] for _ in range(3)]
    errors: list[BaseException] = []
    done = threading.Event()

    def searcher(t):
        try:
            while not done.is_set():
                for qi, q in enumerate(queries):
                    seen[t].append((qi, _key(index.search(q, K))))
        except BaseException as e:  # noqa: BLE001 - the contract names none
            errors.append(e)

    files = []
    threads = [threading.Thread(target=searcher, args=(t,)) for t in range(len(seen))]
    for t in threads:
        t.start()
    try:
        for i, step in enumerate(steps):
            path = tmp_path / f"s{i}.tqv"
            _apply(index, step, path)
            if step[0] == "write":
                files.append((i, path))
    finally:
        done.set()
        for t in threads:
            t.join()
    assert not errors, repr(errors[0])
    # the oracle: replay on a fresh index, nothing else running; the answers of every state
    fresh = _index(spec)
    states = [{qi: _key(fresh.search(q, K)) for qi, q in enumerate(queries)}]  # empty
    written = {}
    for i, step in enumerate(steps):
        _apply(fresh, step)
        states.append({qi: _key(fresh.search(q, K)) for qi, q in enumerate(queries)})
        if step[0] == "write":
            written[i] = states[-1]
    allowed = {qi: {s[qi] for s in states} for qi in range(len(queries))}
    got = [a for per in seen for a in per]
    assert got, "no search ran"
    wrong = [qi for qi, answer in got if answer not in allowed[qi]]
    assert not wrong, f"{len(wrong)} of {len(got)} answers match no state of the index"
    for i, path in files:  # a file holds the state it was written in
        back = tqvec.read_index(path)
        for name, _ in params.items():  # parameters are not all stored: the state's values
            value = [s[2] for s in steps[:i] if s[0] == "set" and s[1] == name]
            if value:
                setattr(back, name, value[-1])
        for qi, q in enumerate(queries):
            assert _key(back.search(q, K)) == written[i][qi], (i, qi)
    # the index after the run is the last state
    for qi, q in enumerate(queries):
        assert _key(index.search(q, K)) == states[-1][qi]
    if index.ntotal:
        ids = index.state()[1]["ids"]
        assert len(np.unique(ids)) == len(ids)


def test_the_writer_steps_cover_every_kind():
    kinds = {s[0] for spec, params in CASES for s in _steps(params, sum(map(ord, spec)))}
    assert kinds == {"add", "remove", "reset", "set", "write"}
