"""Host arrays on 2 MiB pages, for the layouts that searches read at random.

A graph search reads a few kilobytes at each of tens of nodes scattered over hundreds of
megabytes: on 4 KiB pages nearly every read also misses the TLB and walks the page table,
and a prefetch into a page the TLB lacks waits on that walk (or is dropped). Linux backs an
anonymous private mapping with transparent huge pages where the process asks
(``madvise(MADV_HUGEPAGE)``; the common ``madvise`` setting gives them to no one else), and
2 MiB pages cover a gigabyte with the TLB's few thousand entries. Elsewhere (another OS, THP
off, a small array) ``empty`` is ``np.empty``: only speed differs.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np
import torch

__all__ = ["HUGE_PAGE", "MIN_BYTES", "empty", "host_cat", "host_empty", "on_huge_pages"]

HUGE_PAGE = 2 << 20
# Smaller arrays stay on the heap: an array's last huge page is faulted in whole (up to 2 MiB
# more than it needs), and a few pages' TLB misses cost little.
MIN_BYTES = 4 << 20


def _huge_pages_possible() -> bool:
    if not (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


_POSSIBLE = _huge_pages_possible()


def _huge_mapping(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of nbytes that Linux may back by huge pages."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return m


def empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialized C-contiguous array of ``shape`` and ``dtype``, backed by transparent
    huge pages where the system gives them (see the module's docstring), else by ``np.empty``.
    The array keeps its mapping alive; it is freed with the last view of it."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not _POSSIBLE or nbytes < MIN_BYTES:
        return np.empty(shape, dtype=dtype)
    try:
        m = _huge_mapping(nbytes + HUGE_PAGE)
    except (OSError, ValueError):
        return np.empty(shape, dtype=dtype)
    raw = np.frombuffer(m, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE  # THP maps only 2 MiB-aligned ranges
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def host_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The CPU tensors ``parts`` (one dtype, equal trailing shapes) joined along dim 0 into a
    new contiguous tensor, on huge pages where ``empty`` gives them: for rows a search reads at
    random (a refinement's exact vectors)."""
    shape = (sum(int(p.shape[0]) for p in parts), *parts[0].shape[1:])
    return torch.cat(parts, out=host_empty(shape, parts[0].dtype))


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``empty`` as a CPU torch tensor (``torch.empty`` for a dtype numpy lacks)."""
    try:
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(empty(shape, np_dtype))


def on_huge_pages(a: np.ndarray) -> bool:
    """Whether ``a``'s memory came from ``empty``'s huge-page mapping."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return isinstance(a.base, memoryview) and isinstance(a.base.obj, mmap.mmap)
