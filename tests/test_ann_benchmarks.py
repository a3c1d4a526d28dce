"""bench/ann_benchmarks: the algorithm wrapper keeps ann-benchmarks' interface, and every run
group of config.yml builds."""

import importlib.util
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
    assert algo.get_memory_usage() == pytest.approx(500 * algo.index.code_size / 1024)
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


def test_config_run_groups_build():
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load((HERE / "config.yml").read_text())
    (entry,) = cfg["float"]["any"]
    assert entry["constructor"] == "TQVec" and entry["base_args"] == ["@metric"]
    for group in entry["run_groups"].values():
        for (spec,) in [tuple(a) for a in zip(*group["args"], strict=True)]:
            tqvec.index_factory(16, spec, "l2")
    assert (HERE / "Dockerfile").read_text().startswith("# ") and \
        "FROM ann-benchmarks" in (HERE / "Dockerfile").read_text()
