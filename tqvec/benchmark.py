"""``tqvec bench``: tqvec indexes vs faiss at equal bytes per vector, one process run.

    tqvec bench [--dataset digits | fashion-mnist-784-euclidean | file.hdf5 ...] [--nq 1000]
    python bench/search.py          # the same, on digits and fashion-mnist

The default dataset (scikit-learn's digits, 1,797 x 64) ships with the install: no download.

For each bit budget b (bits per dimension) every method is built (train + add), then measured:
recall@10 (|I10 ∩ GT10| / 10) and recall@1@10 (true nearest neighbour within the top 10) from a
k = 10 search, recall@100 from a k = 100 search (an index whose candidates grow with k, a
prefilter's P k or a refinement's k_factor k, keeps more at k = 100: its top 10 there would
flatter the k = 10 search that is timed), then QPS at k = 10 as ann-benchmarks times it: batch
(all queries in one call, best of up to 3 calls) at 1 and 2 threads, and single-query (one
query per call, 1 thread, on --single queries, best of up to 3 passes). Writes
bench/results/search_<dataset>.json, .md and a recall-vs-QPS plot.

faiss's SQtq types assume unit-norm input (no stored norm), so on raw-pixel L2 data they are
measured as a user would get them; RR,SQtqmse rows on normalized data are in bench/encode.py.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import time

import numpy as np

__all__ = ["main", "build_parser", "run_method", "faiss_specs", "tqvec_specs", "recall",
           "best_time"]


def faiss_specs(d: int, b: int) -> list[str]:
    specs = [f"RR,SQtqmse{b}", f"RR,EDEN{b}"]
    specs += ["RaBitQ" if b == 1 else f"RaBitQ{b}", "RR,RaBitQ" if b == 1 else f"RR,RaBitQ{b}",
              "RR,RaBitQfs" if b == 1 else f"RR,RaBitQfs{b}"]
    if (b * d) % 8 == 0 and d % (b * d // 8) == 0:
        specs.append(f"PQ{b * d // 8}x8")
    if b <= 2 and (b * d) % 4 == 0 and d % (b * d // 4) == 0:
        specs.append(f"PQ{b * d // 4}x4fs")
    if b == 4:
        specs.append("SQ4")
    if b == 8:
        specs.append("SQ8")
    return specs


def tqvec_specs(b: int) -> list[str]:
    # Center: mu fitted by train; f: the least-squares scale (same bytes); u: the unbiased one
    out = [f"TQ{b}", f"TQ{b}u", f"TQ{b}f", f"TQprod{b}", f"Center,TQ{b}", f"Center,TQ{b}f",
           f"Center,TQ{b}u"]
    # sign-bit first pass (1 bit: over the first half of the coordinates), the bytes of TQ{b};
    # also behind the centred, fitted codes (the best recall on unnormalized L2 data)
    out += [f"TQ{b},Prefilter(10)", f"Center,TQ{b}f,Prefilter(10)"]
    if b <= 2:  # the 8-bit grid: re-scored without table gathers (TurboQuant codebook="grid")
        out.append(f"TQ{b},Refine(TQ8g)")
    # a fitted PCA basis + mixed widths in the bytes of TQ{b}: trained (train() timed in build_s)
    # and with a first pass over its leading runs (90 % of the variance)
    out += [f"PCA,TQ{b}", f"PCA,TQ{b},Prefilter(10)"]
    return out


def recall(I: np.ndarray, gt: np.ndarray, k: int) -> float:
    return float(np.mean([len(set(I[i, :k]) & set(gt[i, :k])) / k for i in range(len(I))]))


def recall_1_at_10(I: np.ndarray, gt: np.ndarray) -> float:
    return float(np.mean([gt[i, 0] in I[i, :10] for i in range(len(I))]))


def best_time(fn, reps: int = 3, budget_s: float = 2.0) -> float:
    """Best wall time of up to ``reps`` calls (fewer once ``budget_s`` is spent): the machine's
    background noise only ever adds time."""
    best = float("inf")
    spent = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
        if spent >= budget_s:
            break
    return best


def run_method(kind: str, spec: str, d: int, metric: str, xb, xq, gt, single: int) -> dict:
    import faiss
    import torch

    import tqvec

    t0 = time.perf_counter()
    if kind == "tqvec":
        index = tqvec.index_factory(d, spec, metric)
        if not index.is_trained:  # Center / PCA: fitted on the base rows (timed in build_s)
            index.train(xb)
        index.add(xb)
        code_size = index.code_size
    else:
        fm = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
        index = faiss.index_factory(d, spec, fm) if spec != "Flat" else (
            faiss.IndexFlatL2(d) if metric == "l2" else faiss.IndexFlatIP(d))
        if not index.is_trained:
            # Trained types (PQ) get a 20k sample, as usual: full 60k x 784 PQ training takes
            # many minutes on 2 cores. Training time counts in build_s.
            sample = xb[np.random.default_rng(0).permutation(len(xb))[:20000]]
            index.train(sample)
        index.add(xb)
        code_size = index.sa_code_size() if spec != "Flat" else 4 * d
    build = time.perf_counter() - t0
    out = {"method": f"{kind} {spec}", "bytes": int(code_size), "build_s": build}
    # recall (untimed) at the k of each figure; QPS is timed at k = 10 below
    _, I = index.search(xq, 10)
    out["recall@10"] = recall(I, gt, 10)
    out["recall@1@10"] = recall_1_at_10(I, gt)
    _, I = index.search(xq, 100)
    out["recall@100"] = recall(I, gt, 100)
    for threads in (2, 1):
        torch.set_num_threads(threads)
        faiss.omp_set_num_threads(threads)
        out[f"qps_batch_{threads}t"] = len(xq) / best_time(lambda: index.search(xq, 10))
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    index.search(xq[:1], 10)  # warm

    def one_by_one() -> None:
        for i in range(single):
            index.search(xq[i:i + 1], 10)

    # best of up to 3 passes, as batch: one pass of 100 queries moved +-15 % run to run
    out["qps_single_1t"] = single / best_time(one_by_one)
    torch.set_num_threads(2)
    faiss.omp_set_num_threads(2)
    return out


def load(name: str, nq: int):
    from .datasets import ground_truth, load_ann, load_embedded, split_queries

    if name == "digits":
        x = load_embedded("digits")
        xb, xq = split_queries(x, 200)
        gt, _ = ground_truth(xb, xq, 100, "euclidean")
        return xb, xq, gt, "l2"
    ds = load_ann(name)
    metric = {"euclidean": "l2", "angular": "cosine", "dot": "ip"}[ds["distance"]]
    xq = ds["test"][:nq]
    return ds["train"], xq, ds["neighbors"][:nq], metric


def build_parser(prog: str = "tqvec bench", datasets: tuple[str, ...] = ("digits",)
                 ) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=(
        "Recall, QPS, bytes and build time of tqvec indexes next to faiss's flat indexes at "
        "the same bytes per vector, in one run."))
    ap.add_argument("--dataset", nargs="+", default=list(datasets),
                    help="'digits' (ships with the install), an ann-benchmarks name under "
                         "the data directory (e.g. fashion-mnist-784-euclidean) or an HDF5 "
                         "path (default: %(default)s)")
    ap.add_argument("--nq", type=int, default=1000, help="queries (ann-benchmarks sets)")
    ap.add_argument("--bits", default="1,2,3,4", help="bit budgets per dimension")
    ap.add_argument("--single", type=int, default=20, help="queries for single-query QPS")
    ap.add_argument("--skip", nargs="*", default=[],
                    help="method specs to leave out, e.g. PQ392x8 (hours of training)")
    ap.add_argument("--only", nargs="*", default=[],
                    help="run only the method specs matching these shell patterns, e.g. "
                         "'PCA,TQ*' 'PQ*x4fs' (faiss Flat always runs)")
    ap.add_argument("--out", default=os.path.join("bench", "results"),
                    help="directory for the JSON / markdown / PNG results")
    return ap


def main(argv: list[str] | None = None, *, prog: str = "tqvec bench",
         datasets: tuple[str, ...] = ("digits",)) -> int:
    a = build_parser(prog, datasets).parse_args(argv)
    try:
        import faiss  # noqa: F401
    except ImportError as e:
        raise ImportError("tqvec bench compares against faiss: pip install faiss-cpu") from e
    os.makedirs(a.out, exist_ok=True)
    for name in a.dataset:
        try:
            xb, xq, gt, metric = load(name, a.nq)
        except FileNotFoundError as e:
            print(f"skipping {name}: {e}")
            continue
        d = xb.shape[1]
        print(f"== {name}: {xb.shape[0]} x {d}, {len(xq)} queries, metric {metric}", flush=True)
        rows = [dict(run_method("faiss", "Flat", d, metric, xb, xq, gt, a.single), bits=32)]
        for b in (int(s) for s in a.bits.split(",")):
            for kind, specs in (("tqvec", tqvec_specs(b)), ("faiss", faiss_specs(d, b))):
                for spec in specs:
                    if spec in a.skip or (a.only and not any(
                            fnmatch.fnmatchcase(spec, p) for p in a.only)):
                        continue
                    try:
                        r = run_method(kind, spec, d, metric, xb, xq, gt, a.single)
                    except Exception as e:  # a faiss type missing from this build
                        print(f"  {kind} {spec}: skipped ({str(e).splitlines()[0][:80]})")
                        continue
                    r["bits"] = b
                    rows.append(r)
                    save(name, xb, xq, metric, rows, a)  # partial results survive a timeout
                    print(f"  b={b} {r['method']:<26} {r['bytes']:>5} B  R@10 {r['recall@10']:.3f}"
                          f"  batch {r['qps_batch_2t']:>9,.0f} q/s"
                          f"  single {r['qps_single_1t']:>8,.0f}"
                          f" q/s  build {r['build_s']:.2f}s", flush=True)
        print("\n" + save(name, xb, xq, metric, rows, a, final=True))
    return 0


def save(name, xb, xq, metric, rows, a, final=False) -> str:
    """Writes <out>/search_<name>.json and .md (and the plot when final); returns the markdown."""
    from ._machine import machine_info

    res = {"dataset": name, "n": int(xb.shape[0]), "d": int(xb.shape[1]), "nq": int(len(xq)),
           "metric": metric, "complete": final, "rows": rows, "machine": machine_info()}
    stem = os.path.join(a.out, f"search_{os.path.basename(name).split('-')[0].split('.')[0]}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    md = write_md(res, stem + ".md", a)
    if final:
        plot(res, stem + ".png")
    return md


def write_md(res: dict, path: str, a) -> str:
    from ._machine import cpu_label

    lines = [f"# Search: {res['dataset']} ({res['n']:,} x {res['d']}, {res['nq']} queries, "
             f"{res['metric']})", "",
             f"Command: `tqvec bench --dataset {res['dataset']} --nq {a.nq} --single {a.single}"
             + (f" --bits {a.bits}" if a.bits != "1,2,3,4" else "")
             + (f" --skip {' '.join(a.skip)}" if a.skip else "")
             + (" --only " + " ".join(f"'{p}'" for p in a.only) if a.only else "")
             + (f" --out {a.out}" if a.out != os.path.join("bench", "results") else "") + "`. "
             f"Machine: {cpu_label(res['machine'])}, {res['machine']['cpus']} CPUs. "
             "recall@10 and @1@10 from a k = 10 search, recall@100 from a k = 100 search; "
             "QPS at k = 10 (batch: all queries per call, best "
             "of up to 3 calls; single: one query per call, 1 thread, best of up to 3 passes).",
             "",
             "| bits/dim | method | bytes/vec | build s | recall@10 | recall@1@10 | recall@100 | "
             "batch QPS 2t | batch QPS 1t | single QPS 1t |", "|---" * 10 + "|"]
    for r in res["rows"]:
        lines.append(f"| {r['bits']} | {r['method']} | {r['bytes']} | {r['build_s']:.2f} | "
                     f"{r['recall@10']:.3f} | {r['recall@1@10']:.3f} | {r['recall@100']:.3f} | "
                     f"{r['qps_batch_2t']:,.0f} | {r['qps_batch_1t']:,.0f} | "
                     f"{r['qps_single_1t']:,.0f} |")
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


def plot(res: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in res["rows"]:
        c = "C0" if r["method"].startswith("tqvec") else "C1"
        ax.scatter(r["recall@10"], r["qps_batch_2t"], color=c, s=20 + 10 * r["bits"])
        ax.annotate(f"{r['method'].split(' ', 1)[1]} ({r['bytes']}B)",
                    (r["recall@10"], r["qps_batch_2t"]), fontsize=6)
    ax.set_yscale("log")
    ax.set_xlabel("recall@10")
    ax.set_ylabel("batch QPS (2 threads)")
    ax.set_title(f"{res['dataset']}: tqvec (blue) vs faiss (orange); marker size = bits/dim")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
