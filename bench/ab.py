"""A/B of two tqvec installs on the same searches: single-query latency and batch throughput of
every index kind, the two versions run in alternating worker processes (A B A B ...), so that
drift of the machine hits both alike; medians over rounds, the ratio B / A per row.

    python bench/ab.py --a /path/to/venv-a/bin/python --b /path/to/venv-b/bin/python \\
        [--dataset fashion-mnist-784-euclidean minilm-384-angular] [--rounds 4] [--out NAME]

Each worker builds every index of ``SPECS`` (build time not measured), then times ``--single``
one-query searches (median microseconds per query) and one batch of ``--nq`` queries (best of
three, queries per second), k = 10. Results: bench/results/<out>.{json,md} with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SPECS = [("TQ1", {}), ("TQ2", {}), ("TQ4", {}), ("TQ2,Prefilter(10)", {}),
         ("Center,TQ2f,Prefilter(10)", {}), ("TQ1,Refine(TQ8g)", {}), ("TQ2,Refine(Flat)", {}),
         ("TQprod3", {}), ("QJL384", {}), ("PCA,TQ2", {}), ("PCA,TQ2,Prefilter(10)", {}),
         ("IVF256,TQ2", {"nprobe": 8}), ("IVF256,TQ4,Refine(Flat)", {"nprobe": 8})]


def worker(dataset: str, single: int, nq: int) -> dict:
    import numpy as np
    import torch

    import tqvec
    from tqvec.datasets import load_ann

    data = load_ann(dataset)
    xb, xq = data["train"].astype(np.float32), data["test"][:nq].astype(np.float32)
    metric = {"euclidean": "l2", "angular": "cosine"}.get(data["distance"], "ip")
    out = {"tqvec": tqvec.__file__, "threads": torch.get_num_threads(), "rows": {}}
    for spec, attrs in SPECS:
        index = tqvec.index_factory(xb.shape[1], spec, metric)
        index.train(xb)
        index.add(xb)
        for k, v in attrs.items():
            setattr(index, k, v)
        index.search(xq[:4], 10)  # builds the search-time layouts
        times = []
        for i in range(single):
            q = xq[i % len(xq)][None]
            t = time.perf_counter()
            index.search(q, 10)
            times.append(time.perf_counter() - t)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            index.search(xq, 10)
            best = min(best, time.perf_counter() - t)
        out["rows"][spec] = {"single_us": 1e6 * statistics.median(times), "batch_qps": nq / best}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=False, help="python of install A (before)")
    ap.add_argument("--b", required=False, help="python of install B (after)")
    ap.add_argument("--dataset", nargs="+",
                    default=["fashion-mnist-784-euclidean", "minilm-384-angular"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--single", type=int, default=200)
    ap.add_argument("--nq", type=int, default=1000)
    ap.add_argument("--out", default="ab")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a.single, a.nq)))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _machine import machine_info

    runs: dict = {}
    for dataset in a.dataset:
        for r in range(a.rounds):
            for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
                py = a.a if side == "A" else a.b
                out = subprocess.run([py, __file__, "--worker", dataset, "--single",
                                      str(a.single), "--nq", str(a.nq)], capture_output=True,
                                     text=True, check=True, env=dict(os.environ,
                                                                     PYTHONWARNINGS="ignore"))
                res = json.loads(out.stdout.strip().splitlines()[-1])
                runs.setdefault(dataset, {}).setdefault(side, []).append(res)
                print(f"{dataset} round {r} {side}: {res['tqvec']}", flush=True)
    table = []
    for dataset, sides in runs.items():
        for spec, _ in SPECS:
            row = {"dataset": dataset, "spec": spec}
            for side in ("A", "B"):
                rs = [run["rows"][spec] for run in sides[side]]
                row[f"single_us_{side}"] = statistics.median(r["single_us"] for r in rs)
                row[f"batch_qps_{side}"] = statistics.median(r["batch_qps"] for r in rs)
                row[f"single_us_best_{side}"] = min(r["single_us"] for r in rs)
                row[f"batch_qps_best_{side}"] = max(r["batch_qps"] for r in rs)
            row["single_ratio_B_over_A"] = row["single_us_B"] / row["single_us_A"]
            row["batch_ratio_B_over_A"] = row["batch_qps_B"] / row["batch_qps_A"]
            # best of the rounds: a process's slow outlier (the machine's noise only adds time)
            row["single_best_ratio_B_over_A"] = (row["single_us_best_B"]
                                                 / row["single_us_best_A"])
            row["batch_best_ratio_B_over_A"] = row["batch_qps_best_B"] / row["batch_qps_best_A"]
            table.append(row)
    report = {"machine": machine_info(), "rounds": a.rounds, "single": a.single, "nq": a.nq,
              "k": 10, "a": a.a, "b": a.b, "rows": table, "runs": runs}
    os.makedirs(os.path.join("bench", "results"), exist_ok=True)
    path = os.path.join("bench", "results", a.out)
    with open(path + ".json", "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"# A/B: {a.out}", "", f"Machine: {report['machine']}", "",
             f"`python bench/ab.py` - A and B in alternating processes, {a.rounds} rounds, "
             f"medians; single: median of {a.single} one-query searches (us), batch: "
             f"{a.nq} queries (QPS, best of 3), k = 10. Ratio: B / A (single: < 1 is faster, "
             "batch: > 1 is faster); best: the same ratio of the best round of each side.",
             "",
             "| dataset | index | single A us | single B us | B/A | best B/A | batch A QPS | "
             "batch B QPS | B/A | best B/A |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['dataset'].split('-')[0]} | {r['spec']} | {r['single_us_A']:.0f} | "
                     f"{r['single_us_B']:.0f} | {r['single_ratio_B_over_A']:.2f} | "
                     f"{r['single_best_ratio_B_over_A']:.2f} | "
                     f"{r['batch_qps_A']:.0f} | {r['batch_qps_B']:.0f} | "
                     f"{r['batch_ratio_B_over_A']:.2f} | {r['batch_best_ratio_B_over_A']:.2f} |")
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
