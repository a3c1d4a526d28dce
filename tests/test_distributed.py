"""tqvec.distributed on a local Ray with 2 CPUs: encoding through Ray Data (same codes as one
process), a sharded index equal to one index (ids, distances, filters, range search, adds and
removals), saved and loaded through its manifest, and shards whose actors die."""

import os
import threading
import time

import numpy as np
import pytest

import tqvec

pytestmark = pytest.mark.ray

N, D_ = 3000, 32
RNG = np.random.default_rng(5)
X = RNG.standard_normal((N, D_)).astype(np.float32)
Q = RNG.standard_normal((25, D_)).astype(np.float32)


@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as m:
        # Ray starts its workers at nice 15: on a busy machine they then wait behind every
        # other process, and an actor restart of a second unloaded took minutes
        m.setenv("RAY_worker_niceness", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        yield ray
        ray.shutdown()


@pytest.fixture(scope="module")
def dist(ray):
    import tqvec.distributed as dist
    return dist


def _restarted(ray, actor, timeout=600.0):
    """Kill an actor and wait until Ray has restarted it (a kill is asynchronous: a call
    made right after may still reach the old process)."""
    old = ray.get(actor.pid.remote())
    ray.kill(actor, no_restart=False)
    end = time.time() + timeout
    while time.time() < end:
        try:
            if ray.get(actor.pid.remote(), timeout=10) != old:
                return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.05)
    raise AssertionError("the actor was not restarted")


def _dead(ray, actor, timeout=600.0):
    """Kill an actor for good and wait until calls to it fail."""
    ray.kill(actor, no_restart=True)
    end = time.time() + timeout
    while time.time() < end:
        try:
            ray.get(actor.pid.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the actor did not die")


def _one(spec, metric, x=X, ids=None):
    ix = tqvec.index_factory(D_, spec, metric, seed=3)
    if not ix.is_trained:
        ix.train(x[:1000])
    ix.add_with_ids(x, np.arange(len(x)) if ids is None else ids)
    return ix


def test_encode_dataset_matches_one_process(dist, ray):
    import pyarrow as pa
    codec = tqvec.TurboQuant(D_, bits=3, seed=9)
    ds = dist.encode_dataset(dist.as_dataset(X, block_rows=500), codec, batch_size=256,
                             concurrency=2)
    table = pa.concat_tables(ray.get(ds.to_arrow_refs()))
    codes = tqvec.codes_from_arrow(table)
    order = np.argsort(table.column("id").to_numpy())
    want = codec.encode(X)
    assert np.array_equal(codes.payload.numpy()[order], want.payload.numpy())
    assert np.array_equal(codes.scalars["norm"].numpy()[order], want.scalars["norm"].numpy())


@pytest.mark.parametrize(("spec", "metric", "shards", "actors"), [
    ("TQ4", "l2", 3, 2), ("TQ2,Refine(Flat)", "ip", 2, None),
    ("IVF8,TQ2,Refine(TQ6)", "cosine", 7, 2), ("PCA,TQ2", "l2", 2, 1)])
def test_sharded_equals_one_index(dist, spec, metric, shards, actors):
    one = _one(spec, metric)
    ix = dist.build_sharded_index(X, spec, metric, num_shards=shards, train_rows=1000,
                                  seed=3, num_actors=actors)
    assert ix.ntotal == N and sum(ix.shard_sizes) == N and ix.exact
    if hasattr(one, "nprobe"):
        one.nprobe = ix.nprobe = 3
    # under a refinement: re-ranked in each shard (1), after the merge (2), chosen by size
    rounds = (1, 2, None) if "Refine" in spec else (None,)
    for r in rounds:
        ix.refine_rounds = r
        for k in (1, 10, 50):
            D, I = one.search(Q, k)
            D2, I2 = ix.search(Q, k)
            assert np.array_equal(I, I2), (r, k)
            np.testing.assert_allclose(D2, D, rtol=1e-5, atol=1e-4)
        allowed = np.arange(0, N, 9)
        D, I = one.search(Q, 10, allowed_ids=allowed)
        D2, I2 = ix.search(Q, 10, allowed_ids=allowed)
        assert np.array_equal(I, I2)
    with pytest.raises(ValueError, match="refine_rounds"):
        ix.refine_rounds = 3
    if spec == "TQ4":
        lims, Dr, Ir = one.range_search(Q[:5], 40.0)
        lims2, Dr2, Ir2 = ix.range_search(Q[:5], 40.0)
        assert np.array_equal(lims, lims2) and set(Ir) == set(Ir2)
        np.testing.assert_allclose(ix.reconstruct(17), one.reconstruct(17), atol=1e-6)
        with pytest.raises(KeyError):
            ix.reconstruct(10**9)


def test_sharded_add_remove_and_errors(dist):
    ix = dist.build_sharded_index(X[:2000], "TQ4", "ip", num_shards=2, seed=3)
    one = _one("TQ4", "ip", X[:2000])
    ix.add(X[2000:])  # ids 2000.. as one index's add
    one.add(X[2000:])
    assert ix.remove_ids(np.arange(0, N, 3)) == one.remove_ids(np.arange(0, N, 3)) == 1000
    D, I = one.search(Q, 10)
    D2, I2 = ix.search(Q, 10)
    assert np.array_equal(I, I2) and ix.ntotal == one.ntotal
    with pytest.raises(ValueError, match="x"):
        ix.search(np.full((2, D_), np.nan, np.float32), 3)
    with pytest.raises(ValueError, match="x"):
        ix.search(Q[:, :5], 3)
    with pytest.raises(ValueError, match="nprobe|k_factor"):
        ix.k_factor = 0
    with pytest.raises(AttributeError, match="nprobe"):
        ix.nprobe = 4  # a flat index has no probes
    with pytest.raises(ValueError, match="id_column"):
        dist.build_sharded_index(dist.as_dataset(X), "TQ4", num_shards=2)


def test_save_load_and_actor_restart(dist, ray, tmp_path):
    ix = dist.build_sharded_index(X, "TQ2,Refine(Flat)", "l2", num_shards=3, seed=3)
    D, I = ix.search(Q, 10)
    _restarted(ray, ix.actors()[0])  # never saved: its rows are gone
    with pytest.raises(dist.ShardError, match="shard 0") as e:
        ix.search(Q, 10)
    assert 0 in e.value.shards
    D3, I3, answered = ix.search(Q, 10, partial=True)
    assert 0 not in answered and 1 in answered
    ix.refine_rounds = 2  # the same from a search that re-ranks after the merge
    with pytest.raises(dist.ShardError, match="shard 0"):
        ix.search(Q, 10)
    D4, I4, answered4 = ix.search(Q, 10, partial=True)
    assert np.array_equal(answered4, answered) and np.array_equal(I4, I3)

    ix = dist.build_sharded_index(X, "TQ2,Refine(Flat)", "l2", num_shards=3, seed=3)
    ix.save(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["manifest.tqm", "shard-00000.tqi",
                                             "shard-00001.tqi", "shard-00002.tqi",
                                             "template.tqi"]
    loaded = dist.ShardedIndex.load(tmp_path, num_actors=2)
    D2, I2 = loaded.search(Q, 10)
    assert np.array_equal(I, I2)
    # an actor killed in the middle of a query is restarted from its file and the query
    # retried: the same results
    big = np.repeat(Q, 400, axis=0)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=loaded.search(big, 10)))
    t.start()
    time.sleep(0.05)
    ray.kill(loaded.actors()[1], no_restart=False)
    t.join()
    assert np.array_equal(out["r"][1], np.repeat(I, 400, axis=0))
    # a change after the save, then a restart: refused, never answered from fewer rows
    sizes = loaded.shard_sizes
    loaded.add_with_ids(X[:5], np.arange(10**6, 10**6 + 5))
    changed = int(np.flatnonzero(np.array(loaded.shard_sizes) != sizes)[0])
    _restarted(ray, loaded.actors()[loaded.shard_actor(changed)])
    with pytest.raises(dist.ShardError, match=f"shard {changed} .*lost 1 change"):
        loaded.search(Q, 10)
    # an actor that cannot come back: ShardError naming its shards
    _dead(ray, loaded.actors()[0])
    with pytest.raises(dist.ShardError, match="died"):
        loaded.search(Q, 10)


def test_load_refuses_damaged_folders(dist, tmp_path):
    ix = dist.build_sharded_index(X[:500], "TQ4", num_shards=2, seed=3)
    ix.save(tmp_path)
    shard = tmp_path / "shard-00001.tqi"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises((tqvec.FormatError, dist.ShardError)):
        dist.ShardedIndex.load(tmp_path)
    (tmp_path / "manifest.tqm").write_bytes(b"not a manifest")
    with pytest.raises(tqvec.FormatError):
        dist.ShardedIndex.load(tmp_path)


def test_load_refuses_a_template_from_another_training(dist, tmp_path):
    """The manifest holds the template's sha256: an IVF template from another k-means (or a
    crash in save after the template's write) is refused, where it gave 20 of 20 wrong
    top-10s with no error."""
    ix = dist.build_sharded_index(X, "IVF16,TQ4", num_shards=2, seed=3)
    ix.save(tmp_path)
    other = tqvec.index_factory(X.shape[1], "IVF16,TQ4", seed=7)
    other.train(X[::-1].copy())
    tqvec.write_index(other, tmp_path / "template.tqi")
    with pytest.raises(tqvec.FormatError, match="template .*sha256 differs"):
        dist.ShardedIndex.load(tmp_path)
    ix.close()


def test_parquet_input_with_list_column(dist, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    ids = np.arange(N, dtype=np.int64) * 7 + 1
    vec = pa.array([row.tolist() for row in X[:1200]], pa.list_(pa.float32()))
    pq.write_table(pa.table({"id": ids[:1200], "vec": vec}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": ids[1200:], "vec": pa.array(
        [row.tolist() for row in X[1200:]], pa.list_(pa.float32()))}), tmp_path / "b.parquet")
    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    with dist.build_sharded_index(paths, "TQ2,Refine(Flat)", "l2", column="vec", id_column="id",
                                  num_shards=3, train_rows=1000, seed=3) as ix:
        one = _one("TQ2,Refine(Flat)", "l2", ids=ids)
        D, I = one.search(Q, 10)
        D2, I2 = ix.search(Q, 10)
        assert np.array_equal(I, I2) and ix.ntotal == N
    with pytest.raises(ValueError, match="column"):
        dist.build_sharded_index(paths, "TQ4", column="nope", id_column="id")


def test_host_answers_pad_empty_and_short_shards(dist):
    """A host's answer is one record array over its shards, padded to one width: an empty
    shard and a shard with fewer rows than k merge into exactly one index's result."""
    from tqvec.distributed.host import ANSWER, SCANNED, ShardHost
    from tqvec.index import merge_candidates, merge_refined, merge_scans
    from tqvec.index.state import index_state

    spec, metric = "IVF8,TQ2,Refine(TQ6)", "l2"
    one = _one(spec, metric)
    template = tqvec.index_factory(D_, spec, metric, seed=3)
    template.train(X[:1000])
    host = ShardHost({s: {"state": index_state(template)} for s in range(3)}, threads=1)
    host.add(1, 0, X[:20], np.arange(20))  # shard 0 stays empty; shard 1 holds 20 rows
    host.add(2, 0, X[20:], np.arange(20, N))
    one.nprobe = 3
    host.set_param("nprobe", 3)
    for k in (1, 10, 50):  # 50 > shard 1's rows
        ans = host.search({0: 0, 1: 1, 2: 1}, (Q, k, None, N, one.probe(Q)))
        assert ans.dtype == ANSWER and ans.shape[:2] == (3, len(Q))
        assert np.all(ans["id"][0] == -1) and np.all(np.isneginf(ans["final"][0]))
        parts = [(a["scan"], a["final"], a["id"]) for a in ans]
        D2, I2 = merge_candidates(parts, k, min(N, k * one.k_factor), one.metric_type)
        D, I = one.search(Q, k)
        assert np.array_equal(I, I2)
        np.testing.assert_allclose(D2, D, rtol=1e-5, atol=1e-4)
        # the same in two rounds: the scans (padded alike), then each shard's own rows
        sc = host.scan({0: 0, 1: 1, 2: 1}, (Q, k, None, N, one.probe(Q)))
        assert sc.dtype == SCANNED and np.all(sc["pos"][0] == -1)
        part, pos, ids = merge_scans([(a["scan"], a["pos"], a["id"]) for a in sc],
                                     min(N, k * one.k_factor))
        asked = np.stack([np.where(part == j, pos, -1) for j in range(3)])
        got = host.refine({0: 0, 1: 1, 2: 1}, (Q,), asked)
        final = np.max(np.where(asked >= 0, got, -np.inf), axis=0).astype(np.float32)
        D3, I3 = merge_refined(final, ids, k, one.metric_type)
        assert np.array_equal(I, I3)
        np.testing.assert_allclose(D3, D, rtol=1e-5, atol=1e-4)
