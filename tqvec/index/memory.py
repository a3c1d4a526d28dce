"""What an index holds in memory: every tensor and array reachable from it, each buffer once."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["held_bytes"]


def held_bytes(root: Any) -> int:
    """Bytes of the distinct buffers (torch storages, numpy base buffers, memory maps included)
    reachable from ``root`` through tqvec objects' attributes, lists, tuples and dicts."""
    seen_objects: set[int] = set()
    buffers: dict[int, int] = {}

    def visit(obj: Any, depth: int) -> None:
        if depth > 12 or id(obj) in seen_objects:
            return
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            buffers[storage.data_ptr()] = max(buffers.get(storage.data_ptr(), 0),
                                              storage.nbytes())
        elif isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            ptr = base.__array_interface__["data"][0]
            buffers[ptr] = max(buffers.get(ptr, 0), base.nbytes)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v, depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
        elif type(obj).__module__.startswith("tqvec"):
            fields = getattr(obj, "__dict__", None)
            if fields is not None:
                for v in fields.values():
                    visit(v, depth + 1)
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    visit(getattr(obj, name), depth + 1)

    visit(root, 0)
    buffers.pop(0, None)  # empty tensors
    return sum(buffers.values())
