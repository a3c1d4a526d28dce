"""tqvec against turbovec (PyPI, Rust + SIMD TurboQuant-style index) and faiss, one run per
thread count.

    pip install turbovec && python bench/vs_turbovec.py [--dataset fashion-mnist-784-euclidean]
        [--threads 1,2]

turbovec scores inner products only, so the vectors (and queries) are normalized and every
index ranks by inner product (= cosine); ground truth is the exact inner-product top-100.
Every method runs at the same thread count; turbovec's Rayon pool is fixed at import, so each
count runs in processes of its own (RAYON_NUM_THREADS, torch's and faiss's threads set before
any search), one per library: another library's idle pool (OpenMP and Rayon workers spin after
their runs) would take the second core from the one being timed. Single-query QPS uses the
same threads as the batch (what a server answering one request at a time gets). The results
record the machine: CPU model, SIMD flags, kernel path.
Bytes per vector: tqvec and faiss report their code size; turbovec its serialized index size / n
(codes, norms and its per-index tables). turbovec's ``calibrate`` (TQ+) fits a per-coordinate
calibration on a 1,024-row sample: it is a trained variant and labelled as such.

Writes bench/results/turbovec_<dataset>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

THREADS = int(os.environ.get("TQVEC_BENCH_THREADS", "1"))
os.environ["RAYON_NUM_THREADS"] = str(THREADS)  # before turbovec is imported

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_info  # noqa: E402

from tqvec._machine import cpu_label  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _timed_search(search, xq, k, single):
    """(ids of one untimed k-search for recall, batch QPS at k = 10 (best of up to 3 calls),
    single-query QPS at k = 10)."""
    from tqvec.benchmark import best_time

    D, I = search(xq, k)
    batch = len(xq) / best_time(lambda: search(xq, 10))
    search(xq[:1], 10)
    t = time.perf_counter()
    for i in range(single):
        search(xq[i:i + 1], 10)
    return I, batch, single / (time.perf_counter() - t)


def run(kind: str, spec: str, xb, xq, gt, single: int) -> dict:
    import faiss

    import tqvec
    from tqvec.benchmark import recall, recall_1_at_10

    d = xb.shape[1]
    t0 = time.perf_counter()
    if kind == "tqvec":
        factory, _, metric = spec.partition(" ")
        index = tqvec.index_factory(d, factory, metric or "ip")
        index.add(xb)
        nbytes = index.code_size
        search = index.search
    elif kind == "faiss":
        index = faiss.index_factory(d, spec, faiss.METRIC_INNER_PRODUCT)
        if not index.is_trained:
            index.train(xb[np.random.default_rng(0).permutation(len(xb))[:20000]])
        index.add(xb)
        nbytes = index.sa_code_size()
        search = index.search
    else:
        import turbovec
        bits, calibrated = int(spec.split()[0]), "calibrated" in spec
        index = turbovec.TurboQuantIndex(d, bits)
        if calibrated:
            index.calibrate(xb[np.random.default_rng(0).permutation(len(xb))[:1024]])
        index.add(xb)
        index.prepare()
        nbytes = len(index.to_bytes()) / len(xb)
        search = index.search
    build = time.perf_counter() - t0
    I, batch, one = _timed_search(search, xq, 100, single)
    return {"method": f"{kind} {spec}", "bytes": float(nbytes), "build_s": build,
            "recall@10": recall(I, gt, 10), "recall@1@10": recall_1_at_10(I, gt),
            "recall@100": recall(I, gt, 100), "qps_batch": batch, "qps_single": one,
            "threads": THREADS}


def methods(d: int, b: int) -> list[tuple[str, str]]:
    # On unit vectors tqvec's "cosine" is the inner product with the reconstruction divided by
    # its norm (same codes and bytes); plain "ip" keeps the paper's <q, x_hat>, whose per-row
    # shrinkage costs recall when neighbours' scores are close (both rows are shown).
    # turbovec scans a 1-bit plane first and re-scores a shortlist; tqvec's Prefilter(10) is
    # the same idea (the sign plane, 10 k candidates), shown next to the exact scan.
    out = [("tqvec", f"TQ{b} cosine"), ("tqvec", f"TQ{b},Prefilter(10) cosine"),
           ("tqvec", f"TQ{b} ip"), ("tqvec", f"TQ{b}u ip"), ("turbovec", f"{b}"),
           ("turbovec", f"{b} calibrated"), ("faiss", f"RR,RaBitQfs{b}")]
    if b == 2:
        out += [("tqvec", "TQ2,Refine(TQ8) cosine"), ("faiss", f"PQ{d // 2}x4fs")]
    return out


def measure(a) -> list[dict]:
    """Every method at this process's THREADS."""
    import faiss
    import torch

    from tqvec.datasets import load_ann

    torch.set_num_threads(THREADS)
    faiss.omp_set_num_threads(THREADS)
    ds = load_ann(a.dataset)
    xb = np.ascontiguousarray(ds["train"], dtype=np.float32)
    xq = np.ascontiguousarray(ds["test"][: a.nq], dtype=np.float32)
    xb /= np.linalg.norm(xb, axis=1, keepdims=True)
    xq /= np.linalg.norm(xq, axis=1, keepdims=True)
    exact = faiss.IndexFlatIP(xb.shape[1])
    exact.add(xb)
    gt = exact.search(xq, 100)[1]
    rows = []
    for b in (int(s) for s in a.bits.split(",")):
        for kind, spec in methods(xb.shape[1], b):
            if kind != a.kind:
                continue
            try:
                r = run(kind, spec, xb, xq, gt, a.single)
            except Exception as e:  # e.g. a bit width turbovec does not support
                print(f"{kind} {spec}: skipped ({str(e).splitlines()[0][:100]})", flush=True)
                continue
            r["bits"] = b
            r["n"], r["nq"], r["d"] = len(xb), len(xq), xb.shape[1]
            rows.append(r)
            print(f"t={THREADS} b={b} {r['method']:<26} {r['bytes']:7.1f} B  "
                  f"R@10 {r['recall@10']:.3f}  batch {r['qps_batch']:8,.0f}  "
                  f"single {r['qps_single']:7,.0f}  build {r['build_s']:.2f}s", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="fashion-mnist-784-euclidean")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--nq", type=int, default=1000)
    ap.add_argument("--single", type=int, default=200)
    ap.add_argument("--threads", default="1,2", help="thread counts, one process each")
    ap.add_argument("--rows-out", help=argparse.SUPPRESS)  # a child process's rows (JSON)
    ap.add_argument("--kind", help=argparse.SUPPRESS)  # the library a child process times
    a = ap.parse_args(argv)
    if a.rows_out:
        Path(a.rows_out).write_text(json.dumps(measure(a)))
        return 0
    import subprocess
    import tempfile

    rows = []
    counts = [int(t) for t in a.threads.split(",")]
    for t in counts:
        for kind in ("tqvec", "turbovec", "faiss"):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "rows.json"
                subprocess.run([sys.executable, __file__, "--dataset", a.dataset, "--bits",
                                a.bits, "--nq", str(a.nq), "--single", str(a.single), "--kind",
                                kind, "--rows-out", str(out)],
                               env={**os.environ, "TQVEC_BENCH_THREADS": str(t),
                                    "OMP_WAIT_POLICY": "PASSIVE"}, check=True)
                rows += json.loads(out.read_text())
    order = {(k, s): i for i, (k, s) in enumerate(methods(rows[0]["d"], 2) + methods(
        rows[0]["d"], 4))}
    rows.sort(key=lambda r: (r["threads"], r["bits"], order.get(tuple(
        r["method"].split(" ", 1)), 99)))
    name = a.dataset.split("-")[0]
    RESULTS.mkdir(exist_ok=True)
    from tqvec.ops import simd_path

    res = {"dataset": a.dataset, "normalized": True, "metric": "ip", "n": rows[0]["n"],
           "nq": rows[0]["nq"], "threads": counts, "simd_path": simd_path(), "rows": rows,
           "machine": machine_info()}
    (RESULTS / f"turbovec_{name}.json").write_text(json.dumps(res, indent=1))
    flags = ", ".join(res["machine"].get("simd", []))
    lines = [f"# tqvec vs turbovec vs faiss: {a.dataset}, normalized, inner product",
             "", f"Command: `python bench/vs_turbovec.py --dataset {a.dataset} --bits {a.bits} "
             f"--nq {a.nq} --single {a.single} --threads {a.threads}`. Machine: "
             f"{cpu_label(res['machine'])}, SIMD flags: {flags}; tqvec kernels: "
             f"{res['simd_path']}. {res['n']:,} rows, {res['nq']:,} queries. Recall from one "
             "k = 100 search; QPS at k = 10 (batch: best of up to 3 calls; single: one query "
             "per call, the same threads); one process per library and thread count.", "",
             "| threads | bits/dim | method | bytes/vec | build s | recall@10 | recall@1@10 | "
             "recall@100 | batch QPS | single QPS | batch vs turbovec | single vs turbovec |",
             "|---" * 12 + "|"]
    for r in rows:
        tv = next((t for t in rows if t["method"] == f"turbovec {r['bits']}"
                   and t["threads"] == r["threads"]), None)
        rb = f"{r['qps_batch'] / tv['qps_batch']:.2f}x" if tv else "-"
        rs = f"{r['qps_single'] / tv['qps_single']:.2f}x" if tv else "-"
        lines.append(f"| {r['threads']} | {r['bits']} | {r['method']} | {r['bytes']:.1f} | "
                     f"{r['build_s']:.2f} | {r['recall@10']:.3f} | {r['recall@1@10']:.3f} | "
                     f"{r['recall@100']:.3f} | {r['qps_batch']:,.0f} | {r['qps_single']:,.0f} | "
                     f"{rb} | {rs} |")
    (RESULTS / f"turbovec_{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
