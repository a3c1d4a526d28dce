"""What a graph index's first search costs: the layout of the neighbours' codes that the first
search after adds (or after ``read_index``) makes, against the same search once it is made.

    python bench/graph_layout.py [--n 200000] [--d 768] [--spec HNSW16,TQ2,Refine(Flat)]
                                 [--reads 3]

Builds the index on isotropic Gaussian rows (``ef_construction`` 40: the layout's cost does not
depend on it, the build's does), times the first and the second search (10 queries) after the
build, writes the index, then in ``--reads`` fresh processes times ``read_index``, the first and
the second search. Beside them: the layout's bytes and the codes' layout kernel alone
(``ops.block_code_rows`` over the base layer's neighbour lists, on memory already faulted in),
which separates the kernel from the first touch of fresh memory. Writes
bench/results/graph_layout.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _machine import machine_info  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _queries(d: int) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((10, d), dtype=np.float32)


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def build(n: int, d: int, spec: str, path: str) -> dict:
    import tqvec

    x = np.random.default_rng(0).standard_normal((n, d), dtype=np.float32)
    index = tqvec.index_factory(d, spec)
    index.ef_construction = 40
    out = {"add_s": _timed(lambda: index.add(x))}
    q = _queries(d)
    out["first_search_s"] = _timed(lambda: index.search(q, 10))
    out["second_search_s"] = _timed(lambda: index.search(q, 10))
    out["memory_bytes"] = int(index.memory_bytes())
    tqvec.write_index(index, path)
    out["file_bytes"] = os.path.getsize(path)
    return out


def read_once(path: str, d: int) -> dict:
    import tqvec

    out: dict = {}
    holder: list = []
    out["read_s"] = _timed(lambda: holder.append(tqvec.read_index(path)))
    q = _queries(d)
    out["first_search_s"] = _timed(lambda: holder[0].search(q, 10))
    out["second_search_s"] = _timed(lambda: holder[0].search(q, 10))
    return out


def kernel_alone(n: int, d: int, spec: str, path: str, rounds: int = 3) -> dict:
    """``ops.block_code_rows`` over n rows x the base layer's lists (random rows: the kernel's
    cost does not depend on which), timed on its second and later runs (memory reused)."""
    import torch

    from tqvec import ops

    b = int(spec.split("TQ")[1].split(",")[0])
    M = int(spec.split(",")[0].removeprefix("HNSW"))
    R = -(-2 * M // 32) * 32
    rng = np.random.default_rng(0)
    packed = torch.from_numpy(rng.integers(0, 256, (n, -(-d * b // 8)), dtype=np.uint8))
    rows = torch.from_numpy(rng.integers(0, n, n * R, dtype=np.int32))
    times = []
    for _ in range(rounds + 1):
        t = time.perf_counter()
        out = ops.block_code_rows(packed, rows, d, b)
        times.append(time.perf_counter() - t)
        nbytes = out.numel()
        del out
    return {"first_s": times[0], "later_s": min(times[1:]), "bytes": int(nbytes)}


def _machine_line(m: dict) -> str:
    return (f"{m['cpu']} (family {m['cpu_family']}, model {m['cpu_model']}), {m['cpus']} CPUs, "
            f"SIMD {' '.join(m['simd'])}, {m['platform']}")


def write(res: dict, argv: list[str]) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "graph_layout.json"), "w") as f:
        json.dump(res, f, indent=1)
    b, k = res["build"], res["kernel"]
    lines = [f"# Graph index: the first search's layout ({res['spec']}, {res['n']:,} x "
             f"{res['d']})", "",
             f"`python bench/graph_layout.py {' '.join(argv)}`", "",
             f"Machine: {_machine_line(res['machine'])}", "",
             f"Index in memory {b['memory_bytes'] / 2**30:.2f} GiB, file "
             f"{b['file_bytes'] / 2**30:.2f} GiB; build {b['add_s']:.1f} s at "
             f"ef_construction 40.", "",
             "| when | read (s) | first search (s) | second search (ms) |", "|---|---|---|---|",
             f"| after the build | - | {b['first_search_s']:.2f} | "
             f"{1e3 * b['second_search_s']:.2f} |"]
    for i, r in enumerate(res["reads"]):
        lines.append(f"| after read_index, process {i + 1} | {r['read_s']:.2f} | "
                     f"{r['first_search_s']:.2f} | {1e3 * r['second_search_s']:.2f} |")
    lines += ["", f"The codes' layout kernel alone (`ops.block_code_rows`, {k['bytes'] / 2**30:.2f}"
              f" GiB written): {k['first_s']:.2f} s on fresh memory, {k['later_s']:.2f} s on "
              "memory the process has touched before. The rest of a first search is the first "
              "touch of the layout's fresh memory (2 MiB pages where Linux gives them), which "
              "depends on the machine: on a virtual machine whose host backs guest memory "
              "lazily it dominates.", ""]
    with open(os.path.join(RESULTS, "graph_layout.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--spec", default="HNSW16,TQ2,Refine(Flat)")
    ap.add_argument("--reads", type=int, default=3)
    ap.add_argument("--read-one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.read_one:  # a fresh process's read and searches, as JSON on stdout
        print(json.dumps(read_once(a.read_one, a.d)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "graph.tqi")
        res = {"spec": a.spec, "n": a.n, "d": a.d, "machine": machine_info(),
               "build": build(a.n, a.d, a.spec, path), "reads": []}
        for _ in range(a.reads):
            p = subprocess.run([sys.executable, __file__, "--d", str(a.d), "--read-one", path],
                               check=True, capture_output=True, text=True)
            res["reads"].append(json.loads(p.stdout))
    res["kernel"] = kernel_alone(a.n, a.d, a.spec, path)
    write(res, argv)
    print(open(os.path.join(RESULTS, "graph_layout.md")).read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
