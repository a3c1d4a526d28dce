"""write_index / read_index: the container format of tqvec.io with kind "index".

The reader trusts nothing in a file but its checksums: every header value is type- and
range-checked (the constructors' own checks, whose limits bound what a value can make tqvec
allocate), every count must agree with the arrays, and the file must hold exactly the arrays
its header implies. Anything else is a ``FormatError``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .. import _validate as V
from ..codecs.base import Codec, Codes
from ..codecs.storage import (
    HEADER_ERRORS,
    check_fingerprint,
    codec_from_header,
    codes_from_arrays,
)
from ..errors import FormatError
from ..io import read_container, write_container
from .flat import FlatIndex, metric_name
from .ivf import IVFIndex
from .pca import PCAIndex

__all__ = ["write_index", "read_index"]

_KIND = "index"
_FLAT_META = {"type", "params", "fingerprint", "metric", "ntotal", "next_id", "refine",
              "k_factor"}
_OPTIONAL_META = {"prefilter", "centered", "pca"}  # absent in files written before them
_IVF_META = {"nlist", "nprobe", "seed", "niter", "trained"}
_NOT_PER_ROW = {"center", "ivf.centroids", "pca.basis", "pca.variances"}


def _codes_arrays(prefix: str, codes: Codes | None, out: dict) -> None:
    if codes is None:
        return
    out[f"{prefix}.payload"] = codes.payload.cpu().numpy()
    for k, v in codes.scalars.items():
        out[f"{prefix}.scalar.{k}"] = v.cpu().numpy()


def write_index(index: FlatIndex | IVFIndex | PCAIndex, path: str | os.PathLike) -> None:
    """Write an index atomically (versioned, checksummed, never pickled)."""
    pca = None
    if isinstance(index, PCAIndex):
        if index.index is None:
            raise ValueError("index must be trained before it is written (PCA,TQ{b} has no "
                             "basis yet)")
        pca, index = index, index.index
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
            "k_factor": index.k_factor, "prefilter": index.prefilter,
            "centered": bool(getattr(index, "centered", False))}
    if meta["centered"]:
        if index.center is None:
            raise ValueError("index must be trained before it is written (center='fit' has no "
                             "center yet)")
        arrays["center"] = index.center
        if index._ipcorr.numel():
            arrays["ipcorr"] = index._ipcorr.cpu().numpy()
    if isinstance(index, IVFIndex):
        meta.update(type="ivf", nlist=index.nlist, nprobe=index.nprobe, seed=index.seed,
                    niter=index.niter, trained=index.is_trained)
        if index.is_trained:
            arrays["ivf.centroids"] = index.centroids.numpy()
            arrays["ivf.lists"] = index._lists.numpy()
            if index._corrects_ip:  # a <c, r> - est<c, r>: not derivable from the codes
                arrays["ivf.rowterm"] = index._rowterm.numpy()
    if pca is not None:  # the inner index works in the basis; the wrapper's fit rides along
        meta["pca"] = {"bits": pca.bits, "seed": pca.seed}
        arrays["pca.basis"] = pca.basis.numpy()
        arrays["pca.variances"] = pca.variances
    write_container(path, _KIND, meta, arrays)


def _float_rows(arrays: dict, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A stored float32 array of ``shape`` with finite values (ValueError otherwise)."""
    a = arrays[name]
    if a.dtype != np.float32 or a.shape != shape:
        raise ValueError(f"{name} must be float32 of shape {shape}, got {a.dtype} {a.shape}")
    t = torch.from_numpy(a)
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite")
    return t


def _expected_arrays(meta: dict, codec: Codec, ref_codec: Any, ntotal: int
                     ) -> tuple[set[str], set[str]]:
    """(required, optional) array names of a header: a file holds the required ones, any of
    the optional ones (written by some versions only) and nothing else."""
    codes = {"codes.payload", *(f"codes.scalar.{k}" for k in codec.scalar_layout())}
    ref = set()
    if isinstance(ref_codec, Codec):
        ref = {"refine.payload", *(f"refine.scalar.{k}" for k in ref_codec.scalar_layout())}
    elif ref_codec == "flat":
        ref = {"refine.vectors"}
    required, optional = {"ids"}, set()
    (required if ntotal else optional).update(codes | ref)
    if meta.get("centered"):
        required.add("center")
        optional.add("ipcorr")
    if meta["type"] == "ivf" and meta["trained"]:
        required.add("ivf.centroids")
        (required if ntotal else optional).add("ivf.lists")
        optional.add("ivf.rowterm")
    if "pca" in meta:
        required.update({"pca.basis", "pca.variances"})
    return required, optional


def read_index(path: str | os.PathLike, mmap: bool = False, verify: bool = True
               ) -> FlatIndex | IVFIndex | PCAIndex:
    """Read an index written by ``write_index``; ``mmap=True`` maps the codes copy-on-write (the
    file must then not change while the index is used: each search checks its size and
    modification time)."""
    p = os.fspath(path)
    meta, arrays, mapped = read_container(p, _KIND, mmap=mmap, verify=verify)
    keys = set(meta)
    kind = meta.get("type")
    want = _FLAT_META | (_IVF_META if kind == "ivf" else set())
    if kind not in ("flat", "ivf") or not want <= keys <= want | _OPTIONAL_META:
        raise FormatError(f"{p!r} has a malformed index header: type {kind!r:.40}, keys "
                          f"{sorted(keys)}")
    codec = codec_from_header(p, meta["params"])
    refine = meta["refine"]
    if isinstance(refine, dict):
        if set(refine) != {"params", "fingerprint"}:
            raise FormatError(f"{p!r} has a malformed refinement: keys {sorted(refine)}")
        ref_codec: Any = codec_from_header(p, refine["params"], "refinement codec")
    elif refine is None or refine == "flat":
        ref_codec = refine
    else:
        raise FormatError(f"{p!r} has a malformed refinement {refine!r:.80}")
    try:
        index = _index_from(meta, codec, ref_codec, arrays)
    except HEADER_ERRORS as e:
        raise FormatError(f"{p!r} has an invalid index header: {e}") from e
    ntotal = index._n
    required, optional = _expected_arrays(meta, codec, ref_codec, ntotal)
    if not required <= set(arrays) <= required | optional:
        raise FormatError(f"{p!r} must hold the arrays {sorted(required)} (and optionally "
                          f"{sorted(optional)}), got {sorted(arrays)}")
    for name, a in arrays.items():  # one row per vector, however many the header says
        if name not in _NOT_PER_ROW and (a.ndim == 0 or a.shape[0] != ntotal):
            raise FormatError(f"{p!r} says it holds {ntotal} vectors, array {name!r} has shape "
                              f"{a.shape}")
    if ntotal:  # the arrays agree with the header: now the rotations may be drawn
        check_fingerprint(p, codec, meta["fingerprint"])
        if isinstance(ref_codec, Codec):
            check_fingerprint(p, ref_codec, refine["fingerprint"], "refinement codec")
    try:
        _fill(index, meta, arrays, ref_codec, p, mapped)
    except HEADER_ERRORS as e:
        raise FormatError(f"{p!r} does not match its header: {e}") from e
    if "pca" in meta:
        try:
            return _pca_from(meta, arrays, index)
        except HEADER_ERRORS as e:
            raise FormatError(f"{p!r} has an invalid PCA basis: {e}") from e
    return index


def _index_from(meta: dict, codec: Codec, ref_codec: Any, arrays: dict
                ) -> FlatIndex | IVFIndex:
    """The empty index a header describes, its values checked by the constructors; ``_n``
    holds the header's ntotal."""
    ntotal = V.positive_int(meta["ntotal"], "ntotal", 0, V.INT64_MAX)
    centered = meta.get("centered", False)
    if not isinstance(centered, bool):
        raise TypeError(f"centered must be a bool, got {centered!r:.40}")
    if meta["type"] == "ivf":
        if centered or "prefilter" in meta and meta["prefilter"] != 0 or "pca" in meta:
            raise ValueError("an IVF index has no center, prefilter or PCA basis")
        if not isinstance(meta["trained"], bool):
            raise TypeError(f"trained must be a bool, got {meta['trained']!r:.40}")
        index: FlatIndex = IVFIndex(codec, meta["nlist"], meta["metric"], refine=ref_codec,
                                    k_factor=meta["k_factor"], nprobe=meta["nprobe"],
                                    seed=meta["seed"], niter=meta["niter"])
    else:
        center = None
        if centered:
            if "center" not in arrays:
                raise ValueError("arrays must hold 'center' for a centred index")
            center = _float_rows(arrays, "center", (codec.dim,)).numpy().copy()
        index = FlatIndex(codec, meta["metric"], refine=ref_codec, k_factor=meta["k_factor"],
                          prefilter=meta.get("prefilter", 0), center=center)
    index._n = ntotal
    return index


def _fill(index: FlatIndex, meta: dict, arrays: dict, ref_codec: Any, p: str,
          mapped: Any) -> None:
    """Install the stored rows into the empty ``index`` (its ``_n`` is the header's ntotal),
    every array checked against it; derived per-row state is recomputed."""
    ntotal, d = index._n, index.d
    index._n = 0
    if isinstance(index, IVFIndex) and meta["trained"]:
        index.centroids = _float_rows(arrays, "ivf.centroids", (index.nlist, d)).clone()
        index.is_trained = True
    if isinstance(index, IVFIndex) and ntotal and not index.is_trained:
        raise ValueError(f"an untrained IVF index must be empty, got ntotal={ntotal}")
    ids = arrays["ids"]
    if ids.dtype != np.int64 or ids.shape != (ntotal,):
        raise ValueError(f"ids must be int64 of shape ({ntotal},), got {ids.dtype} {ids.shape}")
    next_id = V.positive_int(meta["next_id"], "next_id", 0, V.INT64_MAX + 1)
    if ntotal and next_id <= int(ids.max()):
        raise ValueError(f"next_id must exceed every stored id, got {next_id} <= {int(ids.max())}")
    if ntotal:
        codes = codes_from_arrays(p, index.codec, arrays, "codes.", ntotal, mapped)
        if isinstance(index, IVFIndex):
            lists = arrays["ivf.lists"]
            if lists.dtype != np.int64 or lists.shape != (ntotal,) or (
                    int(lists.min()) < 0 or int(lists.max()) >= index.nlist):
                raise ValueError(f"ivf.lists must be {ntotal} int64 list numbers < "
                                 f"{index.nlist}")
            lists = torch.from_numpy(lists)
        index._codes, index._ids, index._n = codes, torch.from_numpy(ids), ntotal
        if isinstance(ref_codec, Codec):
            index._ref = codes_from_arrays(p, ref_codec, arrays, "refine.", ntotal, mapped)
        elif ref_codec == "flat":
            index._ref = _float_rows(arrays, "refine.vectors", (ntotal, d))
        if isinstance(index, IVFIndex):
            index._lists = lists
            index._rowterm = (_row_correction(arrays, ntotal, "ivf.rowterm")
                              if index._corrects_ip else index._row_terms(lists, codes))
        else:
            index._sqnorms = index._sqnorms_of(index.codec, codes)
            if index._corrects_ip:
                index._ipcorr = _row_correction(arrays, ntotal, "ipcorr")
    index._next_id = next_id
    index._mapped = mapped


def _row_correction(arrays: dict, ntotal: int, name: str) -> torch.Tensor:
    """An inner-product index's per-row correction (a centred flat index's ``ipcorr``, an IVF
    index's ``ivf.rowterm``); zeros (the estimator without it) for files written before it
    existed."""
    if name not in arrays:
        return torch.zeros(ntotal, dtype=torch.float32)
    return _float_rows(arrays, name, (ntotal,)).clone()


def _pca_from(meta: dict, arrays: dict, index: FlatIndex | IVFIndex) -> PCAIndex:
    """Wrap the inner index of a ``PCAIndex`` file again, checking its fit."""
    if type(index) is not FlatIndex or not index.centered:
        raise ValueError("a PCA index must hold a centred flat index")
    fit = meta["pca"]
    if not isinstance(fit, dict) or set(fit) != {"bits", "seed"}:
        raise ValueError(f"pca must be an object with bits and seed, got {fit!r:.80}")
    d = index.d
    basis = _float_rows(arrays, "pca.basis", (d, d)).clone()
    var = _float_rows(arrays, "pca.variances", (d,)).numpy().copy()
    # orthonormal columns, or distances in the basis are not the original ones
    err = float((basis.T.double() @ basis.double() - torch.eye(d, dtype=torch.float64)).abs().max())
    if err > 1e-3:
        raise ValueError(f"basis must be orthogonal, got max |V^T V - I| = {err:.3g}")
    pca = PCAIndex(d, fit["bits"], index.metric_type, refine=index.refine,
                   k_factor=index.k_factor, prefilter=index.prefilter, seed=fit["seed"])
    pca._install(basis, var, index)
    return pca
