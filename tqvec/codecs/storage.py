"""save_codes / load_codes on top of the container format (tqvec.io)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from ..errors import FormatError
from ..io import read_container, write_container
from .base import Codes, codec_from_params

__all__ = ["save_codes", "load_codes"]

_KIND = "codes"


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


def load_codes(path: str | os.PathLike, *, mmap: bool = False, verify: bool = True) -> Codes:
    """Read codes written by ``save_codes``; raises ``FormatError`` on any damage, and when this
    tqvec would materialize a different rotation/codebook for the stored params."""
    meta, arrays = read_container(path, _KIND, mmap=mmap, verify=verify)
    try:
        params: dict[str, Any] = meta["params"]
        codec = codec_from_params(params)
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{os.fspath(path)!r} has invalid codec params: {e}") from e
    if codec.fingerprint() != meta.get("fingerprint"):
        raise FormatError(f"{os.fspath(path)!r} was written with a different rotation/codebook "
                          "for the same params (fingerprint mismatch); decoding would be wrong")
    if "payload" not in arrays:
        raise FormatError(f"{os.fspath(path)!r} has no payload array")
    payload = torch.from_numpy(arrays["payload"])
    scalars = {k[len("scalar."):]: torch.from_numpy(np.asarray(v))
               for k, v in arrays.items() if k.startswith("scalar.")}
    try:
        codes = Codes(payload, scalars, params)
        codec.check_codes(codes)
    except (TypeError, ValueError) as e:
        raise FormatError(f"{os.fspath(path)!r} does not match its codec: {e}") from e
    return codes
