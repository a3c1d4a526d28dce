"""tqvec.distributed on this machine: encode throughput on Ray (1 and 2 workers) against the
one-process encoder, and a sharded index (1, 2, 4 shards on Ray actors) against the same index
in this process - batch and single-query - with the overhead of scatter/merge, and a model of
1 billion 768-d vectors at 4 bits on N nodes built from the measured parts.

    python bench/distributed.py [--dataset fashion-mnist-784-euclidean] [--nq 1000]

Ray runs locally with 2 CPUs (``ray.init(num_cpus=2)``). Encode: TurboQuant 4-bit codes of
the training vectors; one process at 1 and 2 torch threads (median of 3), Ray Data
``encode_dataset`` with 1 and 2 workers over the dataset already in the object store, in
32,768-row blocks and batches (median of 5, materialized), over the whole collection and its
first quarter (their difference: the rate past the workers' start-up). Search: k = 10; the one index
searches with 2 threads; the sharded index puts its shards on min(shards, 2) actors with
2 / actors threads each (under a refinement both ``refine_rounds``, 1 and 2). Batch: all
queries in one call (median of 9); single: one query per
call (median latency over the queries, after a warm-up); the one index and the sharded one
measured call by call alternately, after 2 s of warm-up. Pipelined: the first PIPE_QUERIES
queries one per call from PIPE_THREADS threads at once (a server's concurrent requests), wall
time over queries; median of 3. Results must be identical to the
one index's (checked, reported). Writes bench/results/distributed.{json,md} (--stem: another
name).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SPECS = (("TQ4", {}), ("IVF256,TQ2,Refine(TQ8)", {"nprobe": 16}))
SHARDS = (1, 2, 4)
PIPE_QUERIES, PIPE_THREADS = 300, 8
ENCODE_TILES = 8  # the encode runs over the training vectors 8 times over (480,000 rows)
# the model's assumptions (stated in the report)
MODEL_ROWS, MODEL_D, MODEL_BITS = 10**9, 768, 4
MODEL_CORES, MODEL_RTT_MS, MODEL_READ_GBS = 32, 0.2, 1.0
MODEL_NLIST, MODEL_NPROBE = 65536, 64


def _median_time(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def encode_rows(x: np.ndarray, ray, dist) -> list[dict]:
    import re

    import torch

    import tqvec
    x = np.tile(x, (ENCODE_TILES, 1))  # enough rows that the workers' start-up is a part
    codec = tqvec.TurboQuant(x.shape[1], bits=4, seed=0)
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        codec.encode(x[:4096])
        s = _median_time(lambda: codec.encode(x), 3)
        rows.append({"method": f"one process, {threads} thread(s)", "s": s,
                     "rows_per_s": len(x) / s})
    torch.set_num_threads(2)
    # the whole collection and its first quarter: the difference of their end-to-end times is
    # the rate past the workers' start-up (importing torch and tqvec, ~2 s a process here),
    # which a collection of millions of rows amortizes and 480,000 rows do not
    quarter = len(x) // 4
    sets = {n: dist.as_dataset(x[:n], block_rows=32768).materialize() for n in (quarter, len(x))}
    for workers in (1, 2):
        ops, times = [], {}

        def run(ds, w=workers, ops=ops):
            out = dist.encode_dataset(ds, codec, batch_size=32768, concurrency=w).materialize()
            m = re.search(r"MapBatches\(_Encoder\).*? produced in ([0-9.]+)s", out.stats())
            ops.append(float(m[1]) if m else float("nan"))
        run(sets[len(x)])
        for _ in range(5):  # the two sizes interleaved, each run five times
            for n, ds in sets.items():
                t = time.perf_counter()
                run(ds)
                times.setdefault(n, []).append(time.perf_counter() - t)
        s = statistics.median(times[len(x)])
        op = statistics.median(ops[2::2])  # the whole collection's timed runs
        marginal = (len(x) - quarter) / (s - statistics.median(times[quarter]))
        rows.append({"method": f"Ray Data, {workers} worker(s)", "s": s,
                     "rows_per_s": len(x) / s, "operator_s": op,
                     "operator_rows_per_s": len(x) / op,
                     "quarter_s": statistics.median(times[quarter]),
                     "marginal_rows_per_s": marginal})
    return rows


def pipelined_ms(index, queries: np.ndarray) -> float:
    """ms per query of single-query searches issued from PIPE_THREADS threads at once."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(PIPE_THREADS) as pool:
        t = time.perf_counter()
        for _ in pool.map(lambda q: index.search(q[None], 10), queries):
            pass
        return (time.perf_counter() - t) / len(queries) * 1e3


def search_rows(xb: np.ndarray, xq: np.ndarray, ray, dist) -> list[dict]:
    import torch

    import tqvec
    torch.set_num_threads(2)
    out = []
    for spec, params in SPECS:
        one = tqvec.index_factory(xb.shape[1], spec, "l2", seed=0)
        if not one.is_trained:
            one.train(xb[:20000])
        one.add(xb)
        for k, v in params.items():
            setattr(one, k, v)
        D0, I0 = one.search(xq, 10)

        def sharded(shards, spec=spec, params=params):
            ix = dist.build_sharded_index(xb, spec, "l2", num_shards=shards, seed=0,
                                          train_rows=20000, num_actors=min(shards, 2))
            for k, v in params.items():
                setattr(ix, k, v)
            return ix
        # each sharded index is built, measured side by side with the one index (calls
        # alternating, so that both see the same host) and stopped before the next (idle
        # actors hold memory)
        # under a refinement: re-ranked in each shard (1 round) or after the merge (2)
        rounds = (1, 2) if "Refine" in spec else (None,)
        for shards, r in ((s, r) for s in SHARDS for r in rounds):
            ix = sharded(shards)
            ix.refine_rounds = r
            D, I = ix.search(xq, 10)
            # warm: a sharded index's first searches after the build run slower for ~1 s
            # (most likely Ray winding the build's pipeline down); both for 2 s
            end = time.perf_counter() + 2.0
            while time.perf_counter() < end:
                one.search(xq, 10)
                ix.search(xq, 10)
            batch = {"one": [], "sharded": []}
            for _ in range(9):
                for name, index in (("one", one), ("sharded", ix)):
                    t = time.perf_counter()
                    index.search(xq, 10)
                    batch[name].append(time.perf_counter() - t)
            lat = {"one": [], "sharded": []}
            for i, q in enumerate(np.concatenate([xq[:20], xq])):
                for name, index in (("one", one), ("sharded", ix)):
                    t = time.perf_counter()
                    index.search(q[None], 10)
                    if i >= 20:
                        lat[name].append(time.perf_counter() - t)
            pipe = {"one": [], "sharded": []}
            for _ in range(3):
                for name, index in (("one", one), ("sharded", ix)):
                    pipe[name].append(pipelined_ms(index, xq[:PIPE_QUERIES]))
            row = {"spec": spec, "params": params, "shards": shards, "actors": min(shards, 2),
                   "refine_rounds": r, "identical": bool(np.array_equal(I, I0))}
            for name in ("one", "sharded"):
                b = statistics.median(batch[name])
                row[name] = {"batch_qps": len(xq) / b, "batch_us_per_query": b / len(xq) * 1e6,
                             "single_ms": statistics.median(lat[name]) * 1e3,
                             "single_p99_ms": float(np.percentile(lat[name], 99)) * 1e3,
                             "pipelined_ms_per_query": statistics.median(pipe[name])}
            out.append(row)
            ix.close()
    return out


def actor_round_trip_ms(ray) -> float:
    @ray.remote
    class Echo:
        def f(self, q):
            return q

    a = [Echo.remote() for _ in range(2)]
    q = np.zeros((1, 784), np.float32)
    ray.get([b.f.remote(q) for b in a])
    s = _median_time(lambda: [ray.get([b.f.remote(q) for b in a]) for _ in range(200)], 3)
    return s / 200 * 1e3


def merge_us(nq: int, shards: int, kk: int) -> float:
    from tqvec.index import merge_candidates
    rng = np.random.default_rng(0)
    parts = [(rng.random((nq, kk), np.float32),) * 2 + (rng.integers(0, 10**6, (nq, kk)),)
             for _ in range(shards)]
    return _median_time(lambda: merge_candidates(parts, 10, kk, 1), 20) / nq * 1e6


def model(res: dict) -> dict:
    """1 billion 768-d vectors at 4 bits on N nodes, from the measured parts."""
    # per worker core on Ray Data: its operator rate with 2 workers, halved (what a core
    # achieved inside Ray here, below the one-process encoder's rate)
    enc = next(r["operator_rows_per_s"] for r in res["encode"]
               if r["method"].startswith("Ray Data, 2")) / 2
    ivf = [r for r in res["search"] if r["spec"].startswith("IVF")]
    n_rows, d_meas = res["n"], res["d"]
    probe_frac = SPECS[1][1]["nprobe"] / 256
    # per scanned row per query, 2 threads: the whole batch time per query (rotation, tables
    # and re-rank included) over the rows probed - an upper bound on the per-row cost
    one_us = statistics.median(r["one"]["batch_us_per_query"] for r in ivf)
    per_row_us = one_us / (n_rows * probe_frac) * (MODEL_D / d_meas)
    code_bytes = MODEL_D * MODEL_BITS // 8 + 4
    out = {"assumptions": {"rows": MODEL_ROWS, "d": MODEL_D, "bits": MODEL_BITS,
                           "cores_per_node": MODEL_CORES, "rtt_ms": MODEL_RTT_MS,
                           "read_gb_per_s_per_node": MODEL_READ_GBS,
                           "nlist": MODEL_NLIST, "nprobe": MODEL_NPROBE},
           "encode_rows_per_core_s": enc,
           "scan_us_per_row_2_threads": per_row_us, "nodes": []}
    scanned = MODEL_ROWS * MODEL_NPROBE / MODEL_NLIST
    for nodes in (1, 4, 16, 64):
        per_node = scanned / nodes
        # a node's cores split its rows: 2-thread time x 2 / cores
        scan_ms = per_node * per_row_us * 2 / MODEL_CORES / 1e3
        latency = scan_ms + MODEL_RTT_MS + res["round_trip_ms"] + res["merge_us_per_query"][
            "16"] * 1e-3 * (nodes / 16)
        out["nodes"].append({
            "nodes": nodes, "gb_per_node": MODEL_ROWS * code_bytes / nodes / 1e9,
            "encode_hours": max(MODEL_ROWS / (enc * MODEL_CORES * nodes),
                                MODEL_ROWS * MODEL_D * 4 / (MODEL_READ_GBS * 1e9 * nodes)) / 3600,
            "single_query_ms": latency,
            "batch_qps": 1e3 / scan_ms if scan_ms else float("inf")})
    return out


def _rounds(r: int | None) -> str:
    return "" if r is None else f" ({r} round{'s' if r > 1 else ''})"


def write(res: dict, stem: str, argv: list[str]) -> None:
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    m = res["machine"]
    lines = [f"# Scale-out on Ray: {res['dataset']} ({res['n']:,} x {res['d']}, "
             f"{res['nq']} queries)", "",
             f"Command: `{' '.join(['python bench/distributed.py', *argv])}`. Machine: "
             f"{m.get('cpu')}, {m['cpus']} CPUs, SIMD path {m.get('tqvec_simd_path')}; Ray "
             f"{res['ray']} local, 2 CPUs. A Ray actor call answered by two actors at once "
             f"(a (1, 784) array there and back) takes {res['round_trip_ms']:.2f} ms here.", "",
             f"## Encode (TurboQuant 4-bit, {res['n'] * ENCODE_TILES:,} rows)", "",
             "End to end: the call until the codes are materialized (workers start, import "
             "tqvec, encode, hand back). Past start-up: the rows past the first quarter over "
             "the difference between the end-to-end times of the whole collection and of its "
             "first quarter (the workers' fixed start-up cancels; what a collection of millions "
             "of rows sees). Operator: Ray Data's own time of the map_batches operator (its "
             "stats).", "",
             "| method | seconds | rows/s | vs 1 worker | past start-up rows/s | vs 1 worker "
             "| operator rows/s | vs 1 worker |", "|---|---|---|---|---|---|---|---|"]
    one_w = next(r for r in res["encode"] if r["method"].startswith("Ray Data, 1"))
    for r in res["encode"]:
        ray_cols = (f"{r['marginal_rows_per_s']:,.0f} | "
                    f"{r['marginal_rows_per_s'] / one_w['marginal_rows_per_s']:.2f} | "
                    f"{r['operator_rows_per_s']:,.0f} | "
                    f"{r['operator_rows_per_s'] / one_w['operator_rows_per_s']:.2f}"
                    if "operator_s" in r else "– | – | – | –")
        lines.append(f"| {r['method']} | {r['s']:.2f} | {r['rows_per_s']:,.0f} | "
                     f"{r['rows_per_s'] / one_w['rows_per_s']:.2f} | {ray_cols} |")
    lines += ["", "## Search (k = 10): sharded against one index in this process", "",
              "Each sharded index measured call by call alternately with the one index (its "
              "figures beside it), after 2 s of warm-up. Under a refinement, `refine_rounds`: "
              "1 round - each shard re-ranks its own best candidates; 2 rounds - the shards "
              "scan, the coordinator merges the scans, each shard re-ranks only its rows among "
              "the best (the default for a batch like this one; a single query takes 1 round "
              "by default, and 2 here only because the row forces it). Pipelined: "
              f"{PIPE_QUERIES} single-query calls from {PIPE_THREADS} threads at once, wall "
              "time per query; its extra is against the one index's single-query latency.", "",
              "| index | shards, actors | identical | batch QPS: one / sharded | ratio | "
              "extra us/query (batch) | single ms: one / sharded | extra ms | single p99 ms | "
              "pipelined ms/query: one / sharded | extra ms (pipelined) |",
              "|---" * 11 + "|"]
    for r in res["search"]:
        o, sh = r["one"], r["sharded"]
        lines.append(
            f"| {r['spec']}{_rounds(r.get('refine_rounds'))} | {r['shards']}, {r['actors']} | "
            f"{'yes' if r['identical'] else 'NO'} | "
            f"{o['batch_qps']:,.0f} / {sh['batch_qps']:,.0f} | "
            f"{sh['batch_qps'] / o['batch_qps']:.2f} | "
            f"{sh['batch_us_per_query'] - o['batch_us_per_query']:+.1f} | "
            f"{o['single_ms']:.2f} / {sh['single_ms']:.2f} | "
            f"{sh['single_ms'] - o['single_ms']:+.2f} | {sh['single_p99_ms']:.2f} | "
            + (f"{o['pipelined_ms_per_query']:.2f} / {sh['pipelined_ms_per_query']:.2f} | "
               f"{sh['pipelined_ms_per_query'] - o['single_ms']:+.2f} |"
               if "pipelined_ms_per_query" in sh else "– | – |"))
    mm = res["model"]
    a = mm["assumptions"]
    lines += ["", f"## Model: {a['rows']:,} x {a['d']} at {a['bits']} bits, IVF{a['nlist']} "
              f"nprobe {a['nprobe']}", "",
              f"Measured parts: encode {mm['encode_rows_per_core_s']:,.0f} rows/s per Ray Data "
              f"worker core (784-d; 2 workers' operator rate, halved); IVF search "
              f"{mm['scan_us_per_row_2_threads'] * 1e3:.2f} ns per probed row per query on 2 "
              f"threads (all its per-query work over the rows probed, scaled to 768-d: an upper "
              f"bound); merge "
              f"{res['merge_us_per_query']['16']:.1f} us per query for 16 shards; Ray call "
              f"{res['round_trip_ms']:.2f} ms. Assumed: {a['cores_per_node']} cores per node "
              f"scanning in parallel at this core's speed, a network round trip of "
              f"{a['rtt_ms']} ms, float32 input read at {a['read_gb_per_s_per_node']} GB/s per "
              f"node (encode hours: the slower of reading and encoding), codes only in memory "
              f"(no refinement vectors), one shard per node.", "",
              "| nodes | GB of codes per node | encode hours | single-query ms | "
              "batch QPS (scan-bound) |", "|---|---|---|---|---|"]
    for r in mm["nodes"]:
        lines.append(f"| {r['nodes']} | {r['gb_per_node']:.1f} | {r['encode_hours']:.2f} | "
                     f"{r['single_query_ms']:.2f} | {r['batch_qps']:,.0f} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="fashion-mnist-784-euclidean")
    ap.add_argument("--nq", type=int, default=1000)
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    ap.add_argument("--stem", default="distributed", help="results file name (no extension)")
    a = ap.parse_args(argv)
    import ray

    import tqvec.distributed as dist
    from tqvec._machine import machine_info
    from tqvec.benchmark import load
    xb, xq, _, _ = load(a.dataset, a.nq)
    xb = np.ascontiguousarray(xb, np.float32)
    xq = np.ascontiguousarray(xq, np.float32)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    res = {"dataset": a.dataset, "n": len(xb), "d": xb.shape[1], "nq": len(xq),
           "ray": ray.__version__, "machine": machine_info()}
    res["round_trip_ms"] = actor_round_trip_ms(ray)
    res["merge_us_per_query"] = {str(s): merge_us(len(xq), s, 40) for s in (2, 4, 16)}
    res["encode"] = encode_rows(xb, ray, dist)
    res["search"] = search_rows(xb, xq, ray, dist)
    res["model"] = model(res)
    os.makedirs(a.out, exist_ok=True)
    write(res, os.path.join(a.out, a.stem), argv)
    print(open(os.path.join(a.out, a.stem + ".md")).read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
