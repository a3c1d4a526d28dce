"""Graph search: tqvec ``HNSW{M},TQ{b},Refine(Flat)`` against faiss ``HNSW{M},Flat``, faiss
``HNSW32,SQ4`` (and on angular data ``HNSW32,SQtqmse4``) with an exact refinement, hnswlib
(where installed) and tqvec's IVF, over an efSearch sweep, one process run, one thread.

    python bench/graph.py [--dataset fashion-mnist-784-euclidean] [--nq 1000]

Every graph is built with efConstruction 200 (hnswlib's default; faiss's own is 40) on 2
threads. For each method and efSearch (IVF: nprobe): recall@10 (k = 10), batch QPS (all queries
in one call, 1 thread, best of three calls), single-query QPS (1 thread, --single queries one
by one, best of up to three passes), build seconds and the bytes per vector each index holds
(tqvec: ``memory_bytes()``, which counts its layout and faiss's graph it keeps for adds; faiss
and hnswlib: their vectors, codes and links). The summary gives, per method and recall target,
the fastest setting and its ratio to hnswlib and to faiss HNSW,Flat. Writes
bench/results/graph_<dataset>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _targets import fastest_at_targets  # noqa: E402

from tqvec._machine import cpu_label  # noqa: E402
from tqvec.benchmark import recall  # noqa: E402

EF = (10, 16, 24, 32, 40, 48, 64, 96, 128, 192, 256)
NPROBES = (2, 4, 8, 16, 32)
TARGETS = (0.9, 0.95, 0.99)
EF_CONSTRUCTION = 200


def methods(metric: str) -> list[tuple[str, str]]:
    out = [("tqvec", f"HNSW{m},TQ{b},Refine(Flat)") for m in (16, 32) for b in (1, 2)]
    out += [("faiss", "HNSW16,Flat"), ("faiss", "HNSW32,Flat"), ("faiss", "HNSW32,SQ4,RFlat")]
    if metric != "l2":
        # faiss's TurboQuant scalar codes assume unit-norm vectors (on raw Fashion-MNIST
        # pixels they measured recall@10 0.015): angular data only
        out.append(("faiss", "HNSW32,SQtqmse4,RFlat"))
    out += [("hnswlib", "M16"), ("hnswlib", "M32")]
    out += [("tqvec", "IVF256,TQ1,Refine(TQ8g)")]
    return out


class Hnswlib:
    """hnswlib behind the faiss-style calls this benchmark makes."""

    def __init__(self, d: int, M: int, metric: str):
        import hnswlib
        self.index = hnswlib.Index(space="l2" if metric == "l2" else "ip", dim=d)
        self.M, self.d = M, d

    def add(self, x: np.ndarray) -> None:
        self.index.init_index(max_elements=len(x), M=self.M, ef_construction=EF_CONSTRUCTION)
        self.index.set_num_threads(2)
        self.index.add_items(x)

    def search(self, q: np.ndarray, k: int):
        labels, dist = self.index.knn_query(q, k=k)
        return dist, labels.astype(np.int64)

    def bytes_per_vector(self, n: int) -> int:
        # hnswlib's level-0 record (vector, 2M links + count, label) and the upper layers'
        # (M links + count, on 1 / ln(M) ... of the rows): its size_data_per_element and links
        upper = (self.M + 1) * 4 / (np.log(self.M) * (self.M - 1))
        return int(self.d * 4 + (2 * self.M + 1) * 4 + 8 + upper + 8)


def build(kind: str, spec: str, d: int, metric: str, xb: np.ndarray):
    import faiss

    import tqvec

    faiss.omp_set_num_threads(2)
    t0 = time.perf_counter()
    if kind == "tqvec":
        index = tqvec.index_factory(d, spec, metric)
        if spec.startswith("HNSW"):
            index.ef_construction = EF_CONSTRUCTION
        index.train(xb)
        index.add(xb)
        index.search(xb[:1], 10)  # the search layout: part of the build
        size = index.memory_bytes() / len(xb)
    elif kind == "faiss":
        fm = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
        index = faiss.index_factory(d, spec, fm)
        inner = faiss.downcast_index(index.base_index if spec.endswith("RFlat") else index)
        inner.hnsw.efConstruction = EF_CONSTRUCTION
        index.train(xb)
        index.add(xb)
        h = inner.hnsw
        links = (faiss.vector_to_array(h.neighbors).nbytes + faiss.vector_to_array(
            h.offsets).nbytes + faiss.vector_to_array(h.levels).nbytes) / len(xb)
        size = inner.storage.sa_code_size() + links + (4 * d if spec.endswith("RFlat") else 0)
    else:
        index = Hnswlib(d, int(spec[1:]), metric)
        index.add(xb)
        size = index.bytes_per_vector(len(xb))
    return index, int(round(size)), time.perf_counter() - t0


def set_ef(kind: str, spec: str, index, ef: int) -> None:
    import faiss

    if kind == "tqvec" and spec.startswith("IVF"):
        index.nprobe = ef
        index.k_factor = 4
    elif kind == "tqvec":
        index.efSearch = ef
    elif kind == "faiss":
        inner = faiss.downcast_index(index.base_index if spec.endswith("RFlat") else index)
        inner.hnsw.efSearch = ef
        if spec.endswith("RFlat"):
            faiss.downcast_index(index).k_factor = 2
    else:
        index.index.set_ef(max(ef, 10))


def measure(index, xq, gt, single) -> dict:
    import faiss
    import torch

    from tqvec.benchmark import best_time

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    if isinstance(index, Hnswlib):
        index.index.set_num_threads(1)
    _, I = index.search(xq, 10)
    batch = len(xq) / best_time(lambda: index.search(xq, 10))

    def one_by_one() -> None:
        for i in range(single):
            index.search(xq[i:i + 1], 10)

    one = single / best_time(one_by_one)
    return {"recall@10": recall(I, gt, 10), "qps_batch_1t": batch, "qps_single_1t": one}


def summary(rows: list[dict]) -> list[dict]:
    """Per method and target: the fastest setting reaching it, and its ratios to hnswlib's
    and faiss HNSW,Flat's fastest at that target."""
    out = [{"method": method, "bytes": first["bytes"], "build_s": first["build_s"],
            "target": tgt, "batch_qps": bb["qps_batch_1t"], "batch_ef": bb["ef"],
            "single_qps": bs["qps_single_1t"], "single_ef": bs["ef"]}
           for method, tgt, first, bb, bs in fastest_at_targets(
               rows, TARGETS, "qps_batch_1t", "qps_single_1t")]
    for s in out:
        for ref, prefix in (("hnswlib", "hnswlib"), ("faiss_flat", "faiss HNSW")):
            same = [t for t in out if t["target"] == s["target"] and t["method"].startswith(
                prefix) and (prefix == "hnswlib" or t["method"].endswith(",Flat"))]
            if same:
                s[f"batch_vs_{ref}"] = s["batch_qps"] / max(t["batch_qps"] for t in same)
                s[f"single_vs_{ref}"] = s["single_qps"] / max(t["single_qps"] for t in same)
    return out


def write(res: dict, stem: str, argv: list[str]) -> None:
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    m = res["machine"]
    lines = [f"# Graph search: {res['dataset']} ({res['n']:,} x {res['d']}, {res['nq']} "
             f"queries, {res['metric']})", "",
             f"Command: `python bench/graph.py {' '.join(argv)}`. Machine: {cpu_label(m)}, "
             f"{m['cpus']} CPUs, SIMD flags {', '.join(m.get('simd', [])) or 'none'}, tqvec's "
             f"SIMD path {m.get('tqvec_simd_path')}. k = 10, one thread "
             f"for every search; graphs built with efConstruction {EF_CONSTRUCTION} on 2 "
             "threads (build s includes tqvec's search layout). Batch: all queries in one "
             "call, best of three; single: one query per call, best of up to three passes. "
             "faiss's SQ4 / SQtqmse4 graphs re-rank 2k candidates exactly (RFlat, k_factor 2); "
             "tqvec's "
             "IVF row is nprobe (not efSearch), k_factor 4.", "",
             "## Fastest setting reaching each recall@10 target", "",
             "| target | method | bytes/vec | build s | batch QPS (ef) | vs hnswlib | "
             "vs faiss HNSW,Flat | single QPS (ef) | vs hnswlib | vs faiss HNSW,Flat |",
             "|---" * 10 + "|"]
    nan = float("nan")
    for s in sorted(res["summary"], key=lambda s: (s["target"], -s["single_qps"])):
        lines.append(f"| {s['target']} | {s['method']} | {s['bytes']:,} | {s['build_s']:.1f} | "
                     f"{s['batch_qps']:,.0f} ({s['batch_ef']}) | "
                     f"{s.get('batch_vs_hnswlib', nan):.2f} | "
                     f"{s.get('batch_vs_faiss_flat', nan):.2f} | "
                     f"{s['single_qps']:,.0f} ({s['single_ef']}) | "
                     f"{s.get('single_vs_hnswlib', nan):.2f} | "
                     f"{s.get('single_vs_faiss_flat', nan):.2f} |")
    lines += ["", "## Every setting", "",
              "| method | efSearch | recall@10 | batch QPS 1t | single QPS 1t |",
              "|---" * 5 + "|"]
    for r in res["rows"]:
        lines.append(f"| {r['method']} | {r['ef']} | {r['recall@10']:.4f} | "
                     f"{r['qps_batch_1t']:,.0f} | {r['qps_single_1t']:,.0f} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key, title in ((axes[0], "qps_single_1t", "single query, 1 thread"),
                           (axes[1], "qps_batch_1t", "batch, 1 thread")):
        for i, method in enumerate(dict.fromkeys(r["method"] for r in res["rows"])):
            mine = [r for r in res["rows"] if r["method"] == method]
            ax.plot([r["recall@10"] for r in mine], [r[key] for r in mine],
                    "o-" if method.startswith("tqvec") else "s--", color=f"C{i % 10}",
                    label=f"{method} ({mine[0]['bytes']:,} B)", markersize=3)
        ax.set_yscale("log")
        ax.set_xlim(0.8, 1.0)
        ax.set_xlabel("recall@10")
        ax.set_ylabel("QPS")
        ax.set_title(f"{res['dataset']}: {title}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)


def memory_table(out: str) -> int:
    """``--memory``: bytes per vector of tqvec's graph indexes while adding (faiss's index
    held) and after the first search (the layout held, faiss's copy dropped), on both sets;
    bench/results/graph_memory.md."""
    import tqvec
    from tqvec.benchmark import load
    lines = ["# Graph index memory (`python bench/graph.py --memory`)", "",
             "Bytes per vector `memory_bytes()` reports: while adding (codes, refinement, faiss's "
             "HNSW index with its copy of the vectors) and after the first search (codes, "
             "refinement, adjacency and the layout of neighbours' codes; faiss's index dropped "
             "until the next add).", "", "| dataset | spec | while adding | after a search |",
             "|---|---|---|---|"]
    for ds in ("fashion-mnist-784-euclidean", "minilm-384-angular"):
        xb, _, _, metric = load(ds, 10)
        for spec in ("HNSW16,TQ1,Refine(Flat)", "HNSW16,TQ2,Refine(Flat)",
                     "HNSW32,TQ1,Refine(Flat)"):
            index = tqvec.index_factory(xb.shape[1], spec, metric)
            index.add(xb)
            adding = index.memory_bytes() / len(xb)
            index.search(xb[:1], 10)
            lines.append(f"| {ds} | {spec} | {adding:,.0f} | "
                         f"{index.memory_bytes() / len(xb):,.0f} |")
            print(lines[-1], flush=True)
    with open(os.path.join(out, "graph_memory.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    from tqvec._machine import machine_info
    from tqvec.benchmark import load

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="fashion-mnist-784-euclidean")
    ap.add_argument("--nq", type=int, default=1000)
    ap.add_argument("--single", type=int, default=1000)
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    ap.add_argument("--memory", action="store_true",
                    help="only the graph indexes' memory per vector (graph_memory.md)")
    a = ap.parse_args(argv)
    if a.memory:
        return memory_table(a.out)
    xb, xq, gt, metric = load(a.dataset, a.nq)
    os.makedirs(a.out, exist_ok=True)
    d = xb.shape[1]
    stem = os.path.join(a.out, f"graph_{os.path.basename(a.dataset).split('-')[0]}")
    res = {"dataset": a.dataset, "n": int(len(xb)), "d": int(d), "nq": int(len(xq)),
           "metric": metric, "rows": [], "machine": machine_info()}
    print(f"== {a.dataset}: {xb.shape}, {len(xq)} queries, {metric}")
    for kind, spec in methods(metric):
        if spec in a.skip or kind in a.skip:
            continue
        try:
            index, size, secs = build(kind, spec, d, metric, xb)
        except ImportError as e:
            print(f"  {kind} {spec}: skipped ({e})")
            continue
        for ef in (NPROBES if spec.startswith("IVF") else EF):
            set_ef(kind, spec, index, ef)
            r = {"method": f"{kind} {spec}", "bytes": size, "build_s": secs, "ef": ef,
                 **measure(index, xq, gt, a.single)}
            res["rows"].append(r)
            print(f"  {r['method']:<36} {size:>6,} B ef {ef:>4}  R@10 {r['recall@10']:.4f}  "
                  f"batch {r['qps_batch_1t']:>8,.0f}  single {r['qps_single_1t']:>7,.0f}  "
                  f"build {secs:.1f}s", flush=True)
        del index
        res["summary"] = summary(res["rows"])
        write(res, stem, argv)
    print(open(stem + ".md").read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
