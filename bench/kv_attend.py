"""The KV cache's attention call alone: ``tqvec.kv.attention.attend`` on one prepared layer of a
random SmolLM2-shaped Llama (9 query heads, 3 KV heads, d 64), one decode row, the README's
setting (3-bit keys and values, 8-bit window), one thread. Prints the minimum and the 25th
percentile over 30 batches of 200 calls, in microseconds per call.

    python bench/kv_attend.py [--context 100 1024]
    python bench/kv_attend.py --ab PYTHON_A PYTHON_B [--rounds 4] [--out kv_attend_ab]

``--ab`` runs the two installs in alternating processes (A B, then B A, ...) and writes
bench/results/<out>.{json,md} with the machine: the cost of a change to the step's Python
around the compiled kernel, which a whole decode step's timing hides in its noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(context: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import tqvec
    import tqvec.kv as kv
    from tqvec.kv import attention

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=256,
                      num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64)
    model = LlamaForCausalLM(cfg).eval()
    kv.register()
    model.config._attn_implementation = kv.ATTENTION_NAME
    ids = torch.randint(0, 256, (1, context + 4))
    cache = kv.TurboQuantCache(model.config, key_bits=3, value_bits=3, residual_bits=8)
    with torch.no_grad():
        model(ids[:, :context], cache=cache)
        for t in range(context, context + 4):
            model(ids[:, t:t + 1], cache=cache)
    layer = cache.layers[0]
    q = torch.randn(1, 9, 1, 64)
    per_call = []
    for _ in range(30):
        t0 = time.perf_counter()
        for _ in range(200):
            attention.attend(layer, q, None, 0.125)
        per_call.append((time.perf_counter() - t0) / 200 * 1e6)
    per_call.sort()
    return {"tqvec": tqvec.__file__, "context": context, "min_us": per_call[0],
            "p25_us": per_call[7]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, nargs="+", default=[100, 1024])
    ap.add_argument("--ab", nargs=2, metavar=("PYTHON_A", "PYTHON_B"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="kv_attend_ab")
    a = ap.parse_args(argv)
    if not a.ab:
        for c in a.context:
            print(json.dumps(measure(c)))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _machine import machine_info

    runs: dict = {"A": {}, "B": {}}
    for r in range(a.rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            py = a.ab[0] if side == "A" else a.ab[1]
            out = subprocess.run([py, __file__, "--context", *map(str, a.context)],
                                 capture_output=True, text=True, check=True)
            for line in out.stdout.strip().splitlines():
                res = json.loads(line)
                runs[side].setdefault(res["context"], []).append(res)
            print(f"round {r} {side}: {res['tqvec']}", flush=True)
    rows = []
    for c in a.context:
        row = {"context": c}
        for side in ("A", "B"):
            row[f"min_us_{side}"] = [round(x["min_us"], 1) for x in runs[side][c]]
            row[f"median_min_us_{side}"] = statistics.median(x["min_us"] for x in runs[side][c])
        row["ratio_B_over_A"] = row["median_min_us_B"] / row["median_min_us_A"]
        rows.append(row)
    report = {"machine": machine_info(), "rounds": a.rounds, "a": a.ab[0], "b": a.ab[1],
              "rows": rows}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", a.out)
    with open(path + ".json", "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"# A/B: {a.out}", "", f"Machine: {report['machine']}", "",
             f"`python bench/kv_attend.py --ab A B --rounds {a.rounds}`: `attend` on one "
             "prepared layer (SmolLM2 shape, k3 v3, 8-bit window, one decode row, one thread), "
             "minimum over 30 batches of 200 calls per process, the processes alternating.", "",
             "| context | A per round (us) | B per round (us) | median B / A |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context']} | {', '.join(map(str, r['min_us_A']))} | "
                     f"{', '.join(map(str, r['min_us_B']))} | {r['ratio_B_over_A']:.3f} |")
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
