"""The tqvec container file format (shared by codes and indexes), and atomic writes.

Layout (little-endian)::

    0   8 B   magic  b"\\x89TQV\\r\\n\\x1a\\n"  (PNG-style: catches text-mode and truncation damage)
    8   4 B   format version (uint32), currently 1
    12  4 B   header length h (uint32)
    16  h B   header: UTF-8 JSON {"kind", "meta", "arrays": [{name, dtype, shape, offset,
              nbytes, sha256}]}
    16+h 32 B sha256 of the header bytes
    ...       arrays in header order, each at the next 64-byte-aligned offset, raw C-order
              bytes, zero padding between them; the file ends with the last array

Every byte is accounted for: the header and each array carry a sha256, the layout is the one
the writer produces (offsets, zero padding, no trailing bytes), so a truncated, foreign or
corrupted file raises ``FormatError`` before anything is allocated from it (sizes are checked
against the file's size first). Only regular files are opened: a FIFO or a device is refused,
never read (a FIFO would block forever).

Files are written to a temporary file in the same folder (``.tqvec-*.tmp``, locked while it is
written), fsynced and renamed over the target, so a crash never leaves a half-written file
under the real name; temporaries left by killed writers (names ``temp_name`` made, unlocked,
10 minutes old) are removed by a later write to that folder. A target that exists but is no
regular file (a symlink, a FIFO, a device) is refused, never written through. Nothing is
pickled.

Memory-mapped reads (``mmap=True``) map the file copy-on-write; as with numpy's memmap and
faiss's mmap IO, the file must not be modified while mapped (truncating it makes reads fault).
tqvec's own writers never modify a file in place (they rename a new one over it, which leaves a
mapping intact), and ``MappedFile.check`` - run by the indexes at each search - detects a change
of the mapped file's size or modification time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import mmap as _mmap
import os
import re
import stat
import struct
import time
import weakref
import zlib
from collections.abc import Callable, Mapping
from typing import IO, Any, NamedTuple

import numpy as np

from .errors import FormatError

__all__ = ["MAGIC", "FORMAT_VERSION", "Container", "MappedFile", "write_container",
           "read_container", "atomic_write", "check_writable", "open_regular", "temp_name",
           "create_temp"]

MAGIC = b"\x89TQV\r\n\x1a\n"
FORMAT_VERSION = 1
# A version field beyond this is damage, not a newer writer (one format change a year would
# take centuries to reach it).
_PLAUSIBLE_VERSION = 1000
_ALIGN = 64
_DTYPES = {"uint8", "int64", "int32", "float16", "float32", "float64"}
_MAX_HEADER = 64 << 20
_MAX_ARRAYS = 4096
_TEMP_NAME = re.compile(r"\.tqvec-(?P<r>[0-9a-f]{16})(?P<tag>[0-9a-f]{8})\.tmp")
#: A temporary file is stale when its name is one ``temp_name`` made, no writer holds its lock
#: and its last change is older than the write that finds it by this much (a writer between
#: creating and locking it, or on a file system whose locks do not reach other hosts).
_STALE_MARGIN_S = 600.0
# Python's json accepts these non-JSON literals; a header never holds them.
_NON_JSON = {"NaN", "Infinity", "-Infinity"}


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


# -- writing ---------------------------------------------------------------------------------

def check_writable(path: str | os.PathLike, name: str = "path") -> str:
    """``path`` as a str if it names a regular file or nothing yet; a symlink, directory, FIFO
    or device is refused (ValueError): writes replace the name, never write through it."""
    p = os.fsdecode(path)  # str, bytes or a path object
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return p
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{name} must name a regular file or a new file, got {p!r}, which is "
                         f"{_kind_of(st.st_mode)}")
    return p


def _tag(r: str) -> str:
    return f"{zlib.crc32(b'tqvec temporary ' + r.encode()):08x}"


def temp_name() -> str:
    """A new name for ``atomic_write``'s temporary file: ``.tqvec-<16 hex><8 hex tag>.tmp``,
    the tag a checksum of the random part, so that only files a tqvec writer named are ever
    taken for its stale temporaries (a user's ``.tqvec-notes.tmp`` is not)."""
    r = os.urandom(8).hex()
    return f".tqvec-{r}{_tag(r)}.tmp"


def _is_temp_name(name: str) -> bool:
    m = _TEMP_NAME.fullmatch(name)
    return m is not None and m["tag"] == _tag(m["r"])


def create_temp(folder: str) -> tuple[int, str]:
    """Create a new temporary file in ``folder`` (fd, path), with the mode a plain ``open``
    gives (0666 less the umask, which the kernel applies: the process umask is never changed,
    so no other thread can create a file while it is 0)."""
    for _ in range(100):
        tmp = os.path.join(folder, temp_name())
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                         0o666)
        except FileExistsError:
            continue
        return fd, tmp
    raise FileExistsError(f"could not create a temporary file in {folder!r}")


def _remove_stale_temps(folder: str, started: float) -> None:
    """Delete the temporaries of killed tqvec writers in ``folder``: files named by
    ``temp_name`` that no live writer holds (their lock is free) and that are older than
    ``started`` by ``_STALE_MARGIN_S``; never follows links."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for e in entries:
        if not _is_temp_name(e.name):
            continue
        try:
            fd = os.open(e.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_mtime > started - _STALE_MARGIN_S:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live writer holds it
            with contextlib.suppress(OSError):
                if os.path.samestat(os.lstat(e.path), st):
                    os.unlink(e.path)
        finally:
            os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Write a file atomically: ``write(f)`` fills a locked temporary file in the target's
    folder, which is fsynced and renamed over ``path`` (the old file, if any, stays whole until
    the rename). Refuses targets that are not regular files (``check_writable``); removes the
    temporary on any failure, and stale temporaries of killed writers first."""
    path = check_writable(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(2, f"path {path!r} is in a folder that does not exist "
                                   f"({folder!r}): create it first", path)
    _remove_stale_temps(folder, time.time())
    fd, tmp = create_temp(folder)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until the rename: a live temporary is not stale
        with os.fdopen(fd, "wb", closefd=False) as f:
            write(f)
            f.flush()
            os.fsync(fd)
        check_writable(path)  # nothing replaced the target by a link meanwhile
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    try:  # make the rename durable
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def write_container(path: str | os.PathLike, kind: str, meta: Mapping[str, Any],
                    arrays: Mapping[str, np.ndarray]) -> None:
    """Atomically write ``arrays`` with a JSON ``meta`` under ``kind``."""
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
                            sort_keys=True, allow_nan=False).encode()
        if len(header) == offset_guess:
            break
        offset_guess = len(header)

    def write(f: IO[bytes]) -> None:
        f.write(MAGIC + struct.pack("<II", FORMAT_VERSION, len(header)) + header)
        f.write(hashlib.sha256(header).digest())
        at = 16 + len(header) + 32
        for e, a in zip(entries, arrs.values(), strict=True):
            f.write(b"\0" * (e["offset"] - at))
            f.write(a.tobytes())
            at = e["offset"] + e["nbytes"]

    atomic_write(path, write)


# -- reading ---------------------------------------------------------------------------------

class MappedFile:
    """The file behind memory-mapped arrays: ``check()`` raises ``FormatError`` if its size or
    modification time changed since it was mapped (a truncation would make reads fault, an
    in-place rewrite would change results). It watches the mapped file itself (a descriptor is
    kept open), so a new file renamed over the path - how tqvec writes - is no change."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd = os.dup(fd)
        self._finalizer = weakref.finalize(self, os.close, self._fd)
        st = os.fstat(self._fd)
        self._sig = (st.st_size, st.st_mtime_ns)

    def check(self) -> None:
        st = os.fstat(self._fd)
        if (st.st_size, st.st_mtime_ns) != self._sig:
            raise FormatError(f"{self.path!r} was modified while memory-mapped (size "
                              f"{self._sig[0]} -> {st.st_size}); a mapped file must not change: "
                              f"read it again")


class Container(NamedTuple):
    """What ``read_container`` returns: the header's meta, the arrays by name, and the
    ``MappedFile`` they live in (None unless read with ``mmap=True``)."""

    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    mapped: MappedFile | None


def open_regular(path: str | os.PathLike) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading if it is a regular file: (fd, stat). A FIFO or a device is
    refused with ``FormatError`` without blocking; a directory raises ``IsADirectoryError`` and
    a missing file ``FileNotFoundError``, as ``open`` does."""
    p = os.fsdecode(path)
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "Is a directory", p)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{p!r} is not a tqvec file: it is {_kind_of(st.st_mode)}, not a "
                              "regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise FormatError(f"{what} must be an int in {lo}..{hi}, got {v!r:.80}")
    return v


def _parse_header(p: str, header: bytes, kind: str, hlen: int) -> tuple[dict, list[tuple]]:
    """(meta, [(name, dtype, shape, offset, nbytes, sha256)]) of a header, every field checked
    for type and range and the layout for being the writer's (FormatError otherwise)."""
    def no_constant(name: str) -> Any:
        raise FormatError(f"{p!r} has a malformed header: {name} is not JSON")

    try:
        doc = json.loads(header.decode("utf-8"), parse_constant=no_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise FormatError(f"{p!r} has a malformed header: {type(e).__name__}: {e!s:.200}") from e
    if not isinstance(doc, dict) or set(doc) != {"kind", "meta", "arrays"}:
        raise FormatError(f"{p!r} has a malformed header: expected the keys arrays, kind, meta")
    if doc["kind"] != kind:
        raise FormatError(f"{p!r} holds a {doc['kind']!r:.80}, expected {kind!r}")
    meta, entries = doc["meta"], doc["arrays"]
    if not isinstance(meta, dict) or not isinstance(entries, list) or len(entries) > _MAX_ARRAYS:
        raise FormatError(f"{p!r} has a malformed header: meta must be an object and arrays a "
                          f"list of at most {_MAX_ARRAYS}")
    out, names = [], set()
    at = 16 + hlen + 32
    for e in entries:
        if not isinstance(e, dict) or set(e) != {"name", "dtype", "shape", "offset", "nbytes",
                                                  "sha256"}:
            raise FormatError(f"{p!r} has a malformed array entry: {e!r:.200}")
        name, dt, shape, sha = e["name"], e["dtype"], e["shape"], e["sha256"]
        if not isinstance(name, str) or name in names:
            raise FormatError(f"{p!r} has a malformed array entry: name {name!r:.80} (a str, "
                              "each once)")
        names.add(name)
        if not isinstance(dt, str) or dt not in _DTYPES:
            raise FormatError(f"{p!r}: array {name!r} has unsupported dtype {dt!r:.80}")
        if not isinstance(shape, list) or len(shape) > 8:
            raise FormatError(f"{p!r}: array {name!r} has a malformed shape {shape!r:.80}")
        shape = tuple(_int(s, f"{p!r}: array {name!r}'s shape", 0, 1 << 62) for s in shape)
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise FormatError(f"{p!r}: array {name!r} has a malformed sha256 {sha!r:.80}")
        nbytes = _int(e["nbytes"], f"{p!r}: array {name!r}'s nbytes", 0, 1 << 62)
        want = np.dtype(dt).itemsize
        for s in shape:  # Python ints: no overflow
            want *= s
        if nbytes != want:
            raise FormatError(f"{p!r}: array {name!r} size {nbytes} does not match shape "
                              f"{shape} of {dt}")
        off = _int(e["offset"], f"{p!r}: array {name!r}'s offset", 0, 1 << 62)
        if off != _align(at):
            raise FormatError(f"{p!r}: array {name!r} must start at offset {_align(at)}, the "
                              f"header says {off}")
        out.append((name, dt, shape, off, nbytes, sha))
        at = off + nbytes
    return meta, out


def read_container(path: str | os.PathLike, kind: str, *, mmap: bool = False,
                   verify: bool = True) -> Container:
    """Read a container of ``kind``: ``Container(meta, arrays, mapped)``.

    mmap=True maps the arrays copy-on-write (the file is never modified; ``mapped.check()``
    tells whether it changed since). verify=True checks every array's sha256 (reads the whole
    file once, mapped or not).
    """
    p = os.fsdecode(path)
    fd, st = open_regular(p)
    with os.fdopen(fd, "rb") as f:
        size = st.st_size
        head = f.read(16)
        if head[:8] != MAGIC[: len(head[:8])] or not head:
            raise FormatError(f"{p!r} is not a tqvec file (it starts with {head[:8]!r}, a tqvec "
                              f"file with {MAGIC!r})")
        if len(head) < 16:
            raise FormatError(f"{p!r} is truncated: {size} bytes, a tqvec file has at least 48")
        version, hlen = struct.unpack("<II", head[8:16])
        if version < 1 or version > _PLAUSIBLE_VERSION:
            raise FormatError(f"{p!r} is damaged: its format version field reads {version}, "
                              f"which no tqvec writes (this one reads 1..{FORMAT_VERSION})")
        if version > FORMAT_VERSION:
            raise FormatError(f"{p!r} has format version {version}, newer than this tqvec reads "
                              f"(1..{FORMAT_VERSION}): upgrade tqvec")
        if hlen > min(_MAX_HEADER, size - 48):
            raise FormatError(f"{p!r} is truncated or corrupted (header length {hlen}, "
                              f"file size {size})")
        header = f.read(hlen)
        digest = f.read(32)
        if len(header) != hlen or len(digest) != 32:
            raise FormatError(f"{p!r} is truncated (header incomplete)")
        if hashlib.sha256(header).digest() != digest:
            raise FormatError(f"{p!r} is corrupted (header checksum mismatch)")
        meta, entries = _parse_header(p, header, kind, hlen)
        end = entries[-1][3] + entries[-1][4] if entries else 16 + hlen + 32
        if size != end:
            raise FormatError(f"{p!r} is {'truncated' if size < end else 'corrupted'}: its "
                              f"arrays end at byte {end}, the file has {size}")
        mm = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_COPY) if mmap and size else None
        mapped = MappedFile(p, f.fileno()) if mm is not None else None
        arrays: dict[str, np.ndarray] = {}
        at = 16 + hlen + 32
        for name, dt, shape, off, nbytes, sha in entries:
            if off > at:  # the padding before the array is zero, as written
                if mm is not None:
                    pad = mm[at:off]
                else:
                    f.seek(at)
                    pad = f.read(off - at)
                if pad.count(0) != off - at:
                    raise FormatError(f"{p!r} is corrupted: non-zero padding before array "
                                      f"{name!r}")
            if mm is not None:
                a = np.frombuffer(mm, dtype=dt, count=nbytes // np.dtype(dt).itemsize,
                                  offset=off).reshape(shape)
            else:
                f.seek(off)
                raw = bytearray(nbytes)
                if f.readinto(raw) != nbytes:
                    raise FormatError(f"{p!r} is truncated: array {name!r} is incomplete")
                a = np.frombuffer(raw, dtype=dt).reshape(shape)
            if verify and hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest() != sha:
                raise FormatError(f"{p!r} is corrupted: array {name!r} checksum mismatch")
            arrays[name] = a
            at = off + nbytes
    return Container(meta, arrays, mapped)
