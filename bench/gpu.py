"""GPU benchmark: batch encode and asymmetric search on CUDA, against the roofline,
exact fp16 search and our torch reference path, in one run on one device.

    python bench/gpu.py                     # d = 128, 384, 1536; b = 1..4; n = 1M; nq = 1, 32, 1000
    python bench/gpu.py --n 1000000 10000000 --dims 128 --bits 4
    python bench/gpu.py --quick             # small sizes: checks the script end to end

Needs a CUDA device. Writes bench/results/gpu.json and gpu.md (--out: another stem), with
the device name.

What is measured (CUDA events, median of --repeat runs after a warm-up):
* roofline: device-to-device copy bandwidth (bytes read + written / s) of a 2 GiB tensor, and the
  fp16 and fp32 matmul rates (8192^3).
* encode: TurboQuant-mse (Hadamard rotation kernel + quantize/pack kernel), TurboQuant-prod, QJL;
  vectors/s, and the fraction of the floor max(bytes read+written / bandwidth, GEMM flops /
  matmul rate) (the Hadamard rotation's O(d log d) adds are far below either).
* scan: tq_lut_scan with its fused top-k (k = 10) over n codes: seconds per batch, queries/s,
  bytes of codes read per second (n * row bytes / time, each byte counted once per batch) and
  its fraction of the copy bandwidth; vs (a) exact search in fp16 (matmul + topk over the fp16
  base, blocked to bound memory: faiss's GpuIndexFlat equivalent), (b) the torch reference
  (ops.lut_scan backend="ref" per 1M-row block + merge). recall@10 of the scan against the
  exact fp32 top-10 is reported too (a sanity check of the codes, not a speed figure).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _gpu import copy_bandwidth, cuda_time  # noqa: E402

import tqvec  # noqa: E402
from tqvec import ops  # noqa: E402
from tqvec.ops import cuda as cuda_ops  # noqa: E402

RESULTS = os.path.join(HERE, "results")


def roofline(repeat: int) -> dict:
    res = {"copy_GBps": copy_bandwidth(repeat)}
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (torch's default too)
    for dt, name in ((torch.float16, "fp16"), (torch.float32, "fp32")):
        a = torch.randn(8192, 8192, device="cuda", dtype=dt)
        b = torch.randn(8192, 8192, device="cuda", dtype=dt)
        t = cuda_time(lambda: a @ b, repeat)  # noqa: B023
        res[f"matmul_{name}_TFLOPs"] = 2 * 8192**3 / t / 1e12
    return res


def _codec(kind: str, d: int, b: int):
    if kind == "TQ":
        return tqvec.TurboQuant(d, b)
    if kind == "TQprod":
        return tqvec.TurboQuant(d, max(b, 2), "prod")
    return tqvec.QJL(d, d * b)


def bench_encode(d: int, b: int, n: int, roof: dict, repeat: int) -> list[dict]:
    x = torch.randn(n, d, device="cuda")
    rows = []
    for kind in ("TQ", "TQprod", "QJL"):
        cd = _codec(kind, d, b)
        t = cuda_time(lambda: cd.encode(x), repeat)  # noqa: B023
        moved = n * (4 * d + cd.code_size)
        flops = 0 if kind == "TQ" else 2 * n * d * (cd.sketch_dim)
        floor = max(moved / (roof["copy_GBps"] * 1e9),
                    flops / (roof["matmul_fp32_TFLOPs"] * 1e12))
        rows.append({"op": "encode", "codec": repr(cd), "d": d, "b": b, "n": n,
                     "seconds": t, "vectors_per_s": n / t, "floor_seconds": floor,
                     "fraction_of_floor": floor / t})
    return rows


def _blocked_topk(score_block, n: int, k: int, block: int = 1 << 20):
    """Top-k over n rows scored block by block: score_block(s, e) -> (values, positions)."""
    best_v = best_i = None
    for s in range(0, n, block):
        v, i = score_block(s, min(n, s + block))
        i = i + s
        if best_v is not None:
            v, j = torch.topk(torch.cat([best_v, v], 1), k, dim=1)
            i = torch.gather(torch.cat([best_i, i], 1), 1, j)
        best_v, best_i = v, i
    return best_v, best_i


def _exact_topk(xq: torch.Tensor, xb: torch.Tensor, k: int):
    def block(s, e):
        sc = (xq @ xb[s:e].T).float()
        return torch.topk(sc, min(k, e - s), dim=1)
    return _blocked_topk(block, xb.shape[0], k)


def _ref_topk(qr, packed, cent, mult, add, b, k):
    return _blocked_topk(lambda s, e: ops.lut_scan(qr, packed[s:e], cent, mult[s:e], add[s:e],
                                                   b, k, backend="ref"), packed.shape[0], k)


def bench_scan(d: int, b: int, n: int, nqs: list[int], roof: dict, repeat: int, k: int = 10,
               ref_max_n: int = 2_000_000) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    xb = torch.randn(n, d, device="cuda", generator=gen)
    cd = tqvec.TurboQuant(d, b)
    codes = cd.encode(xb)
    mult = codes.scalars["norm"].float()
    add = torch.zeros(n, device="cuda")
    cent = cd._arr.get("centroids", xb.device)
    xb16 = xb.half()
    rb = codes.payload.shape[1]
    rows = []
    for nq in nqs:
        xq = torch.randn(nq, d, device="cuda", generator=gen)
        qr = cd.rotate(xq)

        def scan():
            return ops.lut_scan(qr, codes.payload, cent, mult, add, b, k,  # noqa: B023
                                backend="cuda")
        t_scan = cuda_time(scan, repeat)
        cuda_ops.MMA_SCAN = False  # the LUT kernel, same call
        t_lut = cuda_time(scan, max(3, repeat // 3))
        _, i_lut = scan()
        cuda_ops.MMA_SCAN = True
        xq16 = xq.half()
        t_fp16 = cuda_time(lambda: _exact_topk(xq16, xb16, k), repeat)  # noqa: B023
        t_ref = (cuda_time(lambda: _ref_topk(qr, codes.payload, cent, mult, add, b, k),  # noqa: B023
                       max(1, repeat // 3)) if n <= ref_max_n else None)
        _, ig = scan()
        _, ie = _exact_topk(xq, xb, k)

        def overlap(a, c):
            return float(np.mean([len(set(x.tolist()) & set(y.tolist())) / k
                                  for x, y in zip(a.cpu(), c.cpu(), strict=True)]))
        recall = overlap(ig, ie)
        code_bytes = n * (rb + 4)
        rows.append({
            "op": "scan", "d": d, "b": b, "n": n, "nq": nq, "k": k,
            "seconds": t_scan, "qps": nq / t_scan, "code_GBps": code_bytes / t_scan / 1e9,
            "kernel": "tq_mma_scan" if cuda_ops.mma_scan_applies(d, b, k) else "tq_lut_scan",
            "lut_kernel_seconds": t_lut, "speedup_vs_lut_kernel": t_lut / t_scan,
            "same_ids_as_lut_kernel": overlap(ig, i_lut),
            "fraction_of_bandwidth": code_bytes / t_scan / (roof["copy_GBps"] * 1e9),
            "fp16_exact_seconds": t_fp16, "speedup_vs_fp16": t_fp16 / t_scan,
            "bytes_ratio_vs_fp16": (2 * d) / (rb + 4),
            "torch_ref_seconds": t_ref, "speedup_vs_torch_ref": (t_ref / t_scan) if t_ref else None,
            "recall_at_10_vs_exact": recall,
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def write(results: dict, stem: str = "gpu") -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=1)
    r = results["roofline"]
    lines = [f"# GPU kernels on {results['device']}", "",
             f"Roofline: copy {r['copy_GBps']:.0f} GB/s (read + write), matmul fp16 "
             f"{r['matmul_fp16_TFLOPs']:.0f} TFLOP/s, fp32 {r['matmul_fp32_TFLOPs']:.1f} TFLOP/s.",
             "", "## Encode", "",
             "| codec | d | n | vectors/s | fraction of floor |", "|---|---|---|---|---|"]
    for e in results["encode"]:
        lines.append(f"| {e['codec']} | {e['d']} | {e['n']:,} | {e['vectors_per_s']:.3g} | "
                     f"{e['fraction_of_floor']:.2f} |")
    lines += ["", "## Scan (TurboQuant-mse codes, fused top-10)", "",
              "`ops.lut_scan` on CUDA: tq_mma_scan (tensor cores) where it applies; the LUT "
              "kernel (tq_lut_scan) timed on the same call for comparison.", "",
              "| d | b | n | nq | ms | QPS | code GB/s | of bandwidth | fp16 exact ms | "
              "speedup vs fp16 | bytes ratio | LUT kernel ms | vs LUT kernel | vs torch ref | "
              "recall@10 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in results["scan"]:
        ref = f"{s['speedup_vs_torch_ref']:.1f}×" if s["speedup_vs_torch_ref"] else "–"
        lines.append(
            f"| {s['d']} | {s['b']} | {s['n']:,} | {s['nq']} | {1e3 * s['seconds']:.3f} | "
            f"{s['qps']:.3g} | {s['code_GBps']:.0f} | {s['fraction_of_bandwidth']:.2f} | "
            f"{1e3 * s['fp16_exact_seconds']:.3f} | {s['speedup_vs_fp16']:.2f}× | "
            f"{s['bytes_ratio_vs_fp16']:.1f} | {1e3 * s.get('lut_kernel_seconds', 0):.3f} | "
            f"{s.get('speedup_vs_lut_kernel', 0):.2f}× | {ref} | "
            f"{s['recall_at_10_vs_exact']:.3f} |")
    lines += ["", "Reproduce: `python bench/gpu.py` (see its docstring)."]
    with open(os.path.join(RESULTS, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 384, 1536])
    ap.add_argument("--bits", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--n", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--nq", type=int, nargs="+", default=[1, 32, 1000])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="gpu", help="results file stem under bench/results")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA device")
    if a.quick:
        a.dims, a.bits, a.n, a.nq, a.repeat = [128], [4], [100_000], [1, 32], 3
    if "cuda" not in tqvec.available_backends():
        sys.exit(f"tqvec CUDA kernels unavailable: {tqvec.ops.cuda.unavailable_reason()}")
    from _machine import machine_info

    props = torch.cuda.get_device_properties(0)
    res = {"device": props.name, "machine": machine_info(), "roofline": roofline(a.repeat),
           "encode": [], "scan": []}
    print(json.dumps(res["roofline"]), flush=True)
    for d in a.dims:
        for b in a.bits:
            try:  # report a failing configuration and go on with the others
                res["encode"] += bench_encode(d, b, a.n[0], res["roofline"], a.repeat)
                for n in a.n:
                    res["scan"] += bench_scan(d, b, n, a.nq, res["roofline"], a.repeat)
                    torch.cuda.empty_cache()
            except Exception:
                traceback.print_exc()
                cuda_ops.MMA_SCAN = True
            write(res, a.out)
    write(res, a.out)


if __name__ == "__main__":
    main()
