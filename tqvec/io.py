"""The tqvec container file format (shared by codes and, later, indexes).

Layout (little-endian)::

    0   8 B   magic  b"\\x89TQV\\r\\n\\x1a\\n"  (PNG-style: catches text-mode and truncation damage)
    8   4 B   format version (uint32), currently 1
    12  4 B   header length h (uint32)
    16  h B   header: UTF-8 JSON {"kind", "meta", "arrays": [{name, dtype, shape, offset,
              nbytes, sha256}]}
    16+h 32 B sha256 of the header bytes
    ...       arrays, each at a 64-byte-aligned offset, raw C-order bytes

Files are written to a temporary file in the same folder, fsynced and renamed over the target,
so a crash never leaves a half-written file under the real name. Nothing is pickled. Every
section is checksummed; a truncated, foreign or corrupted file raises ``FormatError``.
"""

from __future__ import annotations

import hashlib
import json
import mmap as _mmap
import os
import struct
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import FormatError

__all__ = ["MAGIC", "FORMAT_VERSION", "write_container", "read_container"]

MAGIC = b"\x89TQV\r\n\x1a\n"
FORMAT_VERSION = 1
_ALIGN = 64
_DTYPES = {"uint8", "int64", "int32", "float16", "float32", "float64"}
_MAX_HEADER = 64 << 20


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def write_container(path: str | os.PathLike, kind: str, meta: Mapping[str, Any],
                    arrays: Mapping[str, np.ndarray]) -> None:
    """Atomically write ``arrays`` with a JSON ``meta`` under ``kind``."""
    path = os.fspath(path)
    arrs = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    for k, a in arrs.items():
        if a.dtype.name not in _DTYPES:
            raise TypeError(f"array {k!r} must have one of the dtypes {sorted(_DTYPES)}, "
                            f"got {a.dtype}")
    entries = [{"name": k, "dtype": a.dtype.name, "shape": list(a.shape),
                "nbytes": int(a.nbytes),
                "sha256": hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()}
               for k, a in arrs.items()]
    # Offsets depend on the header length, which depends on the offsets' digits: iterate.
    offset_guess = 0
    for _ in range(4):
        off = _align(16 + offset_guess + 32)
        for e in entries:
            e["offset"] = off
            off = _align(off + e["nbytes"])
        header = json.dumps({"kind": kind, "meta": meta, "arrays": entries},
                            sort_keys=True).encode()
        if len(header) == offset_guess:
            break
        offset_guess = len(header)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tqvec-", suffix=".tmp", dir=folder)
    try:
        # mkstemp creates 0600; give the file the mode a plain open() would (0666 & ~umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<II", FORMAT_VERSION, len(header)) + header)
            f.write(hashlib.sha256(header).digest())
            for e, a in zip(entries, arrs.values(), strict=True):
                f.write(b"\0" * (e["offset"] - f.tell()))
                f.write(a.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename durable
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def read_container(path: str | os.PathLike, kind: str, *, mmap: bool = False,
                   verify: bool = True) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a container of ``kind``; returns ``(meta, arrays)``.

    mmap=True maps the arrays copy-on-write (the file is never modified). verify=True checks
    every array's sha256 (reads the whole file once).
    """
    path = os.fspath(path)
    size = os.path.getsize(path)  # a missing file is FileNotFoundError, not a format error
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise FormatError(f"{path!r} is not a tqvec file (bad magic {head[:8]!r})")
        version, hlen = struct.unpack("<II", head[8:16])
        if version > FORMAT_VERSION or version < 1:
            raise FormatError(f"{path!r} has format version {version}; this tqvec reads "
                              f"versions 1..{FORMAT_VERSION} (upgrade tqvec)")
        if hlen > min(_MAX_HEADER, size - 48):
            raise FormatError(f"{path!r} is truncated or corrupted (header length {hlen}, "
                              f"file size {size})")
        header = f.read(hlen)
        digest = f.read(32)
        if len(header) != hlen or len(digest) != 32:
            raise FormatError(f"{path!r} is truncated (header incomplete)")
        if hashlib.sha256(header).digest() != digest:
            raise FormatError(f"{path!r} is corrupted (header checksum mismatch)")
        try:
            doc = json.loads(header)
            if doc["kind"] != kind:
                raise FormatError(f"{path!r} holds a {doc['kind']!r}, expected {kind!r}")
            entries = doc["arrays"]
            meta = doc["meta"]
        except (ValueError, KeyError, TypeError) as e:
            raise FormatError(f"{path!r} has a malformed header: {e}") from e
        arrays: dict[str, np.ndarray] = {}
        mm = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_COPY) if mmap and size else None
        for e in entries:
            try:
                name, dt, shape = e["name"], e["dtype"], tuple(int(s) for s in e["shape"])
                off, nbytes, sha = int(e["offset"]), int(e["nbytes"]), e["sha256"]
            except (KeyError, TypeError, ValueError) as ex:
                raise FormatError(f"{path!r} has a malformed array entry: {ex}") from ex
            if dt not in _DTYPES:
                raise FormatError(f"{path!r}: array {name!r} has unsupported dtype {dt!r}")
            want = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
            if nbytes != want or any(s < 0 for s in shape):
                raise FormatError(f"{path!r}: array {name!r} size {nbytes} does not match "
                                  f"shape {shape} of {dt}")
            if off < 16 + hlen + 32 or off + nbytes > size:
                raise FormatError(f"{path!r} is truncated: array {name!r} needs bytes "
                                  f"[{off}, {off + nbytes}), file has {size}")
            if mm is not None:
                a = np.frombuffer(mm, dtype=dt, count=nbytes // np.dtype(dt).itemsize,
                                  offset=off).reshape(shape)
            else:
                f.seek(off)
                a = np.frombuffer(bytearray(f.read(nbytes)), dtype=dt).reshape(shape)
            if verify and hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest() != sha:
                raise FormatError(f"{path!r} is corrupted: array {name!r} checksum mismatch")
            arrays[name] = a
    return meta, arrays
