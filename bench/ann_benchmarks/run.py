"""Run bench/ann_benchmarks/module.py the way ann-benchmarks does, without Docker.

    python bench/ann_benchmarks/run.py                          # digits (shipped with scikit-learn)
    python bench/ann_benchmarks/run.py --dataset fashion-mnist-784-euclidean --groups tq2 tq4
    python bench/ann_benchmarks/run.py --dataset /path/to/glove-100-angular.hdf5

For every run group of config.yml (its args x query_args), in one process: build (fit) time,
index size (get_memory_usage, kB), batch QPS (batch_query over all test queries), single-query QPS
(query() one at a time over --single queries), and ann-benchmarks' metrics: ``knn`` exactly as
the harness computes it (a result counts when its distance, computed as the harness does, is
within the true k-th distance plus 1e-3) and ``recall`` (|I ∩ true top-k| / k). Threads: torch's
default (set OMP_NUM_THREADS / --threads to pin). Writes bench/results/ann_<dataset>.json and .md.
The default dataset is scikit-learn's digits (1,797 x 64, euclidean) written as an ann-benchmarks
HDF5 file in the data cache on first use: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
RESULTS = os.path.join(os.path.dirname(HERE), "results")


def load_module():
    spec = importlib.util.spec_from_file_location("tqvec_ann_module", os.path.join(HERE,
                                                                                  "module.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_groups(names: list[str] | None, config: str = os.path.join(HERE, "config.yml")
               ) -> list[tuple[str, list, list]]:
    import yaml

    with open(config) as f:
        cfg = yaml.safe_load(f)
    (entry,) = cfg["float"]["any"]
    out = []
    for name, g in entry["run_groups"].items():
        if names and name not in names:
            continue
        args = [list(a) for a in itertools.product(*g["args"])]
        qargs = [list(q) for q in itertools.product(*g.get("query_args", [[]]))] or [[]]
        out.append((name, args, qargs))
    return out


def dataset(name: str) -> tuple[str, dict]:
    from tqvec import datasets

    if name == "digits":
        path = os.path.join(datasets.data_dir(), "digits-64-euclidean.hdf5")
        if not os.path.exists(path):
            x = datasets.load_embedded("digits")
            base, queries = datasets.split_queries(x, 200)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            datasets.write_hdf5(path, base, queries, "euclidean")
        return "digits-64-euclidean", datasets.read_hdf5(path)
    data = datasets.load_ann(name)
    return os.path.splitext(os.path.basename(name))[0], data


def harness_distance(metric: str, a: np.ndarray, b: np.ndarray) -> float:
    """A result's distance as ann-benchmarks computes it (ann_benchmarks/distance.py): the
    Euclidean norm of a - b, or 1 - the cosine, in the vectors' own float32."""
    if metric == "euclidean":
        return float(np.sum((a - b) ** 2) ** 0.5)
    if metric == "angular":
        return float(1 - np.dot(a, b) / (np.sum(a ** 2) ** 0.5 * np.sum(b ** 2) ** 0.5))
    raise ValueError(f"metric must be 'euclidean' or 'angular', got {metric!r}")


def knn_recall(run_distances: list[list[float]], dataset_distances: np.ndarray, count: int,
               epsilon: float = 1e-3) -> float:
    """ann-benchmarks' ``knn`` metric: a query's first ``count`` results that lie within its
    true count-th distance plus ``epsilon`` (absolute, as the harness's knn_threshold), over
    count, averaged over the queries."""
    hits = [sum(d <= float(dataset_distances[i][count - 1]) + epsilon for d in run[:count])
            for i, run in enumerate(run_distances)]
    return float(np.mean(hits)) / count


def evaluate(results: list[np.ndarray], data: dict, k: int) -> dict:
    """knn as the harness computes it, and recall = |results & true top k| / k."""
    gt = data["neighbors"][:, :k]
    train, test, metric = data["train"], data["test"], data["distance"]
    recall = float(np.mean([len(set(r.tolist()) & set(g.tolist())) / k
                            for r, g in zip(results, gt, strict=True)]))
    dists = [[harness_distance(metric, q, train[j]) for j in r] for q, r in zip(test, results,
                                                                               strict=True)]
    return {"knn": knn_recall(dists, data["distances"], k), "recall": recall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--groups", nargs="*")
    ap.add_argument("--config", default=os.path.join(HERE, "config.yml"),
                    help="the algorithm definition's config.yml (run groups)")
    ap.add_argument("--nq", type=int, default=None, help="the first nq test queries only")
    ap.add_argument("--out", default=None, help="result name (default: ann_<dataset>)")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--single", type=int, default=200, help="queries timed one at a time")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    mod = load_module()
    name, data = dataset(a.dataset)
    metric = data["distance"]
    train, test = data["train"], data["test"]
    rows = []
    if a.nq:
        data = dict(data, test=data["test"][:a.nq], neighbors=data["neighbors"][:a.nq],
                    distances=data["distances"][:a.nq])
        train, test = data["train"], data["test"]
    for group, arg_sets, qarg_sets in run_groups(a.groups, a.config):
        for args in arg_sets:
            algo = mod.TQVec(metric, *args)
            t0 = time.perf_counter()
            algo.fit(train)
            build = time.perf_counter() - t0
            for qa in qarg_sets:
                algo.set_query_arguments(*qa)
                t0 = time.perf_counter()
                algo.batch_query(test, a.k)
                batch = time.perf_counter() - t0
                m = evaluate(algo.get_batch_results(), data, a.k)
                ns = min(a.single, len(test))
                t0 = time.perf_counter()
                for q in test[:ns]:
                    algo.query(q, a.k)
                single = time.perf_counter() - t0
                rows.append({"group": group, "algorithm": str(algo), "build_s": build,
                             "index_kB": algo.get_memory_usage(),
                             "bytes_per_vector": algo.index.code_size,
                             "batch_qps": len(test) / batch, "single_qps": ns / single, **m})
                print(json.dumps(rows[-1]), flush=True)
            algo.done()
    import torch
    from _machine import machine_info
    res = {"dataset": name, "n": int(len(train)), "nq": int(len(test)), "k": a.k,
           "metric": metric, "threads": torch.get_num_threads(), "machine": machine_info(),
           "rows": rows}
    os.makedirs(RESULTS, exist_ok=True)
    stem = a.out or f"ann_{name}"
    with open(os.path.join(RESULTS, f"{stem}.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# ann-benchmarks-style run: {name} ({len(train):,} x {train.shape[1]}, {metric}, "
             f"{len(test)} queries, k = {a.k}, {res['threads']} threads)", "",
             "| algorithm | bytes/vector | build s | knn | recall | batch QPS | single QPS |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['algorithm']} | {r['bytes_per_vector']} | {r['build_s']:.3f} | "
                     f"{r['knn']:.3f} | {r['recall']:.3f} | {r['batch_qps']:,.0f} | "
                     f"{r['single_qps']:,.0f} |")
    lines += ["", f"Reproduce: `python bench/ann_benchmarks/run.py --dataset {a.dataset}`."]
    with open(os.path.join(RESULTS, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
