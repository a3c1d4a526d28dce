"""What a prefilter costs in recall, by the data's regime: ``TQ{b}`` (the exact scan of the
codes) against ``TQ{b},Prefilter(P)`` (a sign-bit first pass keeps P k rows for the full codes)
and ``TQ{b},Prefilter`` (the first pass bounded by its error: every row that can reach the top
k within ``prefilter_sigmas`` standard deviations, 2 and the factory's 3) on isotropic Gaussian
vectors, clustered synthetic vectors and the real sets that are built (Fashion-MNIST, MiniLM),
recall@10 against exact neighbours, with the speed each buys.

    python bench/prefilter.py [--n 200000] [--d 768] [--nq 1000] [--bits 2 4]

Writes bench/results/prefilter.{json,md}. One process, one thread for the single-query timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _machine import machine_info  # noqa: E402

import tqvec  # noqa: E402
from tqvec.datasets import ground_truth, load_ann  # noqa: E402
from tqvec.index.factory import PREFILTER_SIGMAS  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FACTORS = (0, 10, 20, 50, 100)
SIGMAS = (2.0, PREFILTER_SIGMAS)  # the bounded pass's prefilter_sigmas (the factory's last)


def synthetic(kind: str, n: int, d: int, nq: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    if kind == "isotropic":
        x = rng.standard_normal((n + nq, d)).astype(np.float32)
    else:  # 1,000 Gaussian clusters, spread 1 around centres of spread 3
        c = 3 * rng.standard_normal((1000, d)).astype(np.float32)
        x = c[rng.integers(0, 1000, n + nq)] + rng.standard_normal((n + nq, d)).astype(
            np.float32)
    return x[:n], x[n:], "euclidean"


def recall(I, gt, k=10):
    return float(np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(I, gt, strict=True)]))


def qps(index, q, single=200):
    t = time.perf_counter()
    index.search(q, 10)
    batch = len(q) / (time.perf_counter() - t)
    t = time.perf_counter()
    for row in q[:single]:
        index.search(row[None], 10)
    return batch, single / (time.perf_counter() - t)


def run(name, xb, xq, distance, bits, rows):
    metric = "l2" if distance == "euclidean" else "cosine"
    gt, _ = ground_truth(xb, xq, 10, distance)
    for b in bits:
        index = tqvec.index_factory(xb.shape[1], f"TQ{b}", metric)
        index.add(xb)
        index.search(xq[:1], 10)  # the layouts
        for p in (*FACTORS, *(f"sigmas {z:g}" for z in SIGMAS)):
            if isinstance(p, str):
                index.prefilter = 0
                index.prefilter_sigmas = float(p.split()[1])
            else:
                index.prefilter_sigmas = 0.0
                index.prefilter = p
            index.search(xq[:1], 10)
            _, I = index.search(xq, 10)
            batch, single = qps(index, xq)
            rows.append({"data": name, "n": len(xb), "d": xb.shape[1], "bits": b,
                         "prefilter": p, "recall@10": recall(I, gt), "qps_batch": batch,
                         "qps_single": single})
            print(json.dumps(rows[-1]), flush=True)


def markdown(rows, meta):
    out = ["# Prefilter: recall lost by a fixed first pass, and the bounded one", "",
           f"`{meta['command']}` on {meta['machine']['cpu']} ({meta['machine']['cpus']} CPUs); "
           "recall@10 against exact neighbours; q/s at k = 10 (batch: all queries in one call, "
           "the machine's threads; single: one query per call).", "",
           "| data | n × d | bits | exact scan | Prefilter(10) | (20) | (50) | (100) | "
           + " | ".join(f"bounded, {z:g} σ" for z in SIGMAS)
           + " | q/s exact → (10) → " + " → ".join(f"{z:g} σ" for z in SIGMAS)
           + ", batch / single |",
           "|---|---|---|---|---|---|---|---|" + "---|" * len(SIGMAS) + "---|"]
    keyed = {(r["data"], r["bits"], r["prefilter"]): r for r in rows}
    bounded = [f"sigmas {z:g}" for z in SIGMAS]
    for data, b in dict.fromkeys((r["data"], r["bits"]) for r in rows):
        cells = [f"{keyed[(data, b, p)]['recall@10']:.3f}" for p in (*FACTORS, *bounded)]
        timed = [keyed[(data, b, p)] for p in (0, 10, *bounded)]
        e = timed[0]
        out.append(f"| {data} | {e['n']:,} × {e['d']} | {b} | " + " | ".join(cells) + " | "
                   + " → ".join(f"{r['qps_batch']:,.0f}" for r in timed) + " / "
                   + " → ".join(f"{r['qps_single']:,.0f}" for r in timed) + " |")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--nq", type=int, default=1000)
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--out", default="prefilter")
    a = ap.parse_args(argv)
    rows = []
    for kind in ("isotropic", "clustered"):
        xb, xq, dist = synthetic(kind, a.n, a.d, a.nq)
        run(f"{kind} (synthetic)", xb, xq, dist, a.bits, rows)
        del xb, xq
    for name in ("fashion-mnist-784-euclidean", "minilm-384-angular"):
        try:
            data = load_ann(name)
        except (FileNotFoundError, OSError) as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
            continue
        run(name, data["train"], data["test"][:a.nq], data["distance"], a.bits, rows)
    meta = {"command": " ".join(["python bench/prefilter.py", *(argv or sys.argv[1:])]),
            "machine": machine_info(), "rows": rows}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{a.out}.json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(RESULTS, f"{a.out}.md"), "w") as f:
        f.write(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
