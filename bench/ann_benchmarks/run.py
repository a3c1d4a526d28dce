"""Run bench/ann_benchmarks/module.py the way ann-benchmarks does, without Docker.

    python bench/ann_benchmarks/run.py                          # digits (shipped with scikit-learn)
    python bench/ann_benchmarks/run.py --dataset fashion-mnist-784-euclidean --groups tq2 tq4
    python bench/ann_benchmarks/run.py --dataset /path/to/glove-100-angular.hdf5

For every run group of config.yml (its args x query_args), in one process: build (fit) time,
index size (get_memory_usage, kB), batch QPS (batch_query over all test queries), single-query QPS
(query() one at a time over --single queries), and ann-benchmarks' metrics: ``knn`` (recall@k
counting a result as correct when its true distance is within the k-th true distance times
1 + 1e-3, as ann-benchmarks' `knn` metric) and ``recall`` (|I ∩ true top-k| / k). Threads: torch's
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


def run_groups(names: list[str] | None) -> list[tuple[str, list, list]]:
    import yaml

    with open(os.path.join(HERE, "config.yml")) as f:
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


def true_distances(train: np.ndarray, q: np.ndarray, ids: np.ndarray, metric: str) -> np.ndarray:
    """Exact distances of the returned ids (-1: +inf), in ann-benchmarks' convention."""
    x = train[np.clip(ids, 0, None)]
    if metric == "euclidean":
        d = np.sqrt(((x - q[:, None, :]) ** 2).sum(-1))
    elif metric == "angular":
        qn = q / np.linalg.norm(q, axis=1, keepdims=True)
        xn = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-30)
        d = 1 - (xn * qn[:, None, :]).sum(-1)
    else:
        d = -(x * q[:, None, :]).sum(-1)
    return np.where(ids >= 0, d, np.inf)


def evaluate(I: np.ndarray, data: dict, k: int) -> dict:
    gt = data["neighbors"][:, :k]
    recall = float(np.mean([len(set(a[a >= 0]) & set(b)) / k for a, b in zip(I, gt,
                                                                              strict=True)]))
    dist = true_distances(data["train"], data["test"], I, data["distance"])
    kth = data["distances"][:, k - 1][:, None]
    knn = float(np.mean((dist <= kth * (1 + 1e-3) + 1e-6).sum(1) / k))
    return {"knn": knn, "recall": recall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--groups", nargs="*")
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
    for group, arg_sets, qarg_sets in run_groups(a.groups):
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
                I = np.asarray(algo.get_batch_results())
                m = evaluate(I, data, a.k)
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
    with open(os.path.join(RESULTS, f"ann_{name}.json"), "w") as f:
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
    with open(os.path.join(RESULTS, f"ann_{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
