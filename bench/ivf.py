"""IVF search: tqvec ``IVF{nlist},TQ{b}[,Refine(Flat)|Refine(TQ8)|Refine(TQ8g)]`` vs faiss
``IVF{nlist},PQ{M}x4fs[,RFlat|,Refine(SQ8)]`` and faiss's IVF RaBitQ, over an nprobe sweep, one
process run.

    python bench/ivf.py [--dataset fashion-mnist-784-euclidean] [--nlist 256] [--nq 1000]

For each method, nprobe and (with a refinement) k_factor: recall@10 (k = 10), batch QPS (all
queries in one call, best of three calls, 2 threads), single-query QPS (1 thread, --single
queries one by one, best of up to three passes). Refinements re-rank k_factor * k candidates
(exact vectors, or 8-bit codes: TQ8, TQ8g / faiss's SQ8), k_factor 2, 3 or 4 on both sides
(query-time parameters, as ann-benchmarks sweeps them). The summary gives, per method, the
fastest setting with recall@10 >= each target (the target: QPS >= faiss IVF,PQfs with refinement
at recall >= 0.9) and the ratio to faiss's best at that target. Writes
bench/results/ivf_<dataset>.{json,md,png}.
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

from tqvec.benchmark import recall  # noqa: E402

NPROBES = (1, 2, 4, 8, 16, 32, 64)
TARGETS = (0.8, 0.9, 0.95)
K_FACTORS = (2, 3, 4)  # refinements only


def methods(d: int, nlist: int) -> list[tuple[str, str]]:
    out = [("tqvec", f"IVF{nlist},TQ{b}") for b in (1, 2, 4)]
    out += [("tqvec", f"IVF{nlist},TQ{b},Refine(Flat)") for b in (1, 2)]
    # ~1/4 of the refinement's bytes: Lloyd-Max 8-bit codes (a table gather per coordinate)
    # and the 8-bit grid (decoded by integer-to-float conversions)
    out += [("tqvec", f"IVF{nlist},TQ1,Refine(TQ8{g})") for g in ("", "g")]
    for m in (d // 4, d // 2):  # 1 and 2 bits per dimension
        out.append(("faiss", f"IVF{nlist},PQ{m}x4fs"))
    out += [("faiss", f"IVF{nlist},PQ{m}x4fs,RFlat") for m in (d // 4, d // 2)]
    out.append(("faiss", f"IVF{nlist},PQ{d // 4}x4fs,Refine(SQ8)"))
    out += [("faiss", f"RR,IVF{nlist},RaBitQfs{b}") for b in (2, 4)]
    return out


def build(kind: str, spec: str, d: int, metric: str, xb: np.ndarray):
    import faiss

    import tqvec

    t0 = time.perf_counter()
    if kind == "tqvec":
        index = tqvec.index_factory(d, spec, metric)
        index.train(xb)
        index.add(xb)
        size = index.code_size
    else:
        fm = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
        index = faiss.index_factory(d, spec, fm)
        # the same 20k training sample as tqvec bench's trained types (PQ training on all 60k
        # takes minutes); tqvec's k-means subsamples to 256 points per list itself
        index.train(xb[np.random.default_rng(0).permutation(len(xb))[:20000]])
        index.add(xb)
        if refines(spec):  # the codes plus the refinement's (exact vectors: 4 d)
            ri = faiss.downcast_index(index)
            size = ri.base_index.sa_code_size() + ri.refine_index.sa_code_size()
        else:
            size = index.sa_code_size()
    return index, int(size), time.perf_counter() - t0


def refines(spec: str) -> bool:
    return spec.endswith(",RFlat") or "Refine(" in spec


def set_params(kind: str, index, p: int, kf: int | None) -> None:
    import faiss

    if kind == "tqvec":
        index.nprobe = p
        if kf is not None:
            index.k_factor = kf
    else:
        faiss.ParameterSpace().set_index_parameter(index, "nprobe", p)
        if kf is not None:
            faiss.downcast_index(index).k_factor = kf


def measure(kind, index, xq, gt, single) -> dict:
    import faiss
    import torch

    from tqvec.benchmark import best_time

    torch.set_num_threads(2)
    faiss.omp_set_num_threads(2)
    index.search(xq[:10], 10)  # warm-up (builds tqvec's search layout)
    _, I = index.search(xq, 10)
    # best of up to three calls (tqvec bench's timing): single calls moved +-15 % run to run
    batch = len(xq) / best_time(lambda: index.search(xq, 10))
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    def one_by_one() -> None:
        for i in range(single):
            index.search(xq[i:i + 1], 10)

    one = single / best_time(one_by_one)  # best of up to 3 passes, as tqvec bench
    torch.set_num_threads(2)
    faiss.omp_set_num_threads(2)
    return {"recall@10": recall(I, gt, 10), "qps_batch_2t": batch, "qps_single_1t": one}


def setting(r: dict) -> str:
    """nprobe, and k_factor where the method refines: "4" or "4, kf 2"."""
    return f"{r['nprobe']}" + (f", kf {r['k_factor']}" if r.get("k_factor") else "")


def summary(rows: list[dict]) -> list[dict]:
    """Per method and target: the fastest setting reaching it (batch and single separately)."""
    out = [{"method": method, "bytes": first["bytes"], "target": tgt,
            "batch_qps": bb["qps_batch_2t"], "batch_setting": setting(bb),
            "single_qps": bs["qps_single_1t"], "single_setting": setting(bs)}
           for method, tgt, first, bb, bs in fastest_at_targets(
               rows, TARGETS, "qps_batch_2t", "qps_single_1t")]
    for s in out:  # ratio to the best faiss method at the same target
        fa = [t for t in out if t["target"] == s["target"] and t["method"].startswith("faiss")]
        if fa:
            s["batch_vs_faiss_best"] = s["batch_qps"] / max(t["batch_qps"] for t in fa)
            s["single_vs_faiss_best"] = s["single_qps"] / max(t["single_qps"] for t in fa)
    return out


def write(res: dict, stem: str, argv: list[str]) -> None:
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    m = res["machine"]
    lines = [f"# IVF search: {res['dataset']} ({res['n']:,} x {res['d']}, {res['nq']} queries, "
             f"{res['metric']}, nlist {res['nlist']})", "",
             f"Command: `python bench/ivf.py {' '.join(argv)}`. Machine: {m.get('cpu')}, "
             f"{m['cpus']} CPUs. k = 10; refinements re-rank k_factor (kf: "
             f"{' or '.join(map(str, K_FACTORS))}) x 10 candidates with the exact vectors (+4 d "
             "bytes/vector) or 8-bit codes (TQ8: Lloyd-Max, TQ8g: a uniform grid, both + d + 4; "
             "faiss's SQ8: + d). Batch: all queries in one "
             "call, best of three calls; single: one query per call, best of up to three "
             "passes.", "",
             "## Fastest setting reaching each recall@10 target", "",
             "| target | method | bytes/vec | batch QPS 2t (nprobe) | vs faiss best | "
             "single QPS 1t (nprobe) | vs faiss best |", "|---" * 7 + "|"]
    for s in sorted(res["summary"], key=lambda s: (s["target"], -s["batch_qps"])):
        lines.append(f"| {s['target']} | {s['method']} | {s['bytes']} | "
                     f"{s['batch_qps']:,.0f} ({s['batch_setting']}) | "
                     f"{s.get('batch_vs_faiss_best', float('nan')):.2f} | "
                     f"{s['single_qps']:,.0f} ({s['single_setting']}) | "
                     f"{s.get('single_vs_faiss_best', float('nan')):.2f} |")
    lines += ["", "## Every setting", "",
              "| method | bytes/vec | build s | nprobe | recall@10 | batch QPS 2t | "
              "single QPS 1t |", "|---" * 7 + "|"]
    for r in res["rows"]:
        lines.append(f"| {r['method']} | {r['bytes']} | {r['build_s']:.2f} | {setting(r)} | "
                     f"{r['recall@10']:.3f} | {r['qps_batch_2t']:,.0f} | "
                     f"{r['qps_single_1t']:,.0f} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    curves = dict.fromkeys((r["method"], r.get("k_factor")) for r in res["rows"])
    for i, (method, kf) in enumerate(curves):
        mine = [r for r in res["rows"] if r["method"] == method and r.get("k_factor") == kf]
        ax.plot([r["recall@10"] for r in mine], [r["qps_batch_2t"] for r in mine],
                "o-" if method.startswith("tqvec") else "s--", color=f"C{i % 10}",
                label=f"{method}{f', kf {kf}' if kf else ''} ({mine[0]['bytes']} B)",
                markersize=3)
    ax.set_yscale("log")
    ax.set_xlabel("recall@10")
    ax.set_ylabel("batch QPS (2 threads)")
    ax.set_title(f"{res['dataset']}: IVF, nprobe {NPROBES[0]}..{NPROBES[-1]}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    from tqvec._machine import machine_info
    from tqvec.benchmark import load

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="fashion-mnist-784-euclidean")
    ap.add_argument("--nlist", type=int, default=256)
    ap.add_argument("--nq", type=int, default=1000)
    ap.add_argument("--single", type=int, default=200)
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    a = ap.parse_args(argv)
    xb, xq, gt, metric = load(a.dataset, a.nq)
    os.makedirs(a.out, exist_ok=True)
    d = xb.shape[1]
    stem = os.path.join(a.out, f"ivf_{os.path.basename(a.dataset).split('-')[0].split('.')[0]}")
    res = {"dataset": a.dataset, "n": int(len(xb)), "d": int(d), "nq": int(len(xq)),
           "metric": metric, "nlist": a.nlist, "rows": [], "machine": machine_info()}
    print(f"== {a.dataset}: {xb.shape}, {len(xq)} queries, {metric}, nlist {a.nlist}")
    for kind, spec in methods(d, a.nlist):
        if spec in a.skip:
            continue
        try:
            index, size, secs = build(kind, spec, d, metric, xb)
        except Exception as e:  # a faiss type missing from this build
            print(f"  {kind} {spec}: skipped ({str(e).splitlines()[0][:80]})")
            continue
        for kf in (K_FACTORS if refines(spec) else (None,)):
            for p in NPROBES:
                set_params(kind, index, p, kf)
                r = {"method": f"{kind} {spec}", "bytes": size, "build_s": secs, "nprobe": p,
                     "k_factor": kf, **measure(kind, index, xq, gt, a.single)}
                res["rows"].append(r)
                print(f"  {r['method']:<34} {size:>5} B {setting(r):>10}  "
                      f"R@10 {r['recall@10']:.3f}  batch {r['qps_batch_2t']:>8,.0f}  "
                      f"single {r['qps_single_1t']:>7,.0f}  build {secs:.1f}s", flush=True)
        res["summary"] = summary(res["rows"])
        write(res, stem, argv)
    print(open(stem + ".md").read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
