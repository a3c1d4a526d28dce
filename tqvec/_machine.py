"""What machine a benchmark ran on (written next to every result)."""

import os
import platform


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
            f.seek(0)
            flags = next((ln for ln in f if ln.startswith("flags")), "")
            info["simd"] = [s for s in ("avx2", "avx512f", "fma") if f" {s}" in flags]
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

    info["tqvec"] = tqvec.__version__
    return info
