"""The CPU decode-attention kernel alone (``ops.decode_attention``: TurboQuant-mse keys and values,
csrc/cpu/attention.cpp) on random codes, d = 64, 3-bit keys and values: median of 30 calls at 1
and 2 threads for three shapes (3 KV heads x 3 query rows as SmolLM2, 4,096 and 16,384 tokens;
1 KV head x 4 rows as Gemma 3). Writes bench/results/kv_kernel.json.

    python bench/kv_kernel.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info  # noqa: E402

from tqvec import ops  # noqa: E402

SHAPES = [(3, 3, 4096), (3, 3, 16384), (1, 4, 4096)]  # (KV heads, rows per head, tokens)


def main() -> None:
    rng = np.random.default_rng(0)
    d, kb, vb = 64, 3, 3
    rows = []
    for bh, g, t in SHAPES:
        qr, qb = torch.randn(bh, g, d), torch.zeros(bh, g)
        kp = torch.from_numpy(rng.integers(0, 256, (bh, t, d * kb // 8), dtype=np.uint8))
        vp = torch.from_numpy(rng.integers(0, 256, (bh, t, d * vb // 8), dtype=np.uint8))
        kn, vn = torch.rand(bh, t), torch.rand(bh, t)
        kc, vc = torch.sort(torch.randn(1 << kb)).values, torch.sort(torch.randn(1 << vb)).values
        lo = torch.zeros(bh, dtype=torch.int32)
        hi = torch.full((bh,), t, dtype=torch.int32)
        for threads in (1, 2):
            torch.set_num_threads(threads)

            args = (qr, qb, kp, kn, kc, kb, vp, vn, vc, vb, lo, hi, 0.125)
            ops.decode_attention(*args)
            times = []
            for _ in range(30):
                t0 = time.perf_counter()
                ops.decode_attention(*args)
                times.append(time.perf_counter() - t0)
            times.sort()
            row = {"kv_heads": bh, "rows": g, "tokens": t, "threads": threads,
                   "ms_median": 1000 * times[len(times) // 2]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = Path(__file__).resolve().parent / "results" / "kv_kernel.json"
    out.write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
