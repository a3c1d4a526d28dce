"""A sharded index on a simulated multi-node cluster (``ray.cluster_utils.Cluster``: three
raylets on this machine): the shards' actors spread over the nodes, and the results equal one
index's, before and after save/load."""

import numpy as np
import pytest

import tqvec

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_shards_spread_over_nodes_and_merge_exactly(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster
    monkeypatch.setenv("RAY_worker_niceness", "0")  # as tests/test_distributed.py says
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        import tqvec.distributed as dist
        rng = np.random.default_rng(8)
        x = rng.standard_normal((3000, 32)).astype(np.float32)
        q = rng.standard_normal((20, 32)).astype(np.float32)
        ix = dist.build_sharded_index(x, "IVF8,TQ2,Refine(Flat)", "ip", num_shards=3,
                                      train_rows=1000, seed=2)
        nodes = {ray.get(a.__ray_call__.remote(lambda self: ray.get_runtime_context()
                                                .get_node_id())) for a in ix.actors()}
        assert len(nodes) == 3  # one actor per node
        one = tqvec.index_factory(32, "IVF8,TQ2,Refine(Flat)", "ip", seed=2)
        one.train(x[:1000])
        one.add(x)
        one.nprobe = ix.nprobe = 3
        D, I = one.search(q, 10)
        D2, I2 = ix.search(q, 10)
        assert np.array_equal(I, I2)
        ix.save(tmp_path)
        loaded = dist.ShardedIndex.load(tmp_path)
        assert np.array_equal(loaded.search(q, 10)[1], I)
    finally:
        ray.shutdown()
        cluster.shutdown()
