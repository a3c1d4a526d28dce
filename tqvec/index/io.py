"""write_index / read_index: the container format of tqvec.io with kind "index"."""

from __future__ import annotations

import os

import numpy as np
import torch

from ..codecs.base import Codec, Codes, codec_from_params
from ..errors import FormatError
from ..io import read_container, write_container
from .flat import FlatIndex, metric_name
from .ivf import IVFIndex
from .pca import PCAIndex

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


def _ipcorr_from(arrays: dict, ntotal: int, name: str = "ipcorr") -> torch.Tensor:
    """An inner-product index's per-row correction (a centred flat index's ``ipcorr``, an IVF
    index's ``ivf.rowterm``); zeros (the estimator without it) for files written before it
    existed."""
    if name not in arrays:
        return torch.zeros(ntotal, dtype=torch.float32)
    corr = torch.from_numpy(np.array(arrays[name], dtype=np.float32))
    if corr.shape != (ntotal,) or not torch.isfinite(corr).all():
        raise ValueError(f"{name} must be {ntotal} finite float32 values, got "
                         f"{tuple(corr.shape)}")
    return corr


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


def read_index(path: str | os.PathLike, mmap: bool = False, verify: bool = True
               ) -> FlatIndex | IVFIndex | PCAIndex:
    """Read an index written by ``write_index``; ``mmap=True`` maps the codes copy-on-write."""
    meta, arrays = read_container(path, _KIND, mmap=mmap, verify=verify)
    p = os.fspath(path)
    try:
        codec = codec_from_params(meta["params"])
        refine = meta["refine"]
        ref_codec = codec_from_params(refine["params"]) if isinstance(refine, dict) else refine
        if meta["type"] == "ivf":
            index = IVFIndex(codec, meta["nlist"], meta["metric"], refine=ref_codec,
                             k_factor=meta["k_factor"], nprobe=meta["nprobe"],
                             seed=meta["seed"], niter=meta["niter"])
        elif meta["type"] == "flat":
            center = None
            if meta.get("centered"):
                if "center" not in arrays:
                    raise ValueError("arrays must hold 'center' for a centred index")
                center = np.array(arrays["center"], dtype=np.float32)
            index = FlatIndex(codec, meta["metric"], refine=ref_codec,
                              k_factor=meta["k_factor"], prefilter=meta.get("prefilter", 0),
                              center=center)
        else:
            raise ValueError(f"type must be 'flat' or 'ivf', got {meta['type']!r}")
        ntotal = int(meta["ntotal"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{p!r} has an invalid index header: {e}") from e
    if codec.fingerprint() != meta.get("fingerprint") or (
            isinstance(refine, dict) and ref_codec.fingerprint() != refine.get("fingerprint")):
        raise FormatError(f"{p!r} was written with a different rotation/codebook (fingerprint "
                          "mismatch); its codes would decode wrongly")
    try:
        if isinstance(index, IVFIndex) and meta["trained"]:
            cent = torch.from_numpy(np.array(arrays["ivf.centroids"], dtype=np.float32))
            if cent.shape != (index.nlist, index.d) or not torch.isfinite(cent).all():
                raise ValueError(f"centroids must be finite ({index.nlist}, {index.d}), got "
                                 f"{tuple(cent.shape)}")
            index.centroids, index.is_trained = cent, True
        if ntotal and isinstance(index, IVFIndex):
            lists = torch.from_numpy(np.array(arrays["ivf.lists"], dtype=np.int64))
            if not index.is_trained or lists.shape != (ntotal,) or (
                    ntotal and (int(lists.min()) < 0 or int(lists.max()) >= index.nlist)):
                raise ValueError(f"lists must be {ntotal} list numbers < {index.nlist}")
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
            if isinstance(index, IVFIndex):
                index._lists = lists
                index._rowterm = (_ipcorr_from(arrays, ntotal, "ivf.rowterm")
                                  if index._corrects_ip else index._row_terms(lists, codes))
            else:
                index._sqnorms = index._sqnorms_of(codec, codes)
                if index._corrects_ip:
                    index._ipcorr = _ipcorr_from(arrays, ntotal)
        index._next_id = int(meta["next_id"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{p!r} does not match its header: {e}") from e
    if "pca" in meta:
        try:
            return _pca_from(meta, arrays, index)
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{p!r} has an invalid PCA basis: {e}") from e
    return index


def _pca_from(meta: dict, arrays: dict, index: FlatIndex | IVFIndex) -> PCAIndex:
    """Wrap the inner index of a ``PCAIndex`` file again, checking its fit."""
    if type(index) is not FlatIndex or not index.centered:
        raise ValueError("a PCA index must hold a centred flat index")
    d = index.d
    basis = torch.from_numpy(np.array(arrays["pca.basis"], dtype=np.float32))
    var = np.array(arrays["pca.variances"], dtype=np.float32)
    if basis.shape != (d, d) or var.shape != (d,) or not torch.isfinite(basis).all() or (
            not np.isfinite(var).all()):
        raise ValueError(f"basis must be finite ({d}, {d}) and variances ({d},), got "
                         f"{tuple(basis.shape)} and {var.shape}")
    # orthonormal columns, or distances in the basis are not the original ones
    err = float((basis.T.double() @ basis.double() - torch.eye(d, dtype=torch.float64)).abs().max())
    if err > 1e-3:
        raise ValueError(f"basis must be orthogonal, got max |V^T V - I| = {err:.3g}")
    pca = PCAIndex(d, int(meta["pca"]["bits"]), index.metric_type, refine=index.refine,
                   k_factor=index.k_factor, prefilter=index.prefilter,
                   seed=int(meta["pca"]["seed"]))
    pca._install(basis, var, index)
    return pca
