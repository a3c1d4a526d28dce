"""GPU decode-attention benchmark (issue #5): one layer's decode step over compressed keys and
values (tq_decode_attention) against SDPA on a BF16 cache, at long context, in one run.

    python bench/kv_gpu.py                      # ctx 4k..128k (+1M if it fits), batch 1 and 16
    python bench/kv_gpu.py --ctx 16384 --batch 1 --quick

Needs a CUDA device. Shapes: head_dim 128, 32 query heads over 8 KV heads (GQA 4), one new
query token per sequence, keys/values TurboQuant-mse at --kbits/--vbits (default 3/3) plus one
fp32 norm each per token (our cache stores norms in fp16 in the transformers adapter; here fp32
keeps the kernel's reads honest: the table reports the bytes it really reads).

Per step it times (CUDA events, median of --repeat after warm-up):
* ours: the query rotation (Hadamard kernel), tq_decode_attention over the codes (split over the
  sequence, flash-decoding) and the log-sum-exp merge of the splits, and the inverse rotation of
  the output: everything a decode step needs apart from the fp window;
* bf16: torch.nn.functional.scaled_dot_product_attention(q, K, V, enable_gqa=True) on a BF16
  cache of the same length (FlashAttention / cuDNN / efficient backend as torch picks).
Bytes moved per step: codes + norms for ours, 2 * 2 * d bytes per token and KV head for BF16;
effective bandwidth = bytes / time, as a fraction of the measured copy bandwidth.

Writes bench/results/kv_gpu.json and kv_gpu.md with the device name.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _gpu import copy_bandwidth, cuda_time  # noqa: E402

import tqvec  # noqa: E402
from tqvec import ops  # noqa: E402

RESULTS = os.path.join(HERE, "results")


def step(batch: int, ctx: int, kb: int, vb: int, d: int, hq: int, hkv: int, repeat: int,
         bw: float) -> dict | None:
    g = hq // hkv
    bh = batch * hkv
    rbk, rbv = ops.row_bytes(d, kb), ops.row_bytes(d, vb)
    need = bh * ctx * (rbk + rbv + 8) + 2 * bh * ctx * d * 2
    if need > 0.8 * torch.cuda.mem_get_info()[0]:
        return None
    gen = torch.Generator(device="cuda").manual_seed(0)
    kp = torch.randint(0, 256, (bh, ctx, rbk), dtype=torch.uint8, device="cuda", generator=gen)
    vp = torch.randint(0, 256, (bh, ctx, rbv), dtype=torch.uint8, device="cuda", generator=gen)
    kn = torch.rand(bh, ctx, device="cuda", generator=gen) + 0.5
    vn = torch.rand(bh, ctx, device="cuda", generator=gen) + 0.5
    kcodec, vcodec = tqvec.TurboQuant(d, kb), tqvec.TurboQuant(d, vb)
    kc = kcodec._arr.get("centroids", kp.device)
    vc = vcodec._arr.get("centroids", kp.device)
    q = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    lo = torch.zeros(bh, dtype=torch.int32, device="cuda")
    hi = torch.full((bh,), ctx, dtype=torch.int32, device="cuda")
    qbias = torch.zeros(bh, g, device="cuda")
    scale = 1.0 / math.sqrt(d)

    def ours():
        qr = kcodec.rotate(q.reshape(batch * hq, d).float()).reshape(bh, g, d)
        m, l, acc = ops.decode_attention(qr, qbias, kp, kn, kc, kb, vp, vn, vc, vb, lo, hi,
                                         scale, backend="cuda")
        return vcodec.unrotate((acc / l[..., None]).reshape(batch * hq, d))

    K = torch.randn(batch, hkv, ctx, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    V = torch.randn_like(K)

    def bf16():
        return torch.nn.functional.scaled_dot_product_attention(q, K, V, enable_gqa=True)

    t_ours = cuda_time(ours, repeat)
    t_bf16 = cuda_time(bf16, repeat)
    bytes_ours = bh * ctx * (rbk + rbv + 8)
    bytes_bf16 = bh * ctx * 2 * d * 2
    return {"batch": batch, "ctx": ctx, "kbits": kb, "vbits": vb, "d": d, "hq": hq, "hkv": hkv,
            "ours_ms": 1e3 * t_ours, "bf16_sdpa_ms": 1e3 * t_bf16,
            "speedup_vs_bf16": t_bf16 / t_ours, "bytes_ours": bytes_ours,
            "bytes_bf16": bytes_bf16, "bytes_ratio": bytes_bf16 / bytes_ours,
            "ours_fraction_of_bandwidth": bytes_ours / t_ours / (bw * 1e9),
            "bf16_fraction_of_bandwidth": bytes_bf16 / t_bf16 / (bw * 1e9),
            "bits_per_element": 8 * (rbk + rbv + 8) / (2 * d)}


def write(res: dict) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "kv_gpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# Decode attention on {res['device']}", "",
             f"Copy bandwidth {res['copy_GBps']:.0f} GB/s. head_dim 128, 32 query / 8 KV heads.",
             "", "| batch | ctx | bits/elem | ours ms | BF16 SDPA ms | speedup | bytes ratio | "
             "ours of bandwidth | BF16 of bandwidth |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["steps"]:
        lines.append(f"| {r['batch']} | {r['ctx']:,} | {r['bits_per_element']:.2f} | "
                     f"{r['ours_ms']:.3f} | {r['bf16_sdpa_ms']:.3f} | "
                     f"{r['speedup_vs_bf16']:.2f}× | {r['bytes_ratio']:.2f} | "
                     f"{r['ours_fraction_of_bandwidth']:.2f} | "
                     f"{r['bf16_fraction_of_bandwidth']:.2f} |")
    lines += ["", "Reproduce: `python bench/kv_gpu.py`."]
    with open(os.path.join(RESULTS, "kv_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, nargs="+",
                    default=[4096, 16384, 65536, 131072, 1 << 20])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--kbits", type=int, default=3)
    ap.add_argument("--vbits", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kv_gpu.py needs a CUDA device")
    if "cuda" not in tqvec.available_backends():
        sys.exit(f"tqvec CUDA kernels unavailable: {tqvec.ops.cuda.unavailable_reason()}")
    if a.quick:
        a.ctx, a.batch, a.repeat = a.ctx[:1], a.batch[:1], 5
    from _machine import machine_info

    res = {"device": torch.cuda.get_device_properties(0).name, "machine": machine_info(),
           "copy_GBps": copy_bandwidth(a.repeat), "steps": []}
    for batch in a.batch:
        for ctx in a.ctx:
            r = step(batch, ctx, a.kbits, a.vbits, 128, 32, 8, a.repeat, res["copy_GBps"])
            if r is None:
                print(f"skip batch {batch} ctx {ctx}: does not fit", flush=True)
                continue
            print(json.dumps(r), flush=True)
            res["steps"].append(r)
            torch.cuda.empty_cache()
            write(res)
    write(res)


if __name__ == "__main__":
    main()
