"""Forwards of many new tokens over a compressed cache (a chunked prefill, a later turn's
prompt): the two attention routes of ``tqvec.kv.attention`` side by side - scoring every
(query, token) pair from the codes, or decoding the stored tokens once and running SDPA
(``DECODED_FROM``) - and a chunked prefill against ``DynamicCache``.

    python bench/kv_rows.py [--models smollm2 gemma3] [--context 4096]

Crossover: after a ``--context``-token prefill (2,048-token chunks), forwards of Q tokens,
the two routes alternating on the same cache (it grows by Q each time), minimum of 3 per
route. Chunks: an 8,192-token prompt in two 4,096-token forwards with the compressed cache
on each route and with ``DynamicCache`` (Gemma 3). ``tq-k3v3-w8`` settings, fp32. Writes
bench/results/kv_rows.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv  # noqa: E402
from _machine import machine_info  # noqa: E402

from tqvec._machine import cpu_label  # noqa: E402
from tqvec.kv import attention  # noqa: E402

ROWS = (1, 4, 16, 64, 128, 256)
DEFAULT_FROM = attention.DECODED_FROM  # the library's threshold (the crossover changes it)
ROUTES = (("codes", 0), ("decoded", 1))


def crossover(name: str, context: int) -> list[dict]:
    model, tok = kv.load_model(name)
    ids = kv.haystack(tok, context + 3 * 2 * sum(ROWS)).reshape(1, -1)
    cache = kv.new_cache(model.config, kv.method(name, model.config.head_dim, "tq-k3v3-w8"))
    out, pos = [], context
    with torch.no_grad():
        for a in range(0, context, 2048):
            model(ids[:, a:min(context, a + 2048)], cache=cache, logits_to_keep=1)
        for q in ROWS:
            ms: dict[str, list[float]] = {}
            for route, threshold in ROUTES * 3:
                attention.DECODED_FROM = threshold
                t = time.perf_counter()
                model(ids[:, pos:pos + q], cache=cache, logits_to_keep=1)
                ms.setdefault(route, []).append(1e3 * (time.perf_counter() - t))
                pos += q
            row = {"model": name, "context": context, "rows": q,
                   **{f"{r}_ms": min(v) for r, v in ms.items()}}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def chunks(name: str = "gemma3", n: int = 8192, chunk: int = 4096) -> list[dict]:
    model, tok = kv.load_model(name)
    ids = kv.haystack(tok, n).reshape(1, -1)
    out = []
    with torch.no_grad():
        for label, threshold in (("compressed, decoded route", DEFAULT_FROM),
                                 ("compressed, codes route", 0), ("DynamicCache", None)):
            model.config._attn_implementation = "sdpa"
            st = None if threshold is None else kv.method(name, model.config.head_dim,
                                                          "tq-k3v3-w8")
            cache = kv.new_cache(model.config, st)
            if threshold is not None:
                attention.DECODED_FROM = threshold
            s = []
            for a in range(0, n, chunk):
                t = time.perf_counter()
                model(ids[:, a:a + chunk], cache=cache, logits_to_keep=1)
                s.append(time.perf_counter() - t)
            row = {"model": name, "tokens": n, "chunk": chunk, "cache": label, "chunk_s": s}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def markdown(res: dict) -> str:
    lines = ["# Many-row forwards over a compressed cache", "",
             f"Command: `{' '.join(['python bench/kv_rows.py', *res['argv']])}`. Machine: "
             f"{cpu_label(res['machine'])}, SIMD {', '.join(res['machine'].get('simd', []))}, "
             f"{res['machine'].get('torch_threads')} torch threads.", "",
             "Forwards of Q tokens after the prefill, ms (minimum of 3, routes alternating):",
             "", "| model | context | Q | codes | decoded + SDPA | decoded / codes |",
             "|---|---|---|---|---|---|"]
    for r in res["crossover"]:
        lines.append(f"| {r['model']} | {r['context']} | {r['rows']} | {r['codes_ms']:.0f} | "
                     f"{r['decoded_ms']:.0f} | {r['decoded_ms'] / r['codes_ms']:.2f} |")
    lines += ["", "Chunked prefill, seconds per chunk:", "", "| model | tokens | chunk | cache | "
              "seconds per chunk |", "|---|---|---|---|---|"]
    for r in res["chunks"]:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['chunk']} | {r['cache']} | "
                     + " / ".join(f"{x:.1f}" for x in r["chunk_s"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args(argv)
    res = {"machine": machine_info(), "argv": sys.argv[1:] if argv is None else argv,
           "crossover": [r for m in args.models for r in crossover(m, args.context)],
           "chunks": chunks()}
    out = Path(__file__).resolve().parent / "results"
    (out / "kv_rows.json").write_text(json.dumps(res, indent=1))
    (out / "kv_rows.md").write_text(markdown(res))


if __name__ == "__main__":
    main()
