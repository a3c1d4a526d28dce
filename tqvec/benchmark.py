"""``tqvec bench``: tqvec indexes next to faiss's at equal bytes per vector, in one process run.

    tqvec bench                                   # digits (ships with scikit-learn), ~1 minute
    tqvec bench --dataset fashion-mnist-784-euclidean --all --out bench/results
    python bench/search.py                        # digits, Fashion-MNIST, MiniLM into bench/results

For each bit budget b (bits per dimension) every method is built (train + add), then measured:
recall@10 (|I10 ∩ GT10| / 10) and recall@1@10 (the true nearest neighbour within the top 10)
from a k = 10 search, recall@100 from a k = 100 search (an index whose candidates grow with k
keeps more at k = 100, so its top 10 there would flatter the k = 10 search that is timed), then
queries per second at k = 10 as ann-benchmarks times them: batch (all queries in one call) at
one thread and at every thread, and single (one query per call, one thread). Each speed is the
median of repeated calls that together last at least ``--min-time`` seconds, so that small sets
give stable figures; on a few thousand rows they measure the per-call cost, not the scan's
throughput (the summary says so).

Results go to ``--out`` (default ``./tqvec-bench``, or ``$TQVEC_DATA/bench`` when that is set;
never the source tree unless asked): search_<dataset>.json, .md and a recall-vs-QPS .png.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator

import numpy as np

from ._argtypes import bit_list, positive_int

__all__ = ["main", "build_parser", "run_method", "faiss_specs", "tqvec_specs", "recall",
           "recall_1_at_10", "timed_qps", "best_time", "default_out", "recommend"]

DEFAULT_BITS = "1,2,4"
# faiss methods within this factor of a tqvec index's bytes count as "equal bytes"
EQUAL_BYTES = 1.25
_BITS = bit_list(range(1, 9))


def default_out() -> str:
    data = os.environ.get("TQVEC_DATA")
    return os.path.join(data, "bench") if data else "tqvec-bench"


def faiss_specs(d: int, b: int, full: bool = False) -> list[str]:
    """faiss's indexes at about b bits per dimension: the data-oblivious rotated codes (EDEN,
    RaBitQ fast-scan) and trained PQ fast-scan; ``full`` adds the slower or weaker types."""
    specs = [f"RR,EDEN{b}", "RR,RaBitQfs" if b == 1 else f"RR,RaBitQfs{b}"]
    if b <= 2 and (b * d) % 4 == 0 and d % (b * d // 4) == 0:
        specs.append(f"PQ{b * d // 4}x4fs")
    if b == 4:
        specs.append("SQ4")
    if b == 8:
        specs.append("SQ8")
    if full:
        specs += [f"RR,SQtqmse{b}", "RaBitQ" if b == 1 else f"RaBitQ{b}",
                  "RR,RaBitQ" if b == 1 else f"RR,RaBitQ{b}"]
        if (b * d) % 8 == 0 and d % (b * d // 8) == 0:
            specs.append(f"PQ{b * d // 8}x8")  # minutes of training on large sets
    return specs


def tqvec_specs(b: int, full: bool = False) -> list[str]:
    """tqvec's indexes at b bits per dimension: the plain codes, the centred fitted-scale codes
    with and without the sign-bit prefilter (the recommended fit-free index), a trained PCA
    basis, and at 1-2 bits an 8-bit refinement; ``full`` adds the other variants."""
    out = [f"TQ{b}", f"Center,TQ{b}f", f"Center,TQ{b}f,Prefilter(10)", f"PCA,TQ{b}",
           f"PCA,TQ{b},Prefilter(10)"]
    if b <= 2:
        out.append(f"TQ{b},Refine(TQ8g)")
    if full:
        out += [f"TQ{b}u", f"TQ{b}f", f"TQprod{b}", f"Center,TQ{b}", f"Center,TQ{b}u",
                f"TQ{b},Prefilter(10)"]
    return out


def recall(I: np.ndarray, gt: np.ndarray, k: int) -> float:
    return float(np.mean([len(set(I[i, :k]) & set(gt[i, :k])) / k for i in range(len(I))]))


def recall_1_at_10(I: np.ndarray, gt: np.ndarray) -> float:
    return float(np.mean([gt[i, 0] in I[i, :10] for i in range(len(I))]))


def best_time(fn, reps: int = 3, budget_s: float = 2.0) -> float:
    """Best wall time of up to ``reps`` calls (fewer once ``budget_s`` is spent): the machine's
    background noise only ever adds time (bench/ivf.py and bench/vs_turbovec.py time this way)."""
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


def timed_qps(fn, per_call: int, min_time: float = 0.25, min_calls: int = 3,
              max_calls: int = 10_000) -> float:
    """Queries per second of ``fn`` (``per_call`` queries a call): the median call time over
    repeated calls lasting at least ``min_time`` seconds in all (and at least ``min_calls``)."""
    times: list[float] = []
    spent = 0.0
    while len(times) < min_calls or (spent < min_time and len(times) < max_calls):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        times.append(dt)
        spent += dt
    return per_call / max(statistics.median(times), 1e-9)


class _Stderr:
    """faiss writes its warnings (e.g. k-means on too few points) from C++ to file descriptor
    2; ``capture()`` keeps them out of the terminal and ``summary()`` reports them once."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile(mode="w+b") as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                tmp.seek(0)
                text = tmp.read().decode(errors="replace")
                self.lines += [ln for ln in text.splitlines() if ln.strip()]

    def summary(self) -> str | None:
        if not self.lines:
            return None
        kinds = sorted({ln.split(":")[0][:70] for ln in self.lines})
        return (f"faiss printed {len(self.lines)} warning lines (not shown), e.g. "
                f"{kinds[0]!r}: k-means on the few rows of a small set")


def _threads(n: int) -> None:
    import faiss
    import torch

    torch.set_num_threads(n)
    faiss.omp_set_num_threads(n)


def run_method(kind: str, spec: str, d: int, metric: str, xb: np.ndarray, xq: np.ndarray,
               gt: np.ndarray, single: int, threads: int, min_time: float = 0.25,
               stderr: _Stderr | None = None) -> dict:
    """Build one index (train + add, timed), its recalls and its QPS (see the module doc)."""
    import faiss

    import tqvec

    quiet = stderr.capture() if stderr is not None else contextlib.nullcontext()
    _threads(threads)
    t0 = time.perf_counter()
    with quiet:
        if kind == "tqvec":
            index = tqvec.index_factory(d, spec, metric)
            if not index.is_trained:  # Center / PCA: fitted on the base rows (in build_s)
                index.train(xb)
            index.add(xb)
            code_size = index.code_size
        else:
            fm = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
            index = faiss.index_factory(d, spec, fm)
            if not index.is_trained:
                # Trained types (PQ) get a 20k sample, as usual: training PQ on 60k x 784 takes
                # minutes on 2 cores. Training time counts in build_s.
                sample = xb[np.random.default_rng(0).permutation(len(xb))[:20000]]
                index.train(sample)
            index.add(xb)
            code_size = index.sa_code_size() if spec != "Flat" else 4 * d
    build = time.perf_counter() - t0
    out = {"method": f"{kind} {spec}", "bytes": int(code_size), "build_s": build}
    _, I = index.search(xq, 10)
    out["recall@10"] = recall(I, gt, 10)
    out["recall@1@10"] = recall_1_at_10(I, gt)
    _, I = index.search(xq, 100)
    out["recall@100"] = recall(I, gt, 100)
    for t in sorted({1, threads}):
        _threads(t)
        out[f"qps_batch_{t}t"] = timed_qps(lambda: index.search(xq, 10), len(xq), min_time)
    _threads(1)
    qs = [xq[i % len(xq)][None] for i in range(single)]

    def one_by_one() -> None:
        for q in qs:
            index.search(q, 10)

    out["qps_single_1t"] = timed_qps(one_by_one, single, min_time)
    _threads(threads)
    return out


def resolve(name: str) -> str | None:
    """Why ``name`` cannot be benchmarked, or None when it can (checked before any work)."""
    from .datasets import FASHION_DIRS, data_dir

    if name == "digits" or os.path.isfile(name):
        return None
    if os.path.exists(os.path.join(data_dir(), f"{name}.hdf5")):
        return None
    if name == "fashion-mnist-784-euclidean" and any(
            os.path.exists(os.path.join(f, "train-images-idx3-ubyte.gz")) for f in FASHION_DIRS):
        return None  # built from Debian's dataset-fashion-mnist on first use
    return (f"no dataset {name!r}: use 'digits' (ships with scikit-learn), an ann-benchmarks "
            f".hdf5 path, or a name under {data_dir()} (fashion-mnist-784-euclidean is built "
            f"there from Debian's dataset-fashion-mnist; datasets/ has the recipes)")


def load(name: str, nq: int):
    from .datasets import ground_truth, load_ann, load_embedded, split_queries

    if name == "digits":
        x = load_embedded("digits")
        xb, xq = split_queries(x, min(nq, 200))
        gt, _ = ground_truth(xb, xq, 100, "euclidean")
        return xb, xq, gt, "l2"
    ds = load_ann(name)
    metric = {"euclidean": "l2", "angular": "cosine", "dot": "ip"}[ds["distance"]]
    xq = ds["test"][:nq]
    return ds["train"], xq, ds["neighbors"][:nq], metric


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 < v <= 60:
        raise argparse.ArgumentTypeError(f"must be in (0, 60] seconds, got {v}")
    return v


def build_parser(prog: str = "tqvec bench", datasets: tuple[str, ...] = ("digits",),
                 out: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Recall, QPS, bytes and build time of tqvec indexes next to faiss's at the "
                    "same bytes per vector, in one run.",
        epilog="examples:\n"
               f"  {prog}                                   digits, 1/2/4 bits (~1 minute)\n"
               f"  {prog} --bits 2 --only 'Center,*' 'RR,RaBitQ*'\n"
               f"  {prog} --dataset fashion-mnist-784-euclidean --nq 1000 --all\n"
               f"  {prog} --dataset my-set.hdf5 --out results/")
    ap.add_argument("--dataset", nargs="+", default=list(datasets),
                    help="'digits' (ships with scikit-learn), an ann-benchmarks .hdf5 path, or "
                         "a name under $TQVEC_DATA / ~/.cache/tqvec (default: %(default)s)")
    ap.add_argument("--nq", type=positive_int, default=1000,
                    help="queries (digits holds out at most 200) (default: %(default)s)")
    ap.add_argument("--bits", type=_BITS, default=_BITS(DEFAULT_BITS),
                    help=f"bit budgets per dimension, comma-separated (default: {DEFAULT_BITS})")
    ap.add_argument("--single", type=positive_int, default=100,
                    help="distinct queries in the single-query timing (default: %(default)s)")
    ap.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1,
                    help="threads of the multi-threaded batch timing (default: all, "
                         "%(default)s here)")
    ap.add_argument("--min-time", type=_seconds, default=0.25,
                    help="seconds each speed is measured over at least (default: %(default)s)")
    ap.add_argument("--all", action="store_true",
                    help="every variant (tqvec u/f/prod/uncentred, faiss SQtqmse, RaBitQ "
                         "without fast-scan, PQ x8: minutes of training on large sets)")
    ap.add_argument("--skip", nargs="*", default=[], help="method specs to leave out")
    ap.add_argument("--only", nargs="*", default=[],
                    help="only the method specs matching these shell patterns, e.g. 'PCA,TQ*' "
                         "(faiss Flat always runs)")
    ap.add_argument("--out", default=out,
                    help="directory for the JSON / markdown / PNG results (default: "
                         f"{out or default_out()})")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None, *, prog: str = "tqvec bench",
         datasets: tuple[str, ...] = ("digits",), out: str | None = None) -> int:
    ap = build_parser(prog, datasets, out)
    a = ap.parse_args(argv)
    a.out = a.out or default_out()
    try:
        import faiss  # noqa: F401
    except ImportError:
        ap.error("the benchmark compares against faiss: pip install faiss-cpu")
    for name in a.dataset:  # every problem before any work
        problem = resolve(name)
        if problem:
            ap.error(problem)
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        ap.error(f"--out must be a directory, got the file {a.out!r}")
    os.makedirs(a.out, exist_ok=True)
    stderr = _Stderr()
    written = []
    for name in a.dataset:
        from .datasets import data_dir

        if not (name == "digits" or os.path.isfile(name)
                or os.path.exists(os.path.join(data_dir(), f"{name}.hdf5"))):
            print(f"building {name} in {data_dir()} (once; exact neighbours by brute force, "
                  "under a minute)", flush=True)
        xb, xq, gt, metric = load(name, a.nq)
        d = xb.shape[1]
        print(f"== {name}: {xb.shape[0]:,} x {d}, {len(xq)} queries, {metric}; results in "
              f"{a.out}", flush=True)
        jobs = [("faiss", "Flat", 32)]
        for b in a.bits:
            for kind, specs in (("tqvec", tqvec_specs(b, a.all)),
                                ("faiss", faiss_specs(d, b, a.all))):
                jobs += [(kind, s, b) for s in specs if s not in a.skip and (
                    not a.only or any(fnmatch.fnmatchcase(s, p) for p in a.only))]
        rows = []
        bar = _progress(len(jobs), name, a.quiet)
        for kind, spec, b in jobs:
            bar.set_postfix_str(f"{kind} {spec}")
            try:
                r = run_method(kind, "Flat" if spec == "Flat" else spec, d, metric, xb, xq, gt,
                               a.single, a.threads, a.min_time, stderr)
            except RuntimeError as e:  # a faiss type missing from this build
                bar.write(f"  {kind} {spec}: skipped ({str(e).splitlines()[0][:80]})")
                bar.update()
                continue
            r["bits"] = b
            rows.append(r)
            bar.update()
            bar.write(f"  b={b} {r['method']:<34} {r['bytes']:>5} B  R@10 {r['recall@10']:.3f}"
                      f"  single {r['qps_single_1t']:>8,.0f} q/s  batch "
                      f"{r[f'qps_batch_{a.threads}t']:>9,.0f} q/s")
            save(name, xb, xq, metric, rows, a)  # partial results survive an interruption
        bar.close()
        res, paths = save(name, xb, xq, metric, rows, a, final=True)
        written += paths
        print("\n" + summary(res, a.threads))
    note = stderr.summary()
    if note:
        print(note)
    print("results:\n  " + "\n  ".join(written))
    return 0


def _progress(total: int, name: str, quiet: bool):
    try:
        from tqdm import tqdm
    except ImportError as e:  # pragma: no cover
        raise ImportError("tqvec bench needs the tools extra: pip install 'tqvec[tools]'") from e

    return tqdm(total=total, desc=name, unit="index", disable=quiet or None, leave=False,
                file=sys.stderr)


def recommend(rows: list[dict], b: int) -> tuple[dict | None, dict | None]:
    """At b bits per dimension: among tqvec's indexes within EQUAL_BYTES of the smallest (so
    not a refinement's extra bytes), the best recall@10 (within 0.002: the fastest single-query
    one); and faiss's best recall@10 at the same bit budget."""
    ours = [r for r in rows if r["bits"] == b and r["method"].startswith("tqvec")]
    if not ours:
        return None, None
    budget = EQUAL_BYTES * min(r["bytes"] for r in ours)
    ours = [r for r in ours if r["bytes"] <= budget]
    top = max(r["recall@10"] for r in ours)
    best = max((r for r in ours if r["recall@10"] >= top - 0.002),
               key=lambda r: r["qps_single_1t"])
    theirs = [r for r in rows if r["bits"] == b and r["method"].startswith("faiss")]
    rival = max(theirs, key=lambda r: (r["recall@10"], r["qps_single_1t"]), default=None)
    return best, rival


def best_batch(row: dict) -> tuple[float, int]:
    """A method's batch speed at its best thread setting of those measured: (q/s, threads).
    (On a small set one thread can beat several: a comparison at one fixed setting would
    compare one library's best with another's worst.)"""
    return max((v, int(k[len("qps_batch_"):-1])) for k, v in row.items()
               if k.startswith("qps_batch_"))


def summary(res: dict, threads: int) -> str:
    rows = res["rows"]
    lines = [f"Summary for {res['dataset']} ({res['n']:,} x {res['d']}, {res['metric']}; "
             f"single: one query per call, 1 thread; batch: each method at its best of 1 and "
             f"{threads} threads):"]
    for b in sorted({r["bits"] for r in rows if r["method"].startswith("tqvec")}):
        best, rival = recommend(rows, b)
        ours, ours_t = best_batch(best)
        line = (f"  {b} bit{'s' if b > 1 else ''}/dim: {best['method'][6:]} ({best['bytes']} B): "
                f"recall@10 {best['recall@10']:.3f}, {best['qps_single_1t']:,.0f} single / "
                f"{ours:,.0f} batch q/s ({ours_t}t)")
        if rival is not None:
            theirs, theirs_t = best_batch(rival)
            line += (f"; faiss's best at {b} bit{'s' if b > 1 else ''}/dim: {rival['method'][6:]} "
                     f"({rival['bytes']} B) {rival['recall@10']:.3f}, "
                     f"{best['qps_single_1t'] / rival['qps_single_1t']:.2f}x its single and "
                     f"{ours / theirs:.2f}x its batch speed ({theirs:,.0f} q/s at {theirs_t}t)")
        lines.append(line)
    if res["n"] < 50_000:
        lines.append(f"  (on {res['n']:,} rows a search costs microseconds: the speeds measure "
                     "per-call overhead more than the scan; see --dataset "
                     "fashion-mnist-784-euclidean or an ann-benchmarks file for throughput)")
    return "\n".join(lines)


def save(name, xb, xq, metric, rows, a, final=False):
    """Writes <out>/search_<name>.json and .md (and, when final, the plot); returns the result
    dict and the paths written."""
    from ._machine import machine_info

    res = {"dataset": name, "n": int(xb.shape[0]), "d": int(xb.shape[1]), "nq": int(len(xq)),
           "metric": metric, "threads": a.threads, "min_time_s": a.min_time, "complete": final,
           "rows": rows, "machine": machine_info()}
    stem = os.path.join(a.out, f"search_{os.path.basename(name).split('-')[0].split('.')[0]}")
    paths = [stem + ".json", stem + ".md"]
    _write_text(stem + ".json", json.dumps(res, indent=1) + "\n")
    _write_text(stem + ".md", markdown(res, a))
    if final:
        if plot(res, stem + ".png", a.threads):
            paths.append(stem + ".png")
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stem + ".png")  # never leave an older run's plot beside these results
            paths.append("(no plot: pip install matplotlib)")
    return res, paths


def _write_text(path: str, text: str) -> None:
    from .io import atomic_write

    atomic_write(path, lambda f: f.write(text.encode()))


def markdown(res: dict, a) -> str:
    from ._machine import cpu_label

    t = a.threads
    cmd = (f"tqvec bench --dataset {res['dataset']} --nq {a.nq} --single {a.single} --bits "
           + ",".join(str(b) for b in a.bits) + (" --all" if a.all else "")
           + (f" --skip {' '.join(a.skip)}" if a.skip else "")
           + (" --only " + " ".join(f"'{p}'" for p in a.only) if a.only else ""))
    lines = [f"# Search: {res['dataset']} ({res['n']:,} x {res['d']}, {res['nq']} queries, "
             f"{res['metric']})", "",
             f"Command: `{cmd}`. Machine: {cpu_label(res['machine'])}, "
             f"{res['machine']['cpus']} CPUs, SIMD {', '.join(res['machine'].get('simd', []))}. "
             "recall@10 and @1@10 from a k = 10 search, recall@100 from a k = 100 search; QPS "
             f"at k = 10, the median of calls repeated for at least {a.min_time:g} s (batch: all "
             f"queries per call, 1 and {t} threads; single: one query per call, 1 thread).",
             "",
             "| bits/dim | method | bytes/vec | build s | recall@10 | recall@1@10 | recall@100 | "
             f"batch QPS {t}t | batch QPS 1t | single QPS 1t |", "|---" * 10 + "|"]
    for r in res["rows"]:
        lines.append(f"| {r['bits']} | {r['method']} | {r['bytes']} | {r['build_s']:.2f} | "
                     f"{r['recall@10']:.3f} | {r['recall@1@10']:.3f} | {r['recall@100']:.3f} | "
                     f"{r[f'qps_batch_{t}t']:,.0f} | {r['qps_batch_1t']:,.0f} | "
                     f"{r['qps_single_1t']:,.0f} |")
    if res["complete"]:
        lines += ["", summary(res, t)]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str, threads: int) -> bool:
    """The recall-vs-QPS plot; False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in res["rows"]:
        c = "C0" if r["method"].startswith("tqvec") else "C1"
        ax.scatter(r["recall@10"], r["qps_single_1t"], color=c, s=20 + 10 * r["bits"])
        ax.annotate(f"{r['method'].split(' ', 1)[1]} ({r['bytes']}B)",
                    (r["recall@10"], r["qps_single_1t"]), fontsize=6)
    ax.set_yscale("log")
    ax.set_xlabel("recall@10")
    ax.set_ylabel("single-query QPS (1 thread)")
    ax.set_title(f"{res['dataset']}: tqvec (blue) vs faiss (orange); marker size = bits/dim")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()

    def write(f) -> None:
        fig.savefig(f, dpi=110, format="png")

    from .io import atomic_write

    atomic_write(path, write)
    plt.close(fig)
    return True


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
