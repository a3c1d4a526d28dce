"""GPU decode-attention benchmark: one layer's decode step over compressed keys and
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

With --e2e it also times whole decode steps through the transformers adapter: a randomly
initialised Llama (16 layers, width 2,048, head_dim 128, 16 query / 4 KV heads; random weights
decode as fast as trained ones and need no download) in each --e2e-dtype (BF16 by default),
prefilled to --e2e-ctx tokens, then --e2e-steps decode steps alternating between a
``DynamicCache`` and a ``TurboQuantCache`` in the README's recommended setting (3/3 bits, a
32-token window of 8-bit codes, 4 sink tokens), each step timed from a synchronized start to a
synchronized end; and the GPU memory each cache holds after the prefill (allocated bytes it
added) beside the bytes of its tensors. ``--e2e-sdpa cudnn no-cudnn`` times ``DynamicCache``
with torch's default SDPA backends (cuDNN first) and without cuDNN (flash / memory-efficient).

Writes bench/results/kv_gpu.json and kv_gpu.md (``--out NAME``: NAME.json / NAME.md) with the
device name; ``--e2e-only`` skips the kernel rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _gpu import copy_bandwidth, cuda_time, graph_time  # noqa: E402

import tqvec  # noqa: E402
from tqvec import ops  # noqa: E402
from tqvec.ops import cuda as cuda_ops  # noqa: E402

RESULTS = os.path.join(HERE, "results")
#: tq_decode_attention launch shapes timed per row (warps per block, blocks per SM, Q in
#: registers); the first is the library's default
LAUNCHES = [(8, 1, False), (4, 2, False), (4, 1, True), (4, 2, True), (8, 1, True)]


def launch_name(shape) -> str:
    return f"{shape[0]}x{shape[1]}{'q' if shape[2] else ''}"


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

    def kernel():
        return ops.decode_attention(qr0, qbias, kp, kn, kc, kb, vp, vn, vc, vb, lo, hi, scale,
                                    backend="cuda")

    qr0 = kcodec.rotate(q.reshape(batch * hq, d).float()).reshape(bh, g, d)
    # the kernel's launch shapes (warps per block, blocks per SM), each timed alone
    launches = {}
    default = cuda_ops.ATTENTION_LAUNCH
    for shape in LAUNCHES:
        cuda_ops.ATTENTION_LAUNCH = shape
        launches[launch_name(shape)] = 1e3 * cuda_time(kernel, repeat)
    cuda_ops.ATTENTION_LAUNCH = default
    t_ours = cuda_time(ours, repeat)
    t_bf16 = cuda_time(bf16, repeat)
    g_ours, g_bf16 = graph_time(ours, repeat), graph_time(bf16, repeat)
    bytes_ours = bh * ctx * (rbk + rbv + 8)
    bytes_bf16 = bh * ctx * 2 * d * 2
    t_kernel = launches[launch_name(default)] / 1e3
    return {"batch": batch, "ctx": ctx, "kbits": kb, "vbits": vb, "d": d, "hq": hq, "hkv": hkv,
            "ours_ms": 1e3 * t_ours, "bf16_sdpa_ms": 1e3 * t_bf16,
            "speedup_vs_bf16": t_bf16 / t_ours,
            "ours_graph_ms": 1e3 * g_ours if g_ours else None,
            "bf16_graph_ms": 1e3 * g_bf16 if g_bf16 else None,
            "speedup_vs_bf16_graph": g_bf16 / g_ours if g_ours and g_bf16 else None,
            "kernel_ms": 1e3 * t_kernel, "kernel_ms_by_launch": launches,
            "bytes_ours": bytes_ours,
            "bytes_bf16": bytes_bf16, "bytes_ratio": bytes_bf16 / bytes_ours,
            "ours_fraction_of_bandwidth": bytes_ours / t_ours / (bw * 1e9),
            "kernel_fraction_of_bandwidth": bytes_ours / t_kernel / (bw * 1e9),
            "bf16_fraction_of_bandwidth": bytes_bf16 / t_bf16 / (bw * 1e9),
            "bits_per_element": 8 * (rbk + rbv + 8) / (2 * d)}


E2E_CACHE = dict(key_bits=3, value_bits=3, residual_length=32, sink_length=4, residual_bits=8)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _e2e_model(tokens: int, batch: int, device: str, dtype: torch.dtype = torch.bfloat16):
    """(config, model, ids, sync) of the end-to-end runs: a randomly initialised Llama in
    ``dtype`` and ``tokens`` random ids per batch row."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                      max_position_embeddings=tokens + 8)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens),
                        generator=torch.Generator().manual_seed(1)).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return cfg, model, ids, sync


def _e2e_cache(model, cfg, name: str, ids: torch.Tensor, ctx: int):
    """(cache, attention implementation it runs with): a ``DynamicCache`` or a
    ``TurboQuantCache`` (E2E_CACHE) prefilled with the first ``ctx`` ids, 4,096 at a time."""
    from transformers import DynamicCache

    from tqvec import kv

    model.config._attn_implementation = "sdpa"
    cache = (DynamicCache(config=cfg) if name == "DynamicCache"
             else kv.TurboQuantCache(cfg, **E2E_CACHE))
    for a in range(0, ctx, 4096):
        model(ids[:, a:min(ctx, a + 4096)], cache=cache, logits_to_keep=1)
    return cache, model.config._attn_implementation


def _tensor_bytes(cache) -> int:
    """Bytes of the tensors a cache holds: ``memory_bytes()`` where it counts them itself, else
    every layer's keys and values."""
    if hasattr(cache, "memory_bytes"):
        return cache.memory_bytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized
               for t in (layer.keys, layer.values))


def e2e(ctx: int, batch: int, steps: int, device: str = "cuda",
        dtype: torch.dtype = torch.bfloat16) -> dict:
    """Decode ms/step of a model in ``dtype`` through ``DynamicCache`` and ``TurboQuantCache``,
    and the device memory each cache holds."""
    cfg, model, ids, sync = _e2e_model(ctx + steps, batch, device, dtype)
    caches, impl, last, held, peak = {}, {}, {}, {}, {}
    with torch.no_grad():
        for name in ("DynamicCache", "TurboQuantCache"):
            gc.collect()  # what earlier rows left in reference cycles is freed now, not
            sync()        # in the middle of this cache's measurement
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            caches[name], impl[name] = _e2e_cache(model, cfg, name, ids, ctx)
            sync()
            held[name] = torch.cuda.memory_allocated() - base
            peak[name] = torch.cuda.max_memory_allocated() - base
        times = {name: [] for name in caches}
        names = list(caches)
        for i, t in enumerate(range(ctx, ctx + steps)):
            for name in names[i % 2:] + names[:i % 2]:
                model.config._attn_implementation = impl[name]
                sync()
                t0 = time.perf_counter()
                out = model(ids[:, t:t + 1], cache=caches[name], logits_to_keep=1)
                sync()
                times[name].append(time.perf_counter() - t0)
                last[name] = out.logits.float()
    med = {name: statistics.median(ts[2:]) for name, ts in times.items()}  # 2 warm-up steps
    ref, got = last["DynamicCache"], last["TurboQuantCache"]
    return {"ctx": ctx, "batch": batch, "steps": steps, "cache": E2E_CACHE,
            "dtype": str(dtype).removeprefix("torch."),
            "cudnn_sdpa": torch.backends.cuda.cudnn_sdp_enabled(),
            "dynamic_held_MB": held["DynamicCache"] / 1e6,
            "ours_held_MB": held["TurboQuantCache"] / 1e6,
            "dynamic_tensor_MB": _tensor_bytes(caches["DynamicCache"]) / 1e6,
            "ours_tensor_MB": _tensor_bytes(caches["TurboQuantCache"]) / 1e6,
            "dynamic_prefill_peak_MB": peak["DynamicCache"] / 1e6,
            "ours_prefill_peak_MB": peak["TurboQuantCache"] / 1e6,
            "dynamic_ms": 1e3 * med["DynamicCache"], "ours_ms": 1e3 * med["TurboQuantCache"],
            "speedup_vs_dynamic": med["DynamicCache"] / med["TurboQuantCache"],
            "tokens_per_s_dynamic": batch / med["DynamicCache"],
            "tokens_per_s_ours": batch / med["TurboQuantCache"],
            "last_logits_rel_diff": float((got - ref).norm() / ref.norm()),
            "bits_per_element": caches["TurboQuantCache"].bits_per_element()}


def e2e_profile(ctx: int, batch: int, device: str = "cuda") -> None:
    """Where a decode step's time goes, per cache: torch.profiler over 3 steps after 2 warm-up
    steps (printed: wall ms per step and the top operators by CPU and by CUDA time)."""
    from torch.profiler import ProfilerActivity, profile

    cfg, model, ids, sync = _e2e_model(ctx + 5, batch, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.no_grad():
        for name in ("DynamicCache", "TurboQuantCache"):
            cache, model.config._attn_implementation = _e2e_cache(model, cfg, name, ids, ctx)
            walls = []
            for t in range(ctx, ctx + 2):
                model(ids[:, t:t + 1], cache=cache, logits_to_keep=1)
            sync()
            with profile(activities=acts) as prof:
                for t in range(ctx + 2, ctx + 5):
                    t0 = time.perf_counter()
                    model(ids[:, t:t + 1], cache=cache, logits_to_keep=1)
                    sync()
                    walls.append(1e3 * (time.perf_counter() - t0))
            print(f"== {name}: batch {batch}, ctx {ctx}: step wall ms {walls}", flush=True)
            ka = prof.key_averages()
            print(ka.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60),
                  flush=True)
            if device == "cuda":
                print(ka.table(sort_by="cuda_time_total", row_limit=8,
                               max_name_column_width=60), flush=True)


def write(res: dict, out: str = "kv_gpu") -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{out}.json"), "w") as f:
        json.dump(res, f, indent=1)
    if not res["steps"]:
        _write_md([f"# Decode steps end to end on {res['device']}"], res, out)
        return
    lines = [f"# Decode attention on {res['device']}", "",
             f"Copy bandwidth {res['copy_GBps']:.0f} GB/s. head_dim 128, 32 query / 8 KV heads. "
             "Ours: the query's rotation, the kernel over the codes, the merge of its partials "
             "and the output's inverse rotation; kernel: ops.decode_attention alone. Graph: the "
             "same step captured as a CUDA graph (no launch overhead), for both.", "",
             "| batch | ctx | bits/elem | ours ms | BF16 SDPA ms | speedup | ours graph ms | "
             "BF16 graph ms | speedup (graphs) | kernel ms | kernel of bandwidth | "
             "BF16 of bandwidth | bytes ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt):
        return "–" if v is None else format(v, fmt)
    for r in res["steps"]:
        lines.append(f"| {r['batch']} | {r['ctx']:,} | {r['bits_per_element']:.2f} | "
                     f"{r['ours_ms']:.3f} | {r['bf16_sdpa_ms']:.3f} | "
                     f"{r['speedup_vs_bf16']:.2f}× | {f(r.get('ours_graph_ms'), '.3f')} | "
                     f"{f(r.get('bf16_graph_ms'), '.3f')} | "
                     f"{f(r.get('speedup_vs_bf16_graph'), '.2f')}× | {r['kernel_ms']:.3f} | "
                     f"{r['kernel_fraction_of_bandwidth']:.2f} | "
                     f"{r['bf16_fraction_of_bandwidth']:.2f} | {r['bytes_ratio']:.2f} |")
    if res.get("launch_note"):
        lines += ["", f"Note: {res['launch_note']}."]
    shapes = sorted({k for r in res["steps"] for k in r.get("kernel_ms_by_launch", {})})
    if shapes:
        lines += ["", "Kernel ms by launch shape (warps per block x blocks per SM; q: the "
                  "query's fragments in registers):", "",
                  "| batch | ctx | " + " | ".join(shapes) + " |",
                  "|---|---|" + "---|" * len(shapes)]
        for r in res["steps"]:
            by = r.get("kernel_ms_by_launch", {})
            lines.append(f"| {r['batch']} | {r['ctx']:,} | "
                         + " | ".join(f(by.get(k), ".3f") for k in shapes) + " |")
    _write_md(lines, res, out)


def _write_md(lines: list[str], res: dict, out: str) -> None:
    """The end-to-end section (if any) after ``lines``, then the file."""
    if res.get("e2e"):
        cache_args = ", ".join(f"{k}={v}" for k, v in res["e2e"][0]["cache"].items())
        lines += ["", "## End to end through the transformers adapter", "",
                  "Llama with random weights (16 layers, width 2,048, head_dim 128, 16 / 4 "
                  f"heads); ours: `TurboQuantCache({cache_args})`. Median ms per decode step, "
                  "alternating caches. Held MB: device memory allocated by building and "
                  "prefilling the cache (its tensors' bytes in brackets); peak: the most "
                  "allocated above the start during the prefill. SDPA: torch's cuDNN attention "
                  "on (its default; transformers' DynamicCache then plans anew each step) or "
                  "off (`--e2e-sdpa no-cudnn`: flash / memory-efficient attention, the faster "
                  "baseline). The logits' difference is a "
                  "sanity check only (random weights say nothing of quality)."
                  + (f" Note: {res['e2e_note']}." if res.get("e2e_note") else ""), "",
                  "| dtype | SDPA | batch | ctx | DynamicCache ms | ours ms | speedup | "
                  "tokens/s ours | held MB Dynamic | held MB ours | peak MB Dynamic / ours | "
                  "bits/elem | logits rel. diff |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

        def mb(r, side):
            if f"{side}_held_MB" not in r:
                return "–"
            return f"{r[f'{side}_held_MB']:,.1f} ({r[f'{side}_tensor_MB']:,.1f})"
        for r in res["e2e"]:
            peak = (f"{r['dynamic_prefill_peak_MB']:,.0f} / {r['ours_prefill_peak_MB']:,.0f}"
                    if "ours_prefill_peak_MB" in r else "–")
            sdpa = "cuDNN" if r.get("cudnn_sdpa", True) else "no cuDNN"
            lines.append(f"| {r.get('dtype', 'bfloat16')} | {sdpa} | {r['batch']} | "
                         f"{r['ctx']:,} | "
                         f"{r['dynamic_ms']:.2f} | {r['ours_ms']:.2f} | "
                         f"{r['speedup_vs_dynamic']:.2f}× | {r['tokens_per_s_ours']:.0f} | "
                         f"{mb(r, 'dynamic')} | {mb(r, 'ours')} | {peak} | "
                         f"{r['bits_per_element']:.2f} | {r['last_logits_rel_diff']:.3f} |")
    lines += ["", f"Reproduce: `{res.get('command', 'python bench/kv_gpu.py --e2e')}`."]
    with open(os.path.join(RESULTS, f"{out}.md"), "w") as f:
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
    ap.add_argument("--e2e", action="store_true", help="also time decode steps end to end")
    ap.add_argument("--e2e-ctx", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--e2e-batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--e2e-steps", type=int, default=24)
    ap.add_argument("--e2e-dtype", nargs="+", default=["bfloat16"], choices=list(DTYPES))
    ap.add_argument("--e2e-only", action="store_true", help="skip the kernel rows")
    ap.add_argument("--e2e-sdpa", nargs="+", default=["cudnn"], choices=["cudnn", "no-cudnn"],
                    help="SDPA with torch's default backends (cuDNN first) and/or without cuDNN")
    ap.add_argument("--out", default="kv_gpu", help="result file name (without extension)")
    ap.add_argument("--e2e-profile", action="store_true",
                    help="only profile one decode step per cache (batch 1, the first --e2e-ctx)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kv_gpu.py needs a CUDA device")
    if "cuda" not in tqvec.available_backends():
        sys.exit(f"tqvec CUDA kernels unavailable: {tqvec.ops.cuda.unavailable_reason()}")
    if a.e2e_profile:
        e2e_profile(a.e2e_ctx[0], 1)
        return
    if a.quick:
        a.ctx, a.batch, a.repeat = a.ctx[:1], a.batch[:1], 5
    from _machine import machine_info

    res = {"device": torch.cuda.get_device_properties(0).name, "machine": machine_info(),
           "copy_GBps": copy_bandwidth(a.repeat), "steps": [],
           "command": " ".join(["python bench/kv_gpu.py"] + sys.argv[1:])}
    if a.e2e_only:
        a.e2e, a.batch = True, []
    for batch in a.batch:
        for ctx in a.ctx:
            try:  # report a failing row and go on with the others
                r = step(batch, ctx, a.kbits, a.vbits, 128, 32, 8, a.repeat, res["copy_GBps"])
            except Exception:
                traceback.print_exc()
                cuda_ops.ATTENTION_LAUNCH = LAUNCHES[0]
                continue
            if r is None:
                print(f"skip batch {batch} ctx {ctx}: does not fit", flush=True)
                continue
            print(json.dumps(r), flush=True)
            res["steps"].append(r)
            torch.cuda.empty_cache()
            write(res, a.out)
    if a.e2e:
        res["e2e"] = []
        rows = [(sdpa, dtype, batch, ctx) for sdpa in a.e2e_sdpa for dtype in a.e2e_dtype
                for batch in a.e2e_batch for ctx in a.e2e_ctx]
        for sdpa, dtype, batch, ctx in rows:
            torch.backends.cuda.enable_cudnn_sdp(sdpa == "cudnn")
            try:
                r = e2e(ctx, batch, a.e2e_steps, dtype=DTYPES[dtype])
            except Exception:  # report and go on: the other rows stand on their own
                traceback.print_exc()
                continue
            print(json.dumps(r), flush=True)
            res["e2e"].append(r)
            torch.cuda.empty_cache()
            write(res, a.out)
    write(res, a.out)


if __name__ == "__main__":
    main()
