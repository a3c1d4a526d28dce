"""One decode step's time and where it goes: DynamicCache against TurboQuantCache (3-bit keys
and values, residual_bits=8: the README's setting) after a prefill of CONTEXT tokens, median of
12 steps each, then cProfile of 8 more steps of the compressed cache (the 25 functions with the
most own time).

    python bench/kv_profile.py [smollm2|gemma3] [CONTEXT]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv as bench_kv  # noqa: E402  (bench/kv.py: models and text)

import tqvec.kv as kv  # noqa: E402


def main() -> None:
    from transformers import DynamicCache

    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    context = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    model, tok = bench_kv.load_model(name)
    ids = bench_kv.haystack(tok, context + 40)[None, :context + 32]
    for label, settings in [("DynamicCache", None),
                            ("TurboQuantCache k3 v3 r8", dict(key_bits=3, value_bits=3,
                                                              residual_bits=8))]:
        model.config._attn_implementation = "sdpa"
        cache = (DynamicCache(config=model.config) if settings is None
                 else kv.TurboQuantCache(model.config, **settings))
        with torch.no_grad():
            model(ids[:, :context], past_key_values=cache)
            steps = []
            for t in range(context, context + 12):
                t0 = time.perf_counter()
                model(ids[:, t:t + 1], past_key_values=cache)
                steps.append(time.perf_counter() - t0)
            steps.sort()
            print(f"{name} {context} {label}: decode {1000 * steps[len(steps) // 2]:.1f} ms/token "
                  f"(median of 12)", flush=True)
            if settings is not None:
                prof = cProfile.Profile()
                prof.enable()
                for t in range(context + 12, context + 20):
                    model(ids[:, t:t + 1], past_key_values=cache)
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
