"""Timing helpers shared by the GPU benchmarks."""

import statistics

import torch


def cuda_time(fn, repeat: int) -> float:
    """Median seconds of fn() over `repeat` runs (CUDA events), after one warm-up."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def copy_bandwidth(repeat: int) -> float:
    """Device-to-device copy of 2 GiB: GB/s counting bytes read + written."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / cuda_time(lambda: y.copy_(x), repeat) / 1e9
