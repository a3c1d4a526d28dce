"""write_index / read_index: an index's state (``tqvec.index.state``) in the container format
of ``tqvec.io`` with kind "index": atomic, versioned, checksummed, never pickled; reading trusts
nothing in the file but its checksums (``index_from_state``)."""

from __future__ import annotations

import os

from ..io import read_container, write_container
from .flat import FlatIndex
from .ivf import IVFIndex
from .pca import PCAIndex
from .state import index_from_state, index_state

__all__ = ["write_index", "read_index"]

_KIND = "index"


def write_index(index: FlatIndex | IVFIndex | PCAIndex, path: str | os.PathLike) -> None:
    """Write an index atomically (versioned, checksummed, never pickled)."""
    meta, arrays = index_state(index)
    write_container(path, _KIND, meta, arrays)


def read_index(path: str | os.PathLike, mmap: bool = False, verify: bool = True
               ) -> FlatIndex | IVFIndex | PCAIndex:
    """Read an index written by ``write_index``; ``mmap=True`` maps the codes copy-on-write (the
    file must then not change while the index is used: each search checks its size and
    modification time). A damaged, foreign or crafted file raises ``FormatError``."""
    p = os.fspath(path)
    meta, arrays, mapped = read_container(p, _KIND, mmap=mmap, verify=verify)
    return index_from_state(meta, arrays, mapped, p)
