"""The CPU kernels' vector paths side by side on this host: the same indexes searched under each
``TQVEC_SIMD`` setting the CPU supports, one process per path (the setting is read once per
process).

    python bench/simd_paths.py [--dataset minilm-384-angular] [--specs "TQ3" "IVF256,TQ4" ...]

Paths: the default (AVX2, plus AVX-512 VBMI for 3-bit scans and VNNI for batched 4-bit scans
where the CPU has them), ``avx2`` (AVX2 alone), ``avx512`` (AVX-512 table lookups at 1, 2 and 4
bits too). Every path returns the same results (the tests check it bit for bit); this measures
what each costs: recall@10 (equal across paths), batch QPS (1,000 queries per call, best of up
to 3 calls) and single-query QPS at k = 10, at one thread unless ``--threads`` says otherwise.
IVF indexes search with ``--nprobe`` lists. Writes bench/results/simd_paths_<dataset>.{json,md}
with the machine (CPU model, SIMD flags) - a ratio from one host is no claim about another.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info  # noqa: E402

from tqvec._machine import cpu_label  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PATHS = ["", "avx2", "avx512"]  # "" = the default choice
DEFAULT_SPECS = ["TQ2,Prefilter(10)", "TQ3", "TQ3,Prefilter(10)", "TQ4", "TQ4,Prefilter(10)",
                 "IVF256,TQ3", "IVF256,TQ4"]


def measure(a) -> list[dict]:
    """Every spec under this process's TQVEC_SIMD."""
    import torch

    import tqvec
    from tqvec import ops
    from tqvec.benchmark import best_time, recall
    from tqvec.datasets import load_ann

    torch.set_num_threads(a.threads)
    ds = load_ann(a.dataset)
    xb = np.ascontiguousarray(ds["train"], dtype=np.float32)
    xq = np.ascontiguousarray(ds["test"][: a.nq], dtype=np.float32)
    metric = "l2" if str(ds["distance"]) == "euclidean" else "cosine"
    gt = np.asarray(ds["neighbors"][: a.nq])
    rows = []
    for spec in a.specs:
        index = tqvec.index_factory(xb.shape[1], spec, metric)
        if not index.is_trained:
            index.train(xb)
        index.add(xb)
        if spec.startswith("IVF"):
            index.nprobe = a.nprobe
        _, ids = index.search(xq, 10)
        batch = len(xq) / best_time(lambda index=index: index.search(xq, 10))
        index.search(xq[:1], 10)

        def one_by_one(index=index):
            for i in range(a.single):
                index.search(xq[i:i + 1], 10)

        single = a.single / best_time(one_by_one)
        rows.append({"spec": spec, "path": ops.simd_path(),
                     "request": os.environ.get("TQVEC_SIMD", ""),
                     "recall@10": float(recall(ids, gt, 10)), "qps_batch": batch,
                     "qps_single": single})
        print(f"{ops.simd_path():15s} {spec:22s} R@10 {rows[-1]['recall@10']:.3f}  "
              f"batch {batch:9,.0f}  single {single:7,.0f}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="minilm-384-angular")
    ap.add_argument("--specs", nargs="+", default=DEFAULT_SPECS)
    ap.add_argument("--nq", type=int, default=1000)
    ap.add_argument("--single", type=int, default=200)
    ap.add_argument("--nprobe", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows-out", help=argparse.SUPPRESS)  # a child process's rows (JSON)
    a = ap.parse_args(argv)
    if a.rows_out:
        Path(a.rows_out).write_text(json.dumps(measure(a)))
        return 0
    rows = []
    for path in PATHS:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            subprocess.run([sys.executable, __file__, "--dataset", a.dataset, "--specs",
                            *a.specs, "--nq", str(a.nq), "--single", str(a.single), "--nprobe",
                            str(a.nprobe), "--threads", str(a.threads), "--rows-out", str(out)],
                           env={**os.environ, "TQVEC_SIMD": path}, check=True)
            rows += json.loads(out.read_text())
    res = {"dataset": a.dataset, "nq": a.nq, "threads": a.threads, "nprobe": a.nprobe,
           "rows": rows, "machine": machine_info()}
    RESULTS.mkdir(exist_ok=True)
    name = a.dataset.split("-")[0]
    (RESULTS / f"simd_paths_{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    base = {r["spec"]: r for r in rows if r["request"] == "avx2"}
    flags = ", ".join(res["machine"].get("simd", []))
    lines = [f"# Vector paths side by side: {a.dataset}", "",
             f"Command: `python bench/simd_paths.py --dataset {a.dataset}` (specs: "
             f"{', '.join(a.specs)}; {a.threads} thread(s), IVF nprobe {a.nprobe}). Machine: "
             f"{cpu_label(res['machine'])}, SIMD flags: {flags}. One process per "
             "`TQVEC_SIMD` setting; batch: 1,000 queries per call, best of up to 3; single: "
             f"{a.single} one-query calls, best of up to 3 passes; k = 10. Ratios against AVX2 "
             "alone.", "",
             "| spec | TQVEC_SIMD | path | recall@10 | batch QPS | single QPS | batch vs avx2 | "
             "single vs avx2 |", "|---" * 8 + "|"]
    for r in sorted(rows, key=lambda r: (a.specs.index(r["spec"]), PATHS.index(r["request"]))):
        b = base.get(r["spec"])
        lines.append(f"| {r['spec']} | {r['request'] or '(default)'} | {r['path']} | "
                     f"{r['recall@10']:.3f} | {r['qps_batch']:,.0f} | {r['qps_single']:,.0f} | "
                     f"{r['qps_batch'] / b['qps_batch']:.2f}x | "
                     f"{r['qps_single'] / b['qps_single']:.2f}x |")
    (RESULTS / f"simd_paths_{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
