"""Where a decode step's time goes: DynamicCache against TurboQuantCache (3-bit keys and
values, residual_bits=8: the README's setting) after a prefill of CONTEXT tokens.

Both caches are prefilled in one process, then decode steps alternate between them (STEPS of
each, a multiple of the compressed cache's window cycle, bench/kv.py CYCLE). Timers around the
functions a step spends its cache work in give their time per step: ``DynamicLayer.update``
and SDPA for ``DynamicCache``; ``CompressedLayer.update``, the compiled attention
(``attend``) and the compiled call inside it (``attention_step_np``), the window's moves into
codes (``flush``) and the whole "tqvec" attention function for ours. The timers add a few
microseconds per call to both. ``--cprofile`` adds cProfile's 25 functions with the most own
time over 16 more steps of the compressed cache.

    python bench/kv_profile.py [smollm2|gemma3] [CONTEXT] [--steps 128] [--dtype float32]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv as bench_kv  # noqa: E402  (bench/kv.py: models and text)

import tqvec.kv as kv  # noqa: E402
from tqvec.kv import attention as kv_attention  # noqa: E402
from tqvec.kv import layer as kv_layer  # noqa: E402
from tqvec.ops import cpu as ops_cpu  # noqa: E402

SETTINGS = dict(key_bits=3, value_bits=3, residual_bits=8)


def _timed(spent: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
    return wrapper


def main() -> None:
    from _machine import machine_info  # bench/_machine.py
    from transformers import AttentionInterface, DynamicCache
    from transformers.cache_utils import DynamicLayer
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tqvec._machine import cpu_label

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2", choices=["smollm2", "gemma3"])
    ap.add_argument("context", nargs="?", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=bench_kv.DTYPES)
    ap.add_argument("--cprofile", action="store_true")
    a = ap.parse_args()
    steps = max(bench_kv.CYCLE, a.steps // bench_kv.CYCLE * bench_kv.CYCLE)
    model, tok = bench_kv.load_model(a.model, getattr(torch, a.dtype))
    n = a.context + bench_kv.CYCLE + steps + 16
    ids = bench_kv.haystack(tok, n + 8)[None, :n]

    spent: dict[str, float] = {}
    # the functions a step's cache work runs in, timed (patched for this process only)
    DynamicLayer.update = _timed(spent, "DynamicCache update", DynamicLayer.update)
    kv_layer.CompressedLayer.update = _timed(spent, "ours: update",
                                             kv_layer.CompressedLayer.update)
    kv_layer.CompressedLayer.flush = _timed(spent, "ours: window moves (flush)",
                                            kv_layer.CompressedLayer.flush)
    kv_attention.attend = _timed(spent, "ours: compiled attention (attend)", kv_attention.attend)
    # the compiled call alone (csrc/cpu/attention.cpp's step, its numpy arguments made): what
    # attend spends beyond it is Python
    ops_cpu.attention_step_np = _timed(spent, "ours: compiled attention: the compiled call",
                                       ops_cpu.attention_step_np)
    AttentionInterface.register("sdpa", _timed(spent, "DynamicCache SDPA",
                                               ALL_ATTENTION_FUNCTIONS["sdpa"]))
    # the cache registers its attention function when built: the timed one, from here on
    kv_attention.tqvec_attention = _timed(spent, "ours: attention function (all of it)",
                                          kv_attention.tqvec_attention)

    caches = {}
    with torch.no_grad():
        for label in ("DynamicCache", "TurboQuantCache k3 v3 r8"):
            model.config._attn_implementation = "sdpa"
            cache = (DynamicCache(config=model.config) if label == "DynamicCache"
                     else kv.TurboQuantCache(model.config, **SETTINGS))
            model(ids[:, :a.context], cache=cache)
            for t in range(a.context, a.context + bench_kv.CYCLE):  # one window cycle
                model(ids[:, t:t + 1], cache=cache)
            caches[label] = (cache, model.config._attn_implementation)
        spent.clear()
        times: dict[str, list[float]] = {label: [] for label in caches}
        start = a.context + bench_kv.CYCLE
        for t in range(start, start + steps):
            for label, (cache, impl) in caches.items():
                model.config._attn_implementation = impl
                t0 = time.perf_counter()
                model(ids[:, t:t + 1], cache=cache)
                times[label].append(time.perf_counter() - t0)

    machine = machine_info()
    print(f"# python bench/kv_profile.py {a.model} {a.context} --steps {steps} --dtype {a.dtype}"
          f"; machine: {cpu_label(machine)}, SIMD flags {', '.join(machine.get('simd', []))}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{a.model} {a.dtype}, {a.context} tokens, {steps} decode steps alternating")
    for label, ts in times.items():
        print(f"  {label}: step mean {1000 * statistics.mean(ts):.1f} ms, "
              f"median {1000 * statistics.median(ts):.1f} ms")
    dyn, ours = (statistics.mean(ts) for ts in times.values())
    print(f"  ours vs DynamicCache: {dyn / ours:.2f}x the speed (means)")
    for key in sorted(spent):
        print(f"  {key}: {1000 * spent[key] / steps:.2f} ms per step")

    if a.cprofile:
        cache, impl = caches["TurboQuantCache k3 v3 r8"]
        model.config._attn_implementation = impl
        prof = cProfile.Profile()
        with torch.no_grad():
            prof.enable()
            for t in range(start + steps, start + steps + 16):
                model(ids[:, t:t + 1], cache=cache)
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
