"""Recall@10 of tqvec's codecs and of faiss's rotated quantizers over rotation seeds: how much
of a recall difference between two indexes at equal bytes is the luck of one random rotation.

    python bench/seeds.py [--dataset minilm-384-angular] [--specs TQ1 TQ1u ...]
                          [--faiss RR,RaBitQfs RR,EDEN1 ...] [--seeds 4]

Each spec is built with seeds 0 .. n-1 (the benchmarks use seed 0; faiss's factory uses 12345,
its ``RR`` matrix is re-drawn here with ``RandomRotationMatrix.init(seed)`` before training) on
the same 60k base and 1,000 queries (cosine: faiss gets unit rows and the inner product); writes
bench/results/seeds_<dataset>.{json,md} with every seed's recall@10, the mean and the range.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DEFAULT_SPECS = ("TQ1", "TQ1u", "Center,TQ1u", "TQ2", "TQ2u", "Center,TQ2u", "Center,TQ2f")
DEFAULT_FAISS = ("RR,RaBitQfs", "RR,EDEN1", "RR,RaBitQfs2", "RR,EDEN2")


def faiss_recall(spec: str, seed: int, xb: np.ndarray, xq: np.ndarray, gt: np.ndarray,
                 metric: str) -> tuple[float, int]:
    """recall@10 and bytes/vector of a faiss ``RR,...`` index whose rotation is drawn from seed."""
    import faiss

    from tqvec.benchmark import recall

    if metric == "cosine":
        xb = xb / np.linalg.norm(xb, axis=1, keepdims=True)
        xq = xq / np.linalg.norm(xq, axis=1, keepdims=True)
    index = faiss.index_factory(xb.shape[1], spec,
                                faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT)
    rr = faiss.downcast_VectorTransform(faiss.downcast_index(index).chain.at(0))
    if not isinstance(rr, faiss.RandomRotationMatrix):
        raise ValueError(f"faiss spec must start with RR, (a seeded rotation), got {spec!r}")
    rr.init(seed)  # train() then keeps it (is_trained)
    index.train(xb)
    index.add(xb)
    _, I = index.search(np.ascontiguousarray(xq, np.float32), 10)
    return recall(I, gt, 10), int(index.sa_code_size())


def main(argv: list[str] | None = None) -> int:
    import torch

    import tqvec
    from tqvec._machine import machine_info
    from tqvec.benchmark import load, recall

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="minilm-384-angular")
    ap.add_argument("--specs", nargs="+", default=list(DEFAULT_SPECS))
    ap.add_argument("--faiss", nargs="*", default=list(DEFAULT_FAISS),
                    help="faiss specs starting with RR, (none: tqvec only)")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--nq", type=int, default=1000)
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    xb, xq, gt, metric = load(a.dataset, a.nq)
    d = xb.shape[1]
    rows = []
    for spec in a.specs:
        rec = []
        for seed in range(a.seeds):
            index = tqvec.index_factory(d, spec, metric, seed=seed)
            index.train(xb)
            index.add(xb)
            _, I = index.search(xq, 10)
            rec.append(recall(I, gt, 10))
        rows.append({"spec": f"tqvec {spec}", "bytes": int(index.code_size), "recall@10": rec,
                     "mean": float(np.mean(rec)), "min": float(min(rec)), "max": float(max(rec))})
        print(f"tqvec {spec:16s} {index.code_size:4d} B  " + " ".join(f"{r:.4f}" for r in rec)
              + f"  mean {np.mean(rec):.4f}", flush=True)
    for spec in a.faiss:
        got = [faiss_recall(spec, seed, xb, xq, gt, metric) for seed in range(a.seeds)]
        rec = [r for r, _ in got]
        rows.append({"spec": f"faiss {spec}", "bytes": got[0][1], "recall@10": rec,
                     "mean": float(np.mean(rec)), "min": float(min(rec)), "max": float(max(rec))})
        print(f"faiss {spec:16s} {got[0][1]:4d} B  " + " ".join(f"{r:.4f}" for r in rec)
              + f"  mean {np.mean(rec):.4f}", flush=True)
    name = os.path.basename(a.dataset).split("-")[0].split(".")[0]
    stem = os.path.join(a.out, f"seeds_{name}")
    os.makedirs(a.out, exist_ok=True)
    res = {"dataset": a.dataset, "metric": metric, "n": int(len(xb)), "nq": int(len(xq)),
           "seeds": a.seeds, "rows": rows, "machine": machine_info()}
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    cmd = " ".join(["python bench/seeds.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [f"# recall@10 over rotation seeds: {a.dataset} ({len(xb):,} x {d}, {len(xq)} "
             f"queries, {metric})", "",
             f"Command: `{cmd}`. Seeds 0..{a.seeds - 1} (tqvec's benchmarks use seed 0, "
             "faiss's factory 12345). Machine: "
             f"{res['machine'].get('cpu')}, {res['machine'].get('cpus')} CPUs.", "",
             "| spec | bytes/vec | " + " | ".join(f"seed {s}" for s in range(a.seeds))
             + " | mean | range |", "|---" * (a.seeds + 4) + "|"]
    for r in rows:
        lines.append(f"| {r['spec']} | {r['bytes']} | "
                     + " | ".join(f"{v:.4f}" for v in r["recall@10"])
                     + f" | {r['mean']:.4f} | {r['max'] - r['min']:.4f} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
