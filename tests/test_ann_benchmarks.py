"""bench/ann_benchmarks: the algorithm wrapper keeps ann-benchmarks' interface, and every run
group of config.yml builds."""

import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest

import tqvec

HERE = Path(__file__).resolve().parents[1] / "bench" / "ann_benchmarks"


def _module():
    spec = importlib.util.spec_from_file_location("tqvec_ann_module", HERE / "module.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("metric", ["euclidean", "angular"])
def test_wrapper_follows_base_ann(metric, rng):
    mod = _module()
    x = rng.standard_normal((500, 24)).astype(np.float32)
    algo = mod.TQVec(metric, "TQ4,Refine(Flat)")
    algo.fit(x)
    algo.set_query_arguments(8)
    assert "k_factor=8" in str(algo)
    ids = algo.query(x[3], 5)
    assert ids.dtype == np.int64 and len(ids) == 5 and ids[0] == 3  # exact re-rank finds itself
    algo.batch_query(x[:7], 5)
    res = np.asarray(algo.get_batch_results())
    assert res.shape == (7, 5) and (res[:, 0] == np.arange(7)).all()
    # everything the index holds: at least its codes and ids, and what memory_bytes counts
    assert algo.get_memory_usage() == algo.index.memory_bytes() / 1024
    assert algo.get_memory_usage() >= 500 * (algo.index.code_size + 8) / 1024
    algo.done()
    with pytest.raises(ValueError, match="metric must be one of"):
        mod.TQVec("hamming", "TQ4")
    plain = mod.TQVec(metric, "TQ4")
    plain.fit(x)
    plain.set_query_arguments(10)  # no Refine: the sign-bit prefilter
    assert plain.index.prefilter == 10 and "prefilter=10" in str(plain)
    assert len(plain.query(x[3], 5)) == 5
    with pytest.raises(ValueError, match="query arguments must be"):
        plain.set_query_arguments(4, 10)
    centred = mod.TQVec(metric, "Center,TQ4")
    centred.fit(x)  # trains (the mean) before adding
    assert centred.index.is_trained and len(centred.query(x[3], 5)) == 5
    pca = mod.TQVec(metric, "PCA,TQ2")
    pca.fit(x)  # trains (mean and basis) before adding
    pca.set_query_arguments(0)
    assert pca.index.is_trained and len(pca.query(x[3], 5)) == 5
    pca.set_query_arguments(10)  # the first pass over the leading runs
    assert pca.index.prefilter == 10 and len(pca.query(x[3], 5)) == 5
    graph = mod.TQVec(metric, "HNSW8,TQ2,Refine(Flat)", 64)
    graph.fit(x)
    assert graph.index.ef_construction == 64
    graph.set_query_arguments(40)
    assert graph.index.efSearch == 40 and "efSearch=40" in str(graph)
    assert graph.query(x[3], 5)[0] == 3
    with pytest.raises(ValueError, match="ef_construction"):
        mod.TQVec(metric, "TQ4", 64)


def test_results_hold_no_padding_and_ivf_takes_its_query_arguments(rng):
    """Fewer vectors than asked: faiss pads with -1, which the harness would count as a
    duplicated candidate; query and batch_query return only real ids. IVF specs take
    (nprobe[, k_factor])."""
    mod = _module()
    x = rng.standard_normal((6, 16)).astype(np.float32)
    algo = mod.TQVec("euclidean", "TQ4")
    algo.fit(x)
    assert len(algo.query(x[0], 10)) == 6
    algo.batch_query(x[:3], 10)
    assert [len(r) for r in algo.get_batch_results()] == [6, 6, 6]
    assert all(len(set(r.tolist())) == len(r) and (r >= 0).all() for r in algo.get_batch_results())
    y = rng.standard_normal((600, 16)).astype(np.float32)
    ivf = mod.TQVec("euclidean", "IVF16,TQ2,Refine(Flat)")
    ivf.fit(y)
    ivf.set_query_arguments(4, 3)
    assert ivf.index.nprobe == 4 and ivf.index.k_factor == 3 and "nprobe=4,k_factor=3" in str(ivf)
    assert ivf.get_memory_usage() > 600 * ivf.index.code_size / 1024  # + centroids, lists


def test_knn_is_the_harness_metric():
    """knn counts a result within the true k-th distance plus 1e-3 (absolute, the harness's
    knn_threshold), distances computed as the harness does: here a relative 1e-3 (our old
    rule) would count 100.05 against a k-th distance of 100."""
    spec = importlib.util.spec_from_file_location("tqvec_ann_run", HERE / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    truth = np.array([[1.0, 2.0, 100.0], [0.5, 0.5, 0.5]], np.float32)
    found = [[1.0, 2.0005, 100.05], [0.5, 0.5009, 0.502]]
    assert run.knn_recall(found, truth, 3) == pytest.approx((2 / 3 + 2 / 3) / 2)
    assert run.knn_recall([[1.0], [0.5]], truth, 3) == pytest.approx(1 / 3)  # short results
    a = np.array([3.0, 4.0], np.float32)
    assert run.harness_distance("euclidean", a, np.zeros(2, np.float32)) == 5.0
    assert run.harness_distance("angular", a, a) == pytest.approx(0.0, abs=1e-7)


def test_config_run_groups_build():
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load((HERE / "config.yml").read_text())
    (entry,) = cfg["float"]["any"]
    assert entry["constructor"] == "TQVec" and entry["base_args"] == ["@metric"]
    mod = _module()
    for group in entry["run_groups"].values():
        # the harness builds one instance per combination of the argument lists
        for args in itertools.product(*group["args"]):
            spec = args[0]
            algo = mod.TQVec("euclidean", *args)
            algo.index = tqvec.index_factory(16, spec, "l2")
            for qa in zip(*group.get("query_args", [[]]), strict=False):
                algo.set_query_arguments(*qa)  # the arguments each group sweeps are accepted
    docker = (HERE / "Dockerfile").read_text()
    assert docker.startswith("# ") and "FROM ann-benchmarks" in docker
    assert "tqvec-src.tar.gz" in docker and "pip install tqvec" not in docker
