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


def graph_time(fn, repeat: int) -> float | None:
    """Median seconds of one replay of fn() captured as a CUDA graph (launch overheads gone, as a
    serving engine's decode step runs), or None when fn cannot be captured."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    except Exception as e:  # noqa: BLE001 - report, do not fail the benchmark
        print(f"graph capture failed: {type(e).__name__}: {e}"[:300], flush=True)
        torch.cuda.synchronize()
        return None
    return cuda_time(g.replay, repeat)
