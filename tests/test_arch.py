"""The CPU kernels on another architecture: tests/native/kernel_paths.cpp built for aarch64 (its
NEON path) and run under qemu user-mode emulation must print what the portable loops print -
there and on this machine (x86-64, every vector path it has). Arm speed is not measured here:
emulation says nothing about it."""
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ["cpu_features.cpp", "pack.cpp", "hadamard.cpp", "scan.cpp", "rescore.cpp",
           "search.cpp", "attention.cpp", "attention_rows.cpp", "attention_avx2.cpp",
           "graph.cpp", "fastscan/tables.cpp", "fastscan/flat.cpp", "fastscan/terms.cpp",
           "fastscan/two_stage.cpp", "fastscan/ivf.cpp"]
# the extension's own flags (CMakeLists.txt): -O3, no contraction of multiplies and adds
FLAGS = ["-std=c++17", "-O3", "-ffp-contract=off", "-pthread"]

pytestmark = pytest.mark.arm


def build(compiler, out, static=False):
    sources = [str(ROOT / "tests/native/kernel_paths.cpp")] + [
        str(ROOT / "csrc/cpu" / s) for s in KERNELS]
    cmd = [compiler, *FLAGS, *(["-static"] if static else []), *sources, "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def run(cmd, simd):
    env = dict(os.environ, TQVEC_SIMD=simd)
    res = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return res.stdout, res.stderr.strip()


def test_neon_path_gives_the_portable_bits_under_emulation(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        arm = pool.submit(build, "aarch64-linux-gnu-g++", tmp_path / "arm", True)
        x86 = pool.submit(build, shutil.which("g++") or "g++", tmp_path / "x86")
        arm, x86 = arm.result(), x86.result()
    qemu = shutil.which("qemu-aarch64") or "qemu-aarch64"
    out = {}
    for name, cmd, simd in [("arm/neon", [qemu, str(arm)], ""),
                            ("arm/scalar", [qemu, str(arm)], "scalar"),
                            ("x86/scalar", [str(x86)], "scalar"),
                            ("x86/auto", [str(x86)], ""),
                            ("x86/avx2", [str(x86)], "avx2"),
                            ("x86/avx512", [str(x86)], "avx512")]:
        text, path = run(cmd, simd)
        out[name] = text
        if name == "arm/neon":
            assert path == "simd path: neon"
        if name.endswith("scalar"):
            assert path == "simd path: scalar"
    lines = out["x86/scalar"].splitlines()
    assert len(lines) > 300 and all(len(line.split()) == 2 for line in lines)
    for name, text in out.items():
        got = text.splitlines()
        assert len(got) == len(lines), name
        bad = [a.split()[0] for a, b in zip(got, lines, strict=True) if a != b]
        assert not bad, f"{name} differs from x86/scalar in {bad[:5]} ({len(bad)} outputs)"
