"""save_codes / load_codes on top of the container format (tqvec.io)."""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import _validate as V
from ..errors import BackendUnavailable, FormatError
from ..io import read_container, write_container
from .base import Codec, Codes, codec_from_params

__all__ = ["save_codes", "load_codes", "codec_from_header", "check_fingerprint",
           "verify_fingerprints", "PendingFingerprints", "codes_from_arrays"]

_KIND = "codes"
_META = {"params", "fingerprint", "n", "code_size"}
#: What a malformed header's values raise while they are turned into objects: all of them mean
#: "this file is bad" and become FormatError.
HEADER_ERRORS = (KeyError, TypeError, ValueError, IndexError, OverflowError, RecursionError,
                 BackendUnavailable)


def save_codes(path: str | os.PathLike, codes: Codes) -> None:
    """Write ``codes`` atomically with the codec params, seed and rotation fingerprint."""
    if not isinstance(codes, Codes):
        raise TypeError(f"codes must be tqvec.Codes, got {type(codes).__name__}")
    codec = codec_from_params(codes.params)
    arrays = {"payload": codes.payload.cpu().numpy()}
    for k, v in codes.scalars.items():
        arrays[f"scalar.{k}"] = v.cpu().numpy()
    meta = {"params": dict(codes.params), "fingerprint": codec.fingerprint(), "n": len(codes),
            "code_size": codes.code_size}
    write_container(path, _KIND, meta, arrays)


def codec_from_header(path: str, params: Any, what: str = "codec") -> Codec:
    """The codec of a file's ``params``, in the canonical form tqvec writes, every size within
    ``tqvec._validate``'s limits. Building it draws nothing (codecs materialize their rotation
    and codebooks at first use), so a header is checked against the file's arrays before
    anything large is allocated."""
    try:
        return codec_from_params(params, strict=True)
    except HEADER_ERRORS as e:
        raise FormatError(f"{path!r} has invalid {what} params: {e}") from e


def check_fingerprint(path: str, codec: Codec, fingerprint: Any, what: str = "codec") -> None:
    """The stored fingerprint must be that of the rotation and codebooks this tqvec draws for
    the codec (drawn here); a file whose codes would decode wrongly is refused."""
    if codec.fingerprint() != fingerprint:
        raise FormatError(f"{path!r} was written with a different rotation/codebook for the same "
                          f"{what} params (fingerprint mismatch); decoding would be wrong")


#: Draw work (``Codec.draw_work``) a reader spends on checking fingerprints at once, beyond
#: ``_DRAW_PER_BYTE`` per byte of the file's arrays (docs/formats.md gives the bound).
_DRAW_FREE = 1 << 22
_DRAW_PER_BYTE = 64


class PendingFingerprints:
    """A file's fingerprint checks deferred to the first use of what it holds, where drawing
    the codec's arrays would cost far more than reading the file (a small file whose header
    claims a large dimension): ``check()`` draws and compares them once, raising
    ``FormatError`` on a mismatch, then checks the memory-mapped file it wraps (if any). It
    stands where a ``MappedFile`` would (``Codes.source``, an index's mapped file)."""

    def __init__(self, path: str, checks: list[tuple[Codec, Any, str]], mapped: Any):
        self.path = path
        self._checks = checks
        self._mapped = mapped

    def check(self) -> None:
        if self._checks:
            for codec, fingerprint, what in self._checks:
                check_fingerprint(self.path, codec, fingerprint, what)
            self._checks = []
        if self._mapped is not None:
            self._mapped.check()


def verify_fingerprints(path: str, checks: list[tuple[Codec, Any, str]], file_bytes: int,
                        mapped: Any) -> Any:
    """Check each (codec, stored fingerprint, what) now where its draw is cheap next to the
    file's ``file_bytes``; returns what the loaded object checks at each use instead of
    ``mapped``: ``mapped`` itself, or a ``PendingFingerprints`` holding the costly checks. So
    refusing or loading a file costs time and memory bounded by its size plus a constant,
    whatever its header claims."""
    budget = _DRAW_FREE + _DRAW_PER_BYTE * file_bytes
    later = []
    for codec, fingerprint, what in checks:
        if codec.draw_work() <= budget:
            check_fingerprint(path, codec, fingerprint, what)
        else:
            later.append((codec, fingerprint, what))
    return PendingFingerprints(path, later, mapped) if later else mapped


def codes_from_arrays(path: str, codec: Codec, arrays: dict[str, Any], prefix: str, n: int,
                      source: Any = None) -> Codes:
    """The ``Codes`` stored under ``prefix`` (``payload``, ``scalar.<name>``), which must be
    ``n`` rows of ``codec``'s layout with finite scalars (FormatError otherwise)."""
    payload = arrays.get(f"{prefix}payload")
    if payload is None:
        raise FormatError(f"{path!r} has no {prefix}payload array")
    sc = {k[len(prefix) + 7:]: torch.from_numpy(v) for k, v in arrays.items()
          if k.startswith(f"{prefix}scalar.")}
    try:  # checked without ``source``: a deferred fingerprint check waits for the first use
        codes = codec.check_codes(Codes(torch.from_numpy(payload), sc, codec.params))
    except (TypeError, ValueError) as e:
        raise FormatError(f"{path!r} does not match its codec: {e}") from e
    codes = Codes(codes.payload, codes.scalars, codes.params, source)
    if len(codes) != n:
        raise FormatError(f"{path!r} says it holds {n} vectors, its arrays hold {len(codes)}")
    for k, v in codes.scalars.items():
        if v.numel() and not bool(torch.isfinite(v).all()):
            raise FormatError(f"{path!r} is corrupted: non-finite {prefix}scalar.{k}")
    return codes


def load_codes(path: str | os.PathLike, *, mmap: bool = False, verify: bool = True) -> Codes:
    """Read codes written by ``save_codes``; raises ``FormatError`` on any damage, and when this
    tqvec would materialize a different rotation/codebook for the stored params. With
    ``mmap=True`` the codes read the file in place: it must not change while they are used
    (each use checks its size and modification time)."""
    p = os.fspath(path)
    meta, arrays, mapped = read_container(p, _KIND, mmap=mmap, verify=verify)
    if set(meta) != _META:
        raise FormatError(f"{p!r} has a malformed codes header: keys {sorted(meta)}, expected "
                          f"{sorted(_META)}")
    codec = codec_from_header(p, meta["params"])
    try:
        n = V.positive_int(meta["n"], "n", 0, V.INT64_MAX)
    except HEADER_ERRORS as e:
        raise FormatError(f"{p!r} has a malformed codes header: {e}") from e
    expected = {"payload", *(f"scalar.{k}" for k in codec.scalar_layout())}
    if set(arrays) != expected:
        raise FormatError(f"{p!r} must hold the arrays {sorted(expected)}, got {sorted(arrays)}")
    codes = codes_from_arrays(p, codec, arrays, "", n, mapped)
    if meta["code_size"] != codes.code_size:
        raise FormatError(f"{p!r} says {meta['code_size']!r:.40} bytes per vector, its codes "
                          f"have {codes.code_size}")
    if n:  # no codes, nothing to decode wrongly: the rotation is drawn only when used
        source = verify_fingerprints(p, [(codec, meta["fingerprint"], "codec")],
                                     sum(a.nbytes for a in arrays.values()), mapped)
        if source is not mapped:
            codes = Codes(codes.payload, codes.scalars, codes.params, source)
    return codes
