"""Resident memory of an index after add and after its first search, against what it must hold:
its codes, ids and per-vector scalars (``code_size`` bytes per vector + 8 for the id).

    python bench/memory.py [--n 1000000] [--d 384] [--spec TQ4 ...] [--out NAME]

Each spec runs in fresh processes (so one index's freed pages do not hide another's): the
vectors are made first, then RSS (``VmRSS``, after ``malloc_trim``) is read before the index,
after ``add`` and after one search; the index's share is the growth. It runs at n and at n / 2:
the growth between the two, per added vector, is the index's memory per vector without the
fixed costs (the codec's tables, torch's and the kernels' buffers). Writes
bench/results/<out>.{json,md} with the machine. A test-free measurement: the numbers depend on
the allocator and the machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys

SPECS = ["TQ1", "TQ2", "TQ4", "TQprod3", "QJL384", "TQ4,Prefilter(10)", "Center,TQ2f",
         "TQ2,Refine(TQ8g)", "PCA,TQ2", "IVF1024,TQ4"]


def _rss() -> int:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def worker(spec: str, n: int, d: int) -> dict:
    import numpy as np
    import torch

    import tqvec

    torch.manual_seed(0)
    x = np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)
    q = x[:5].copy()
    index = tqvec.index_factory(d, spec, "l2")
    if not index.is_trained:
        index.train(x[: min(n, 100_000)])
    before = _rss()
    for s in range(0, n, 100_000):
        index.add(x[s: s + 100_000])
    added = _rss()
    index.search(q, 10)
    searched = _rss()
    need = n * (index.code_size + 8)  # codes + side information + ids
    return {"spec": spec, "n": n, "d": d, "code_size": index.code_size, "held_bytes": need,
            "after_add": added - before, "after_search": searched - before,
            "ratio_after_add": (added - before) / need,
            "ratio_after_search": (searched - before) / need}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--spec", nargs="*", default=SPECS)
    ap.add_argument("--out", default="memory")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a.n, a.d)))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _machine import machine_info

    rows = []
    for spec in a.spec:
        runs = []
        for n in (a.n // 2, a.n):
            out = subprocess.run([sys.executable, __file__, "--worker", spec, "--n", str(n),
                                  "--d", str(a.d)], capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        half, r = runs
        per = (r["held_bytes"] - half["held_bytes"]) / (r["n"] - half["n"])
        for key in ("after_add", "after_search"):
            r[f"marginal_{key}"] = (r[key] - half[key]) / (r["n"] - half["n"]) / per
        rows.append(r)
        print(f"{spec}: {r['ratio_after_add']:.2f} / {r['ratio_after_search']:.2f} (marginal "
              f"{r['marginal_after_add']:.2f} / {r['marginal_after_search']:.2f}) after add / "
              f"the first search", flush=True)
    report = {"machine": machine_info(), "n": a.n, "d": a.d, "rows": rows}
    path = os.path.join("bench", "results", a.out)
    with open(path + ".json", "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"# Resident memory: {a.out}", "", f"Machine: {report['machine']}", "",
             f"`python bench/memory.py --n {a.n} --d {a.d}`: RSS growth of a fresh process over "
             "its vectors (malloc_trim'd), in units of what the index must hold (n x (code_size "
             "+ 8 bytes of id)); marginal: the growth from n / 2 to n vectors per vector, in the "
             "same units (without fixed costs).", "",
             "| index | bytes/vector | held MB | after add | after first search | marginal "
             "after add | marginal after first search |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['spec']} | {r['code_size']} | {r['held_bytes'] / 2**20:.0f} | "
                     f"{r['ratio_after_add']:.2f} | {r['ratio_after_search']:.2f} | "
                     f"{r['marginal_after_add']:.2f} | {r['marginal_after_search']:.2f} |")
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
