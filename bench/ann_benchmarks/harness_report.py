"""Tables and plots of an ann-benchmarks run, made with the harness's own code.

    cd /path/to/ann-benchmarks && python /path/to/tqvec/bench/ann_benchmarks/harness_report.py \\
        --dataset fashion-mnist-784-euclidean --stem ann_harness_fashion

Reads the run's results with the harness's ``load_all_results`` and ``compute_metrics_all_runs``
(its k-nn, QPS, build time and index size), single-query and batch, and writes under
``bench/results/``: ``STEM.json`` (every run), ``STEM.md`` (each algorithm's best QPS at
k-nn >= 0.8 ... 0.99 with its parameters and bytes per vector, and tqvec's ratio to each
rival there) and the harness's ``plot.py`` figures ``STEM.png`` (single) / ``STEM-batch.png``.
Bytes per vector are the harness's index size over the base rows: tqvec reports every buffer
its index holds (``memory_bytes``); the faiss wrappers report the process's RSS growth (the
harness's default), which a ``--local`` run measures in one long-lived worker process, so
faiss's column is shown with its nominal size beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tqvec._machine import cpu_label, machine_info  # noqa: E402

THRESHOLDS = (0.8, 0.9, 0.95, 0.98, 0.99)


def nominal_bytes(algorithm: str, d: int) -> str:
    """What the faiss indexes of the harness's wrappers hold per vector, from their layout."""
    if algorithm == "faiss-ivf":
        return f"{4 * d + 8} (raw floats + id)"
    if algorithm in ("hnswlib", "hnsw(faiss)"):
        # the vector, 2 M base-layer links (+ a count in hnswlib), a label / id; M = 16 in the
        # runs this report was written for (the upper layers add ~1 / ln M of a level's links)
        return f"~{4 * d + 4 * 33 + 8} (vector + 2M = 32 links, M 16)"
    if algorithm == "faiss-ivfpqfs":
        # IVF{n},PQ{d/2}x4fs codes + id, and IndexRefineFlat's copy of the raw vectors (built in
        # fit, whatever k_reorder is)
        return f"{d // 4 + 8 + 4 * d} (PQ{d // 2}x4fs {d // 4} + id 8 + refine {4 * d})"
    return ""


def load(dataset_name: str, batch: bool) -> list[dict]:
    from ann_benchmarks.datasets import get_dataset
    from ann_benchmarks.plotting.utils import compute_metrics_all_runs
    from ann_benchmarks.results import load_all_results

    dataset, _ = get_dataset(dataset_name)
    n = dataset["train"].shape[0]
    rows = []
    for r in compute_metrics_all_runs(dataset, load_all_results(dataset_name, 10, batch)):
        r = {k: (float(v) if hasattr(v, "dtype") else v) for k, v in r.items()}
        r["bytes_per_vector"] = r["indexsize"] * 1024 / n
        rows.append(r)
    return rows


def best_at(rows: list[dict], algorithm: str, knn: float) -> dict | None:
    ok = [r for r in rows if r["algorithm"] == algorithm and r["k-nn"] >= knn]
    return max(ok, key=lambda r: r["qps"]) if ok else None


def table(rows: list[dict], mode: str, d: int) -> list[str]:
    algos = sorted({r["algorithm"] for r in rows}, key=lambda a: (a != "tqvec", a))
    rivals = [a for a in algos if a != "tqvec"]
    head = "| k-nn ≥ | algorithm | best QPS | parameters | k-nn | B/vector | " + \
           " | ".join(f"tqvec / {a}" for a in rivals) + " |"
    out = [f"### {mode}", "", head, "|" + "---|" * (head.count("|") - 1)]
    for t in THRESHOLDS:
        ours = best_at(rows, "tqvec", t)
        for a in algos:
            b = best_at(rows, a, t)
            if b is None:
                out.append(f"| {t} | {a} | — (not reached) | | | | " + " | " * len(rivals))
                continue
            ratios = []
            for rv in rivals:
                theirs = best_at(rows, rv, t)
                ratios.append(f"{ours['qps'] / theirs['qps']:.2f}×" if a == "tqvec" and ours
                              and theirs else ("∞" if a == "tqvec" and ours else ""))
            size = f"{b['bytes_per_vector']:,.0f}"
            nom = nominal_bytes(a, d)
            if nom:
                size += f" (RSS); nominal {nom}"
            out.append(f"| {t} | {a} | {b['qps']:,.0f} | {b['parameters']} | {b['k-nn']:.3f} | "
                       f"{size} | " + " | ".join(ratios) + " |")
    return out + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="fashion-mnist-784-euclidean")
    ap.add_argument("--stem", default="ann_harness_fashion")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--runs", type=int, default=1, help="the --runs the harness was given (stated)")
    ap.add_argument("--algorithms", default="tqvec, faiss-ivfpqfs, faiss-ivf",
                    help="the --algorithm values that were run (stated)")
    ap.add_argument("--definitions", default="",
                    help="the --definitions folder the runs were given, if not the harness's")
    ap.add_argument("--definitions-note", default="",
                    help="a sentence on what those definitions hold (stated)")
    ap.add_argument("--single-definitions", default="",
                    help="the --definitions folder of the single-query faiss runs, if not the "
                         "harness's own (stated in the table)")
    a = ap.parse_args()
    sys.path.insert(0, os.getcwd())  # the harness checkout
    from ann_benchmarks.datasets import get_dataset

    dataset, d = get_dataset(a.dataset)
    n, nq = dataset["train"].shape[0], dataset["test"].shape[0]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip() or "unknown"
    ours = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False).stdout.strip()
    runs = {"single": load(a.dataset, False), "batch": load(a.dataset, True)}
    m = machine_info()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.stem}.json").write_text(json.dumps(
        {"dataset": a.dataset, "n": n, "nq": nq, "d": d, "harness_commit": commit,
         "harness_runs": a.runs, "tqvec_commit": ours, "machine": m, "results": runs},
        indent=1))
    lines = [f"# ann-benchmarks harness: {a.dataset} ({n:,} x {d}, {nq:,} queries, k = 10)", "",
             f"The harness (erikbern/ann-benchmarks at `{commit[:7]}`) in `--local` mode, "
             f"`--runs {a.runs}`, single-query and `--batch`; tables and plots from its "
             "`compute_metrics_all_runs` and `plot.py` (bench/ann_benchmarks/harness_report.py). "
             f"tqvec at `{ours}`, kernels {m.get('tqvec_simd_path')}. Machine: {cpu_label(m)}, "
             f"SIMD flags {', '.join(m.get('simd', []))}.", "",
             "Each row: the algorithm's fastest run at or above the k-nn threshold. B/vector: "
             "the harness's index size over the base rows (tqvec: every buffer the index holds; "
             "faiss: the process's RSS growth, with the layout's nominal size beside it).", "",
             "Commands (in the harness checkout, tqvec installed by "
             "`bench/ann_benchmarks/install.sh`): `python "
             "<tqvec>/bench/ann_benchmarks/harness_run.py --local --dataset "
             f"{a.dataset} --algorithm A --runs {a.runs} [--batch]"
             f"{' --definitions ' + a.definitions if a.definitions else ''}` for A in "
             f"{a.algorithms} (`harness_run.py`: the harness's `run.py` with its "
             "worker-queue race fixed), then this report.", ""]
    if a.definitions_note:
        lines += [a.definitions_note, ""]
    if a.single_definitions:
        lines += ["Single-query faiss runs: `--drop-faiss-padding --definitions "
                  f"{a.single_definitions}` — the harness's faiss definitions without the "
                  "settings on neither faiss index's batch frontier (faiss-ivf n_list 32-256 and "
                  "nprobe 200; faiss-ivfpqfs nprobe 200 and k_reorder 1000), which would have "
                  "taken most of the run one query at a time; and with the harness's faiss "
                  "`query` dropping faiss's -1 padding (without it the runner stops at "
                  "'duplicated candidates' on IVF1204 at nprobe 1). Batch runs: the harness's "
                  "own definitions, unchanged.", ""]
    for mode in ("single", "batch"):
        lines += table(runs[mode], mode, d)
    lines += [f"Plots: [{a.stem}.png]({a.stem}.png) (single), "
              f"[{a.stem}-batch.png]({a.stem}-batch.png) (batch).", ""]
    (out / f"{a.stem}.md").write_text("\n".join(lines))
    for mode, flag in (("single", []), ("batch", ["--batch"])):
        png = out / f"{a.stem}{'' if mode == 'single' else '-batch'}.png"
        subprocess.run([sys.executable, "plot.py", "--dataset", a.dataset, "-o", str(png),
                        "-Y", "log", *flag], check=True)
    print(f"wrote {out / (a.stem + '.md')}, .json, .png, -batch.png")


if __name__ == "__main__":
    main()
