"""write_index / read_index: the container format of tqvec.io with kind "index"."""

from __future__ import annotations

import os

import numpy as np
import torch

from ..codecs.base import Codec, Codes, codec_from_params
from ..errors import FormatError
from ..io import read_container, write_container
from .flat import FlatIndex, metric_name

__all__ = ["write_index", "read_index"]

_KIND = "index"


def _codes_arrays(prefix: str, codes: Codes | None, out: dict) -> None:
    if codes is None:
        return
    out[f"{prefix}.payload"] = codes.payload.cpu().numpy()
    for k, v in codes.scalars.items():
        out[f"{prefix}.scalar.{k}"] = v.cpu().numpy()


def _codes_from(prefix: str, arrays: dict, codec: Codec) -> Codes:
    payload = torch.from_numpy(np.asarray(arrays[f"{prefix}.payload"]))
    sc = {k[len(prefix) + 8:]: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()
          if k.startswith(f"{prefix}.scalar.")}
    return codec.check_codes(Codes(payload, sc, codec.params))


def write_index(index: FlatIndex, path: str | os.PathLike) -> None:
    """Write an index atomically (versioned, checksummed, never pickled)."""
    if not isinstance(index, FlatIndex):
        raise TypeError(f"index must be a tqvec FlatIndex, got {type(index).__name__}")
    arrays: dict[str, np.ndarray] = {"ids": index._ids.numpy()}
    _codes_arrays("codes", index._codes, arrays)
    refine = None
    if isinstance(index.refine, Codec):
        refine = {"params": index.refine.params, "fingerprint": index.refine.fingerprint()}
        _codes_arrays("refine", index._ref, arrays)
    elif index.refine == "flat":
        refine = "flat"
        if index._ref is not None:
            arrays["refine.vectors"] = index._ref.numpy()
    meta = {"type": "flat", "params": index.codec.params,
            "fingerprint": index.codec.fingerprint(), "metric": metric_name(index.metric_type),
            "ntotal": index.ntotal, "next_id": index._next_id, "refine": refine,
            "k_factor": index.k_factor}
    write_container(path, _KIND, meta, arrays)


def read_index(path: str | os.PathLike, mmap: bool = False, verify: bool = True) -> FlatIndex:
    """Read an index written by ``write_index``; ``mmap=True`` maps the codes copy-on-write."""
    meta, arrays = read_container(path, _KIND, mmap=mmap, verify=verify)
    p = os.fspath(path)
    try:
        codec = codec_from_params(meta["params"])
        refine = meta["refine"]
        ref_codec = codec_from_params(refine["params"]) if isinstance(refine, dict) else refine
        index = FlatIndex(codec, meta["metric"], refine=ref_codec, k_factor=meta["k_factor"])
        ntotal = int(meta["ntotal"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{p!r} has an invalid index header: {e}") from e
    if codec.fingerprint() != meta.get("fingerprint") or (
            isinstance(refine, dict) and ref_codec.fingerprint() != refine.get("fingerprint")):
        raise FormatError(f"{p!r} was written with a different rotation/codebook (fingerprint "
                          "mismatch); its codes would decode wrongly")
    try:
        if ntotal:
            ids = torch.from_numpy(np.asarray(arrays["ids"]))
            codes = _codes_from("codes", arrays, codec)
            if len(codes) != ntotal or ids.shape != (ntotal,):
                raise ValueError(f"ntotal {ntotal} does not match the stored arrays")
            index._codes, index._ids, index._n = codes, ids, ntotal
            if isinstance(ref_codec, Codec):
                index._ref = _codes_from("refine", arrays, ref_codec)
            elif ref_codec == "flat":
                index._ref = torch.from_numpy(np.asarray(arrays["refine.vectors"]))
            index._sqnorms = index._sqnorms_of(codec, codes)
        index._next_id = int(meta["next_id"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{p!r} does not match its header: {e}") from e
    return index
