"""Where one `PCA,TQ{b},Prefilter(P)` query's time goes, next to PQ fast-scan, in one process.

    python bench/pca_query_time.py [--dataset fashion-mnist-784-euclidean] [--bits 2] [--nq 200]

One thread, one query per call (the single-query regime), best of --reps passes over the same
--nq queries, for each part of the query on its own:

* ``search``: the whole ``index.search(x[i:i+1], 10)``;
* ``query map``: x W (the basis and every run's rotation in one (d, m) float32 matrix) right
  after a scan, as a search meets it (read from memory again), and the same product hot;
* ``first pass k1=k``: ``ops.FastScan.search`` with a shortlist of k rows - the pass over the
  leading runs, its selection and a re-score of k rows; ``k1=P*k``: what a search runs;
* the same pass over the first run only (with recall@10 of the search that would use it);
* faiss ``PQ{M}x4fs`` at the same bytes (the comparison), single-query.

Writes bench/results/pca_query_time_tq{bits}[_p{P}].{json,md} (_p{P} where --prefilter is not
10). The floor: a pass reads every row's leading-run bytes (n x their bytes), the query map
d x m x 4 bytes; at ~4-6 GB/s on one thread here those bound the single-query time, as PQ
fast-scan's n x M/2 bytes bound its.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _per_query_us(fn, nq: int, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(nq):
            fn(i)
        best = min(best, (time.perf_counter() - t) / nq)
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="fashion-mnist-784-euclidean")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--prefilter", type=int, default=10)
    ap.add_argument("--nq", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()

    import faiss
    import torch
    from _machine import machine_info

    import tqvec
    from tqvec._machine import cpu_label
    from tqvec.benchmark import recall
    from tqvec.datasets import load_ann

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    data = load_ann(args.dataset)
    xb = np.ascontiguousarray(data["train"], dtype=np.float32)
    xq = np.ascontiguousarray(data["test"], dtype=np.float32)
    gt = data["neighbors"]
    metric = {"euclidean": "l2", "angular": "cosine"}.get(data["distance"], "ip")
    n, d = xb.shape
    k, nq = 10, min(args.nq, len(xq))
    spec = f"PCA,TQ{args.bits},Prefilter({args.prefilter})"
    index = tqvec.index_factory(d, spec, metric)
    index.train(xb)
    index.add(xb)
    inner = index.index
    W, slices, mu = index._fused_query_map()
    with inner._lock:
        scanner = inner._scan_state().scanner
    first = scanner.first
    terms = []
    for i in range(nq):
        q = torch.from_numpy(xq[i: i + 1])
        t = tqvec.ops.row_project(q - mu if metric == "l2" else q, W)  # the search's query map
        terms.append([t[:, s].contiguous() for s in slices])
    one = lambda i: index.search(xq[i: i + 1], k)  # noqa: E731
    row: dict = {"dataset": args.dataset, "spec": spec, "n": n, "d": d, "runs": index.groups,
                 "first_pass_runs": first, "W_shape": list(W.shape),
                 "W_bytes": int(W.numel() * 4)}
    row["search_us"] = _per_query_us(one, nq, args.reps)
    row["query_map_after_scan_us"] = _per_query_us(
        lambda i: (scanner.search(terms[i], k, None, k1=args.prefilter * k),
                   tqvec.ops.row_project(torch.from_numpy(xq[i: i + 1]), W)), nq, args.reps)
    row["scan_k1_Pk_us"] = _per_query_us(
        lambda i: scanner.search(terms[i], k, None, k1=args.prefilter * k), nq, args.reps)
    row["query_map_after_scan_us"] -= row["scan_k1_Pk_us"]
    row["query_map_hot_us"] = _per_query_us(
        lambda i: tqvec.ops.row_project(torch.from_numpy(xq[i: i + 1]), W), nq, args.reps)
    row["scan_k1_k_us"] = _per_query_us(lambda i: scanner.search(terms[i], k, None, k1=k), nq,
                                        args.reps)
    row["rescore_us_per_row"] = ((row["scan_k1_Pk_us"] - row["scan_k1_k_us"])
                                 / ((args.prefilter - 1) * k))
    _, ids = index.search(xq, k)
    row["recall_at_10"] = recall(ids, gt, k)
    if first > 1:  # the first run alone: what it saves and what it costs in recall
        inner.codec.first_pass_terms = lambda: 1
        with inner._lock:
            inner._invalidate()
            one_run = inner._scan_state().scanner
        row["scan_first_run_only_k1_k_us"] = _per_query_us(
            lambda i: one_run.search(terms[i], k, None, k1=k), nq, args.reps)
        _, ids = index.search(xq, k)
        row["recall_at_10_first_run_only"] = recall(ids, gt, k)
        del inner.codec.first_pass_terms
        with inner._lock:
            inner._invalidate()
    m = args.bits * d // 4
    pq = None
    if (args.bits * d) % 4 == 0 and d % m == 0:
        pq = faiss.index_factory(d, f"PQ{m}x4fs",
                                 faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT)
        sample = xb[np.random.default_rng(0).permutation(n)[:20000]]
        pq.train(sample if metric == "l2" else sample / np.linalg.norm(sample, axis=1)[:, None])
        pq.add(xb if metric == "l2" else xb / np.linalg.norm(xb, axis=1)[:, None])
        xqn = xq if metric == "l2" else xq / np.linalg.norm(xq, axis=1)[:, None]
        row["faiss"] = f"PQ{m}x4fs"
        row["faiss_search_us"] = _per_query_us(lambda i: pq.search(xqn[i: i + 1], k), nq,
                                               args.reps)
        row["faiss_recall_at_10"] = recall(pq.search(xqn, k)[1], gt, k)
    out = {"machine": machine_info(), "command": " ".join(["python bench/pca_query_time.py"]
                                                          + sys.argv[1:]), "result": row}
    os.makedirs(args.out, exist_ok=True)
    stem = f"pca_query_time_tq{args.bits}" + (f"_p{args.prefilter}" if args.prefilter != 10
                                              else "")
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = [f"# One `{spec}` query on {args.dataset}, one thread", "",
             f"Command: `{out['command']}`. Machine: {cpu_label(out['machine'])}. Best of "
             f"{args.reps} passes over {nq} queries, µs per query.", "",
             "| part | µs per query |", "|---|---|"]
    for key, label in [("search_us", "whole search"),
                       ("scan_k1_k_us", f"first pass ({first} runs) + select + re-score k rows"),
                       ("scan_k1_Pk_us", "the same with P·k rows re-scored (what search runs)"),
                       ("rescore_us_per_row", "re-score, per extra row"),
                       ("query_map_after_scan_us", f"query map x·W after a scan "
                                                   f"({row['W_bytes'] / 2**20:.1f} MB)"),
                       ("query_map_hot_us", "query map x·W, hot"),
                       ("scan_first_run_only_k1_k_us", "first pass over the first run only"),
                       ("faiss_search_us", f"faiss {row.get('faiss', '')} whole search")]:
        if key in row:
            lines.append(f"| {label} | {row[key]:,.1f} |")
    lines += ["", f"recall@10: {row['recall_at_10']:.3f}"
              + (f"; first run only: {row['recall_at_10_first_run_only']:.3f}"
                 if "recall_at_10_first_run_only" in row else "")
              + (f"; faiss {row['faiss']}: {row['faiss_recall_at_10']:.3f}" if pq else "")]
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
