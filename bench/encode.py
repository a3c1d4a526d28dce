"""Encode and decode throughput and encode's peak memory: tqvec TurboQuant vs faiss's
TurboQuant SQ, one run.

    python bench/encode.py [--n 100000] [--dim 384] [--bits 4] [--threads 2]

Each method runs in its own child process (so peak RSS is its own), on the same seeded data,
with the same thread count; the median of --repeat timed runs after one warm-up is reported
(decode: of the codes the encode made, tqvec's ``decode`` against faiss's ``sa_decode``).
Writes bench/results/encode.json and encode.md.

The floor: encode must read n*d*4 bytes and write n*code_size; the rotation costs 2*d^2 flops
per vector for a dense (Haar) rotation, and 3 rounds * 2 blocks * p*log2(p) adds for the
Hadamard one (p = largest power of two <= d). Both are compared with measured copy bandwidth and
matmul rate on this machine. Decode reads n*code_size bytes, writes n*d*4 and rotates back (the
same flops).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

METHODS = ["tqvec hadamard", "tqvec haar", "faiss RR,SQtqmse{b}", "faiss HR,SQtqmse{b}"]


def _data(n: int, d: int) -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((n, d), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)  # faiss's SQtq wants unit vectors


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    """Reset VmHWM (Linux >= 4.0), so the peak measured is that of encode alone."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def worker(method: str, n: int, d: int, b: int, threads: int, repeat: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    x = _data(n, d)
    if method.startswith("tqvec"):
        import tqvec

        codec = tqvec.TurboQuant(d, b, seed=0, rotation=method.split()[1])
        run = lambda: codec.encode(x)  # noqa: E731
        back = codec.decode
        code_size = codec.code_size
    else:
        import faiss

        faiss.omp_set_num_threads(threads)
        index = faiss.index_factory(d, method.split()[1].format(b=b))
        if not index.is_trained:
            index.train(x[:1000])  # RR/HR: draws the rotation; the SQtq codebook is fixed
        run = lambda: index.sa_encode(x)  # noqa: E731
        back = index.sa_decode
        code_size = index.sa_code_size()
    run()  # warm-up (also builds codebooks / rotations)
    _reset_peak()
    base = _status_mb("VmRSS")
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    peak_extra_mb = _status_mb("VmHWM") - base  # encode's alone, before the decodes
    codes = run()
    dtimes, refused = [], None
    try:
        back(codes)  # warm-up
    except RuntimeError as e:  # faiss's HR pads d to a power of two and cannot invert then
        refused = str(e).strip().splitlines()[-1][:200]
    for _ in range(repeat if refused is None else 0):
        t = time.perf_counter()
        back(codes)
        dtimes.append(time.perf_counter() - t)
    dmed = statistics.median(dtimes) if dtimes else None
    return {"method": method.format(b=b), "seconds": med, "vectors_per_s": n / med,
            "decode_seconds": dmed, "decode_vectors_per_s": n / dmed if dmed else None,
            "decode_refused": refused, "decode_times": dtimes,
            "code_size": code_size, "peak_extra_mb": peak_extra_mb,
            "codes_mb": n * code_size / 2**20,
            "times": times}


def roofline(d: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    a = np.ones(64 << 20, dtype=np.uint8)
    t = time.perf_counter()
    for _ in range(5):
        a.copy()
    copy_gbs = 5 * 2 * a.nbytes / (time.perf_counter() - t) / 1e9  # read + write
    m = torch.randn(8192, d)
    r = torch.randn(d, d)
    m @ r
    t = time.perf_counter()
    for _ in range(10):
        m @ r
    gflops = 10 * 2 * 8192 * d * d / (time.perf_counter() - t) / 1e9
    return {"copy_GBps": copy_gbs, "matmul_GFLOPs": gflops}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.n, a.dim, a.bits, a.threads, a.repeat)))
        return
    from _machine import machine_info

    rows = []
    for m in METHODS:
        out = subprocess.run([sys.executable, __file__, "--worker", m, "--n", str(a.n), "--dim",
                              str(a.dim), "--bits", str(a.bits), "--threads", str(a.threads),
                              "--repeat", str(a.repeat)], capture_output=True, text=True,
                             check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{rows[-1]['method']:>22}: {rows[-1]['vectors_per_s']:>12,.0f} vec/s, "
              f"decode {rows[-1]['decode_vectors_per_s'] or 0:>12,.0f} vec/s, "
              f"peak +{rows[-1]['peak_extra_mb']:.0f} MB", flush=True)
    roof = roofline(a.dim, a.threads)
    d, n = a.dim, a.n
    p = 1 << (d.bit_length() - 1)
    had_flops = 3 * 2 * p * math.log2(p)
    bytes_io = n * (d * 4 + rows[0]["code_size"])
    floor = {
        "bytes_s": bytes_io / (roof["copy_GBps"] * 1e9),
        "haar_gemm_s": n * 2 * d * d / (roof["matmul_GFLOPs"] * 1e9),
        "hadamard_adds_per_vector": had_flops,
    }
    best_faiss = max(r["vectors_per_s"] for r in rows if r["method"].startswith("faiss"))
    best_faiss_dec = max(r["decode_vectors_per_s"] or 0 for r in rows
                         if r["method"].startswith("faiss"))
    for r in rows:
        r["ratio_vs_best_faiss"] = r["vectors_per_s"] / best_faiss
        r["decode_ratio_vs_best_faiss"] = (r["decode_vectors_per_s"] / best_faiss_dec
                                           if r["decode_vectors_per_s"] and best_faiss_dec
                                           else None)
    result = {"n": n, "d": d, "bits": a.bits, "threads": a.threads, "rows": rows,
              "roofline": roof, "floor": floor, "machine": machine_info()}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "encode.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Encode and decode throughput, n={n:,}, d={d}, b={a.bits}, {a.threads} threads",
             "", f"Machine: {result['machine'].get('cpu', '?')}, "
             f"{result['machine']['cpus']} CPUs, torch {result['machine'].get('torch')}, "
             f"faiss {result['machine'].get('faiss')}. Command: `python bench/encode.py`.", "",
             "| method | bytes/vec | encode vectors/s | vs best faiss | decode vectors/s | "
             "vs best faiss | encode's peak extra MB (codes MB) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        dec = (f"{r['decode_vectors_per_s']:,.0f} | {r['decode_ratio_vs_best_faiss']:.2f}x"
               if r["decode_vectors_per_s"] else "cannot decode | -")
        lines.append(f"| {r['method']} | {r['code_size']} | {r['vectors_per_s']:,.0f} | "
                     f"{r['ratio_vs_best_faiss']:.2f}x | {dec} | {r['peak_extra_mb']:.0f} "
                     f"({r['codes_mb']:.0f}) |")
    lines += ["", f"Floor: reading {d * 4} B + writing {rows[0]['code_size']} B per vector at "
              f"the measured {roof['copy_GBps']:.1f} GB/s copy bandwidth = "
              f"{n / floor['bytes_s']:,.0f} vec/s; a dense rotation at the measured "
              f"{roof['matmul_GFLOPs']:.0f} GFLOP/s caps at {n / floor['haar_gemm_s']:,.0f} "
              f"vec/s; the Hadamard rotation needs {had_flops:,.0f} adds/vector.",
              "faiss's codes store no norm (its SQtq types assume unit vectors); tqvec's add a "
              "float32 norm (4 B)."]
    lines += [f"{r['method']} cannot decode here: {r['decode_refused']}" for r in rows
              if r["decode_refused"]]
    with open(os.path.join(a.out, "encode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
