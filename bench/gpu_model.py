"""Static model of the CUDA kernels' hot loops, checked against the measured tables: no GPU.

    python bench/gpu_model.py        # needs nvcc; writes bench/results/gpu_model.{json,md}

For each kernel variant that bench/gpu.py and bench/kv_gpu.py time: registers, spills and
shared memory (``nvcc -Xptxas -v`` for sm_90), resident warps per SM (Hopper: 64K registers,
228 KB shared memory, 64 warps), and the PTX instructions of one iteration of its main loop
(the largest loop holding ``mma.sync``; the inner loops that stage a tile are counted once, an
undercount by their other trips). Two floors per measured row:

* issue: iterations x instructions / (SMs x 4 warp instructions per cycle x clock) - what the
  loop costs if every scheduler issued every cycle (PTX counts stand in for SASS: this machine
  has no cuobjdump);
* memory: the bytes the row must read / the copy bandwidth measured in the same run.

measured / max(floors) says how far a kernel is from both: near 1, it is bound by the larger;
far above, by latency (too little independent work in flight per SM), which neither floor
shows. H200 figures: 132 SMs, 1.98 GHz (KINDS.md readings), bandwidth from the results file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from kv_gpu import launch_name  # noqa: E402

from tqvec.ops import cuda as C  # noqa: E402

RESULTS = os.path.join(HERE, "results")
SMS, CLOCK_HZ, ISSUE_PER_SM = 132, 1.98e9, 4
REGS_PER_SM, SMEM_PER_SM, WARPS_PER_SM = 65536, 228 * 1024, 64


def compile_variant(file: str, kernel: str, defines: dict[str, int]) -> tuple[dict, str]:
    """(ptxas resource report, PTX text) of one -D variant, compiled as the loader does."""
    src = C.kernel_source(file)[0]
    flags = [f"-D{k}={v}" for k, v in defines.items()] + C.NVRTC_OPTIONS[file]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, file)
        with open(path, "w") as f:
            f.write(src)
        r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v",
                            *flags, path, "-o", os.path.join(tmp, "k.cubin")],
                           capture_output=True, text=True, check=True)
        ptx = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-ptx", *flags, path, "-o",
                              "-"], capture_output=True, text=True, check=True).stdout
    report = r.stderr[r.stderr.index(kernel):] if kernel in r.stderr else r.stderr
    num = {k: int(m.group(1)) if (m := re.search(pat, report)) else 0 for k, pat in {
        "registers": r"Used (\d+) registers", "spill_stores": r"(\d+) bytes spill stores",
        "stack": r"(\d+) bytes stack frame"}.items()}
    return num, _kernel_ptx(ptx, kernel)


def _kernel_ptx(ptx: str, kernel: str) -> str:
    start = ptx.index(f".entry {kernel}")
    end = ptx.find(".entry", start + 1)
    return ptx[start:end if end > 0 else len(ptx)]


def _instructions(lines: list[str]) -> int:
    return sum(1 for x in lines if x.strip().endswith(";") and not x.strip().startswith(
        (".", "//", "{", "}")))


def hot_loop(ptx: str) -> dict:
    """PTX instructions per iteration of the largest loop holding mma.sync: the span from a
    label to the backward branch to it (inner loops in it counted once), mma.sync apart."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, x in enumerate(lines) if (m := re.match(r"(\$L__\w+):", x))}
    loops = []
    for i, x in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__\w+);", x)
        if m and labels.get(m.group(1), i + 1) < i:
            loops.append((labels[m.group(1)], i))
    with_mma = [(a, b) for a, b in loops if any("mma.sync" in x for x in lines[a:b + 1])]
    a, b = max(with_mma, key=lambda ab: ab[1] - ab[0])
    body = lines[a:b + 1]
    return {"instructions": _instructions(body), "mma": sum("mma.sync" in x for x in body),
            "inner_loops": sum(1 for c, d in loops if a < c and d < b)}


def occupancy(registers: int, smem: int, warps: int) -> int:
    """Resident warps per SM: registers (allocated per warp in 256-register units), shared
    memory and the 64-warp limit, in blocks of ``warps``."""
    regs_warp = -(-registers * 32 // 256) * 256
    blocks = min(REGS_PER_SM // (regs_warp * warps), SMEM_PER_SM // max(smem, 1),
                 WARPS_PER_SM // warps)
    return blocks * warps


def model_attention(measured: dict) -> list[dict]:
    rows = []
    bw = measured["copy_GBps"] * 1e9
    for warps, minb, qreg in [(8, 1, 0), (4, 2, 0), (8, 1, 1)]:
        d, kb, vb = 128, measured["steps"][0]["kbits"], measured["steps"][0]["vbits"]
        res, ptx = compile_variant("attention.cu", "tq_decode_attention",
                                   {"TQA_D": d, "TQA_KB": kb, "TQA_VB": vb, "TQA_WARPS": warps,
                                    "TQA_MINB": minb, "TQA_QREG": qreg})
        loop = hot_loop(ptx)
        smem = C.attention_smem(d, kb, vb, warps)
        occ = occupancy(res["registers"], smem, warps)
        name = launch_name((warps, minb, qreg))
        for r in measured["steps"]:
            ms = r.get("kernel_ms_by_launch", {}).get(name)
            if ms is None or r["ctx"] < 131072:
                continue
            tokens = r["batch"] * r["hkv"] * r["ctx"]
            issue = tokens / 16 * loop["instructions"] / (SMS * ISSUE_PER_SM * CLOCK_HZ)
            memory = r["bytes_ours"] / bw
            rows.append({"kernel": "tq_decode_attention", "variant": f"d{d} k{kb} v{vb} {name}",
                         **res, "smem": smem, "warps_per_sm": occ, **loop,
                         "row": f"batch {r['batch']}, {r['ctx']:,} tokens",
                         "issue_floor_ms": 1e3 * issue, "memory_floor_ms": 1e3 * memory,
                         "measured_ms": ms, "measured_over_floor": ms / (1e3 * max(issue, memory))})
    return rows


def model_scan(measured: dict) -> list[dict]:
    rows = []
    bw = measured["roofline"]["copy_GBps"] * 1e9
    for r in measured["scan"]:
        d, b, k = r["d"], r["b"], r["k"]
        if not C.mma_scan_applies(d, b, k):
            continue
        lk = 1 << max(0, (k - 1).bit_length())
        res, ptx = compile_variant("scan.cu", "tq_mma_scan",
                                   {"TQS_D": d, "TQS_B": b, "TQS_K": lk, "TQS_WARPS": 8})
        loop = hot_loop(ptx)
        smem = C.mma_scan_smem(d, b, 8)
        tiles = -(-r["nq"] // 16) * r["n"] / 16  # (query tile, 16-row tile) pairs
        issue = tiles * loop["instructions"] / (SMS * ISSUE_PER_SM * CLOCK_HZ)
        memory = r["n"] * (C.row_bytes(d, b) + 4) / bw
        rows.append({"kernel": "tq_mma_scan", "variant": f"d{d} b{b} K{lk}", **res,
                     "smem": smem, "warps_per_sm": occupancy(res["registers"], smem, 8), **loop,
                     "row": f"{r['n']:,} rows, nq {r['nq']}",
                     "issue_floor_ms": 1e3 * issue, "memory_floor_ms": 1e3 * memory,
                     "measured_ms": 1e3 * r["seconds"],
                     "measured_over_floor": 1e3 * r["seconds"] / (1e3 * max(issue, memory))})
    return rows


def main() -> None:
    def load(name):
        with open(os.path.join(RESULTS, name)) as f:
            return json.load(f)
    kvg = load("kv_gpu.json")
    rows = model_attention(kvg) + model_scan(load("gpu_10m.json")) + model_scan(load("gpu.json"))
    with open(os.path.join(RESULTS, "gpu_model.json"), "w") as f:
        json.dump({"device": kvg["device"], "sms": SMS, "clock_hz": CLOCK_HZ, "rows": rows}, f,
                  indent=1)
    lines = [f"# Static model of the CUDA kernels' hot loops vs measured on {kvg['device']}", "",
             "PTX instructions per main-loop iteration (16 tokens or rows per warp), resources "
             "from ptxas (sm_90), floors as in bench/gpu_model.py's docstring. Measured: "
             "kv_gpu.md (kernel by launch shape), gpu_10m.md, gpu.md.", "",
             "| kernel | variant | regs | warps/SM | loop instr | mma | row | issue floor ms | "
             "memory floor ms | measured ms | measured / floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['variant']} | {r['registers']} | "
                     f"{r['warps_per_sm']} | {r['instructions']} | {r['mma']} | {r['row']} | "
                     f"{r['issue_floor_ms']:.3f} | {r['memory_floor_ms']:.3f} | "
                     f"{r['measured_ms']:.3f} | {r['measured_over_floor']:.1f} |")
    lines += ["", "Reproduce: `python bench/gpu_model.py` (nvcc, no GPU)."]
    with open(os.path.join(RESULTS, "gpu_model.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
