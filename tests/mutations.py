"""Mutation check: plant known bugs one at a time and see the tests catch them.

Each mutant is a small edit (one or several places, e.g. a reference and its kernel changed
alike, so that only an independent oracle can tell) with the test files that claim to cover it.
The tool copies the working tree to a scratch folder, builds the compiled module there once,
runs those test files unmutated (they must pass), then for each mutant applies the edit,
rebuilds if it touched C++, runs the tests (``-x``: the first failure is enough), and reverts.
A mutant is *caught* when the tests fail; *missed* when they pass. Nothing outside the scratch
folder is changed. Not part of the default test run (a full check takes ~15 minutes here):

    python tests/mutations.py                  # all, report to bench/results/mutations.{json,md}
    python tests/mutations.py --only qjl-constant
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutant:
    name: str
    why: str  # the bug, as a user would meet it
    edits: list[tuple[str, str, str]]  # (file, text found exactly once, replacement)
    tests: list[str]  # the test files (or node ids) that claim to cover it
    timeout: float = 900.0
    extra: dict = field(default_factory=dict)


MUTANTS = [
    # -- the five the test review found uncaught ------------------------------------------
    Mutant("io-mmap-skips-checksums", "a memory-mapped load skips the array checksums",
           [("tqvec/io.py", "if verify and hashlib.sha256(",
             "if verify and mm is None and hashlib.sha256(")],
           ["tests/test_io.py"]),
    Mutant("kv-sliding-accounting", "a sliding layer counts window tokens instead of window - 1",
           [("tqvec/kv/layer.py", "return min(self.cumulative_length, self.sliding_window - 1)",
             "return min(self.cumulative_length, self.sliding_window)")],
           ["tests/test_kv.py"]),
    Mutant("plan-sliding-mask", "the planner's reference attends to one token too many",
           [("tqvec/kv/plan.py", "m &= kpos > qpos - window", "m &= kpos >= qpos - window")],
           ["tests/test_kv.py"]),
    Mutant("bench-recall-1-at-10", "recall@1@10 looks at the first result only",
           [("tqvec/benchmark.py", "gt[i, 0] in I[i, :10]", "gt[i, 0] in I[i, :1]")],
           ["tests/test_metrics.py", "tests/test_cli.py"]),
    Mutant("ivf-remove-stale-rowterm", "IVF remove_ids keeps the removed rows' per-row terms",
           [("tqvec/index/rows.py", "self.per_row[name] = values[keep.to(values.device)]",
             "self.per_row[name] = values[: int(keep.sum())]")],
           ["tests/test_ivf.py"]),
    # -- estimators and codebooks -----------------------------------------------------------
    Mutant("qjl-constant", "the QJL estimator's sqrt(pi/2)/m becomes sqrt(2/pi)/m",
           [("tqvec/codecs/_common.py", "return math.sqrt(math.pi / 2) / m",
             "return math.sqrt(2 / math.pi) / m")],
           ["tests/test_codec_oracles.py"]),
    Mutant("jl-row-scale", "orthogonal JL rows scaled by sqrt(d) instead of E[chi_d]",
           [("tqvec/random.py",
             "return math.sqrt(2.0) * math.exp(math.lgamma((d + 1) / 2) - math.lgamma(d / 2))",
             "return math.sqrt(d)")],
           ["tests/test_qjl.py", "tests/test_random.py", "tests/test_turbo.py"]),
    Mutant("codebook-law", "the sphere coordinate's density exponent off by one (d - 1)",
           [("tqvec/codebooks.py", 'dist = _CosPower(d - 2, "sin")\n    K = 1 << b\n    cb = ',
             'dist = _CosPower(d - 1, "sin")\n    K = 1 << b\n    cb = ')],
           ["tests/test_codebooks.py", "tests/test_turbo.py"]),
    Mutant("prod-residual-norm", "TurboQuant-prod stores 1 instead of the residual norm",
           [("tqvec/codecs/turbo.py",
             'scalars["rnorm"] = store_norm(torch.linalg.vector_norm(r, dim=1), dt, "rnorm")',
             'scalars["rnorm"] = store_norm(torch.ones_like(nrm), dt, "rnorm")')],
           ["tests/test_turbo.py", "tests/test_codec_oracles.py"]),
    Mutant("mixed-nibble-weight", "an 8-bit mixed run's high nibble weighted 15 instead of 16",
           [("tqvec/codecs/mixed.py", "return torch.stack([qr, 16 * qr], dim=2)",
             "return torch.stack([qr, 15 * qr], dim=2)")],
           ["tests/test_pca.py"]),
    # -- index semantics ----------------------------------------------------------------------
    Mutant("l2-norm-pairing", "L2 pairs an unbiased estimate with ||x_hat||^2, not ||x||^2",
           [("tqvec/index/rowterms.py", """    if codec.unbiased_ip:
        return codec.true_sqnorms(codes).to(device)
    return codec.reconstruction_sqnorms(codes).to(device)""",
             """    return codec.reconstruction_sqnorms(codes).to(device)""")],
           ["tests/test_index.py"]),
    Mutant("centre-correction-sign", "a centred index adds est<mu, y> - <mu, y>, not its negation",
           [("tqvec/index/rowterms.py", "return (exact - est_v).to(torch.float32)",
             "return (est_v - exact).to(torch.float32)")],
           ["tests/test_index.py"]),
    Mutant("ivf-filter-ignored", "the IVF fast scan ignores allowed_ids",
           [("tqvec/index/ivf.py",
             "add = st.add.masked_fill(~mask[torch.from_numpy(st.pos).clamp_min(0)],\n"
             "                                         -float(\"inf\"))",
             "add = None")],
           ["tests/test_ivf.py"]),
    Mutant("ivf-nprobe-ignored", "the one-call IVF search probes one list whatever nprobe is",
           [("tqvec/index/ivf.py", "return snap.scan.fused.search(q, min(snap.nprobe, self.nlist),",
             "return snap.scan.fused.search(q, 1,")],
           ["tests/test_ivf.py"]),
    Mutant("padding-sign", "k > ntotal pads L2 with -FLT_MAX and similarities with +FLT_MAX",
           [("tqvec/index/metrics.py", "fill = FLT_MAX if metric_type == METRIC_L2 else -FLT_MAX",
             "fill = -FLT_MAX if metric_type == METRIC_L2 else FLT_MAX")],
           ["tests/test_index.py"]),
    Mutant("pca-budget", "PCA,TQ{b} for ip forgets the 4 bytes of its centring term",
           [("tqvec/index/pca.py",
             "with_term = allocate_widths(var, self.target_bytes - 4)",
             "with_term = allocate_widths(var, self.target_bytes)")],
           ["tests/test_pca.py"]),
    # -- a reference and its kernel wrong alike: only an independent oracle sees it -----------
    Mutant("scan-halves-offsets",
           "the LUT scan halves the row offsets, in the reference and the C++ kernel alike",
           [("tqvec/ops/ref.py",
             "return _topk_padded((qr @ yhat.T) * mult[None, :] + add[None, :], k)",
             "return _topk_padded((qr @ yhat.T) * mult[None, :] + 0.5 * add[None, :], k)"),
            ("csrc/cpu/scan.cpp", "top.push(((s0 + s1) + (s2 + s3)) * mult[i] + add[i], i);",
             "top.push(((s0 + s1) + (s2 + s3)) * mult[i] + 0.5f * add[i], i);"),
            ("csrc/cpu/scan.cpp", "top.push(s * mult[i] + add[i], i);",
             "top.push(s * mult[i] + 0.5f * add[i], i);")],
           ["tests/test_ops.py::test_lut_scan_matches_reference"]),
    # -- C++ kernels -------------------------------------------------------------------------
    Mutant("fastscan-tail-rows", "the fast scan skips the last row of a partial block",
           [("csrc/cpu/fastscan/block_sums.h",
             "for (int64_t t = 0; t < n - base; ++t) consider(L, bt[t], base + t, mult, add, off",
             "for (int64_t t = 0; t + 1 < n - base; ++t) consider(L, bt[t], base + t, mult, add, "
             "off")],
           ["tests/test_ops.py", "tests/test_index.py"]),
    Mutant("rescore-l2-sign", "exact re-ranking forgets the -||x||^2 of the L2 score",
           [("csrc/cpu/kernels.h", "metric == kRescoreL2       ? 2.f * dot - sqn - qsq",
             "metric == kRescoreL2       ? 2.f * dot - qsq")],
           ["tests/test_ops.py", "tests/test_index.py"]),
    Mutant("attention-no-max", "decode attention's softmax state keeps the max but not the shift",
           [("csrc/cpu/attention_rows.cpp",
             "lane[u] += (sr[i + u] = exp_softmax(sr[i + u] - ref));",
             "lane[u] += (sr[i + u] = exp_softmax(sr[i + u] - ref + 0.5f));"),
            ("csrc/cpu/attention_avx2.cpp",
             "const __m256 e = exp8_avx2(_mm256_sub_ps(_mm256_loadu_ps(sr + i), ref8));",
             "const __m256 e = exp8_avx2(_mm256_add_ps(_mm256_sub_ps(_mm256_loadu_ps(sr + i), "
             "ref8), _mm256_set1_ps(0.5f)));")],
           ["tests/test_ops.py"]),
    Mutant("attention-step-value-scale", "the compiled decode step forgets the values' channel "
           "mean (sum_t p_t mu)",
           [("csrc/cpu/attention.cpp", "a[j] = y[j] * sc[j] + li * mu[j];",
             "a[j] = y[j] * sc[j];")],
           ["tests/test_kv.py"]),
    Mutant("quantize-tie", "a value on a threshold rounds down instead of up (b <= 4)",
           [("csrc/cpu/pack.cpp", "idx_buf[j] += static_cast<uint8_t>(vbuf[j] >= th);",
             "idx_buf[j] += static_cast<uint8_t>(vbuf[j] > th);")],
           ["tests/test_ops.py"]),
    Mutant("kernel-k1-unclamped", "a first pass asked for more candidates than rows is not clamped",
           [("csrc/cpu/bind/scans.cpp",
             "    k1 = std::min(k1, n);  // more candidates than rows: every row\n"
             "    nb::gil_scoped_release rel;\n    fast_scan_two_stage(",
             "    nb::gil_scoped_release rel;\n    fast_scan_two_stage(")],
           ["tests/test_hostile.py::test_kernels_refuse_or_clamp_hostile_sizes"]),
    Mutant("graph-pool-order", "the graph search's pool is kept worst first",
           [("csrc/cpu/graph.cpp", "if (s[static_cast<size_t>(mid)] >= v) lo = mid + 1;",
             "if (s[static_cast<size_t>(mid)] <= v) lo = mid + 1;")],
           ["tests/test_graph.py"]),
    Mutant("neon-pair-index", "the NEON 3-bit scan reads pair 2's hi nibble from the wrong half",
           [("csrc/cpu/fastscan/block_sums_neon.h",
             "ix[h][2] = vorrq_u8(vandq_u8(cl, m30), vandq_u8(c1, low4));",
             "ix[h][2] = vorrq_u8(vandq_u8(cl, m30), vshrq_n_u8(c1, 4));")],
           ["tests/test_arch.py"]),
    Mutant("vbmi-pair-index", "the VBMI 3-bit scan takes pair 1's lo bits from pair 0's",
           [("csrc/cpu/fastscan/block_sums512.h",
             "_mm512_slli_epi16(cl, 2), 0xca);", "_mm512_slli_epi16(cl, 4), 0xca);")],
           ["tests/test_ops.py::test_fast_scan_scalar_path_equals_simd_path"]),
    Mutant("dot-gather-rows", "the 4-bit dot scan gathers a row's levels of the second code byte "
           "from the wrong row", [("csrc/cpu/fastscan/dot.h", "{0,  64, 32, 96,  1,  65, 33, 97,",
                                  "{0,  64, 33, 96,  1,  65, 32, 97,")],
           ["tests/test_ops.py"]),
    Mutant("dot-bound-dropped", "the 4-bit dot scan drops its rounding bound (rows whose "
           "estimate fell short never reach the re-score)",
           [("csrc/cpu/fastscan/tables.cpp", "(std::min(a1, hoeffding) * 1.001 +",
             "(0.0 * std::min(a1, hoeffding) * 1.001 +")],
           ["tests/test_ops.py"]),
    Mutant("rows8-nibble-half", "the 8-row re-score looks up every nibble in its table's low half",
           [("csrc/cpu/rescore_codes.h", "_mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));",
             "_mm256_castsi256_ps(_mm256_slli_epi32(v, 29)));")],
           ["tests/test_arch.py", "tests/test_index.py"]),
    # -- files ---------------------------------------------------------------------------------
    Mutant("reader-trailing-bytes", "the reader accepts bytes after the last array",
           [("tqvec/io.py", "        if size != end:", "        if size < end:")],
           ["tests/test_io.py", "tests/test_hostile.py"]),
    Mutant("reader-ntotal-unchecked", "an index header's ntotal is not checked against its arrays",
           [("tqvec/index/state.py",
             "if name not in not_per_row and (a.ndim == 0 or a.shape[0] != ntotal):",
             "if False:")],
           ["tests/test_hostile.py"]),
]


def _sh(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float | None = None
        ) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def scratch_copy(dest: Path) -> Path:
    """The working tree (tracked and untracked, not ignored) copied to ``dest/src``."""
    files = _sh(["git", "ls-files", "-co", "--exclude-standard", "-z"], ROOT).stdout.split("\0")
    src = dest / "src"
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    return src


def build(src: Path, build_dir: Path) -> None:
    """Configure once, then ninja rebuilds what changed; the module goes into src/tqvec."""
    if not (build_dir / "build.ninja").exists():
        out = _sh(["cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja",
                   f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"], src)
        if out.returncode:
            raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])
    out = _sh(["ninja", "-C", str(build_dir)], src)
    if out.returncode:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])
    for so in build_dir.glob("_C*.so"):
        shutil.copy2(so, src / "tqvec" / so.name)


def test_env(src: Path, dest: Path) -> dict:
    """An environment in which ``import tqvec`` is the scratch copy, in every subprocess too:
    a sitecustomize drops the editable install's import hook and puts the copy first."""
    site = dest / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path\n"
        "                    if not type(f).__module__.startswith('_editable')]\n"
        f"sys.path.insert(0, {str(src)!r})\n")
    env = dict(os.environ, PYTHONPATH=str(site), CI="1")
    check = _sh([sys.executable, "-c", "import tqvec, tests.conftest, tqvec._C as c; "
                 "print(tqvec.__file__, tests.conftest.__file__, c.__file__)"], src, env)
    paths = check.stdout.split()
    if check.returncode or len(paths) != 3 or not all(p.startswith(str(src)) for p in paths):
        raise RuntimeError(f"the scratch copy is not what imports: {check.stdout} "
                           f"{check.stderr[-2000:]}")
    return env


def run_tests(src: Path, env: dict, tests: list[str], timeout: float) -> tuple[str, float, str]:
    t = time.monotonic()
    try:
        out = _sh([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                   *tests], src, env, timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - t, ""
    status = {0: "passed", 1: "failed"}.get(out.returncode, f"error {out.returncode}")
    tail = [ln for ln in out.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return status, time.monotonic() - t, (tail[0] if tail else out.stdout[-300:])[:300]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=None, help="mutant names")
    p.add_argument("--json", default=str(ROOT / "bench/results/mutations.json"))
    a = p.parse_args(argv)
    mutants = [m for m in MUTANTS if a.only is None or m.name in a.only]
    with tempfile.TemporaryDirectory(prefix="tqvec-mutations-") as tmp:
        dest = Path(tmp)
        src = scratch_copy(dest)
        t0 = time.monotonic()
        build(src, dest / "build")
        env = test_env(src, dest)
        print(f"scratch copy built in {time.monotonic() - t0:.0f} s", flush=True)
        files = sorted({t for m in mutants for t in m.tests})
        status, secs, tail = run_tests(src, env, files, 1800)
        if status != "passed":
            print(f"the unmutated tests do not pass ({status}): {tail}")
            return 2
        print(f"baseline: {len(files)} test files pass ({secs:.0f} s)", flush=True)
        rows = []
        for m in mutants:
            saved = {}
            try:
                for f, find, repl in m.edits:
                    text = saved.setdefault(f, (src / f).read_text())
                    cur = (src / f).read_text()
                    if cur.count(find) != 1:
                        raise LookupError(f"{f}: the text to change occurs {cur.count(find)} "
                                          f"times (the mutant is stale)")
                    (src / f).write_text(cur.replace(find, repl))
                cpp = any(f.startswith("csrc/") for f in saved)
                if cpp:
                    build(src, dest / "build")
                status, secs, tail = run_tests(src, env, m.tests, m.timeout)
            except (LookupError, RuntimeError) as e:
                status, secs, tail = "stale", 0.0, str(e)[-300:]
            finally:
                for f, text in saved.items():
                    (src / f).write_text(text)
                if any(f.startswith("csrc/") for f in saved):
                    build(src, dest / "build")
            caught = status not in ("passed", "stale")
            rows.append({"mutant": m.name, "bug": m.why, "tests": m.tests,
                         "files": sorted({f for f, _, _ in m.edits}), "result": status,
                         "caught": caught, "seconds": round(secs, 1), "first_failure": tail})
            print(f"{'caught' if caught else 'MISSED':7s} {m.name:28s} {status:10s} "
                  f"{secs:5.0f} s  {tail[:90]}", flush=True)
    report = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "python": platform.python_version(), "mutants": len(rows),
              "caught": sum(r["caught"] for r in rows), "rows": rows}
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Mutation check", "", "`python tests/mutations.py`: each bug planted alone in a "
             "scratch copy, its test files run with `-x`.", "",
             f"**{report['caught']} of {report['mutants']} caught.**", "",
             "| mutant | bug | tests | result | first failure |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mutant']} | {r['bug']} | {', '.join(r['tests'])} | "
                     f"{'caught' if r['caught'] else '**missed**'} ({r['result']}) | "
                     f"{r['first_failure'].replace('|', '/')[:120]} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"{report['caught']} of {report['mutants']} caught -> {out}")
    return 0 if report["caught"] == report["mutants"] else 1


if __name__ == "__main__":
    sys.exit(main())
