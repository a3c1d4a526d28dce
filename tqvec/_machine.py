"""What machine a benchmark ran on (written next to every result)."""

import os
import platform


def cpu_label(m: dict) -> str:
    """'AMD EPYC (family 23, model 1)' from machine_info(), or what of it exists."""
    cpu = str(m.get("cpu", "unknown CPU"))
    if "cpu_family" in m:
        cpu += f" (family {m['cpu_family']}, model {m.get('cpu_model', '?')})"
    return cpu


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            # the family and model too: a VM's "AMD EPYC" hides whether it is Zen 1 (family 23,
            # model 1: 256-bit AVX2 split in two 128-bit halves) or Zen 3 (family 25), which
            # moved every figure here by ~2.5x between two sessions
            for line in f:
                key, _, val = line.partition(":")
                key, val = key.strip(), val.strip()
                if key == "model name":
                    info["cpu"] = val
                elif key == "cpu family":
                    info["cpu_family"] = int(val)
                elif key == "model" and val.isdigit():
                    info["cpu_model"] = int(val)
                if key == "processor" and "cpu" in info:
                    break  # the first processor's block is read
            f.seek(0)
            flags = next((ln for ln in f if ln.startswith("flags")), "")
            have = set(flags.partition(":")[2].split())
            info["simd"] = [s for s in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                        "avx512vbmi", "avx512_vnni", "avx512ifma", "asimd", "sve")
                            if s in have]
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    try:
        import faiss

        info["faiss"] = faiss.__version__
    except ImportError:
        pass
    import tqvec
    from tqvec import ops

    info["tqvec"] = tqvec.__version__
    info["tqvec_simd_path"] = ops.simd_path()  # the path the kernels took (TQVEC_SIMD applies)
    return info
