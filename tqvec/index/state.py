"""An index as (meta, arrays) - what ``tqvec.index.io`` writes - and back.

``index_state`` turns any index into a JSON-able meta dict and named numpy arrays;
``index_from_state`` rebuilds it, trusting nothing: every meta value goes through the index's
own constructor checks (whose limits bound what it can make tqvec allocate), the arrays must be
exactly those the meta implies, each with one row per stored vector, and the codecs' rotations
are drawn (to check their fingerprints) only once the arrays agree. Errors are ValueError or
TypeError, or ``FormatError`` for a fingerprint that does not match.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import _validate as V
from ..codecs.base import Codec, Codes
from ..codecs.storage import codec_from_header, codes_from_arrays, verify_fingerprints
from ..errors import FormatError
from ..ops import pages
from .flat import FlatIndex
from .graph import Graph, GraphIndex
from .ivf import IVFIndex
from .metrics import METRIC_INNER_PRODUCT, metric_name
from .pca import PCAIndex
from .rows import Rows
from .rowterms import sqnorms_of

__all__ = ["index_state", "index_from_state"]

_FLAT_META = {"type", "params", "fingerprint", "metric", "ntotal", "next_id", "refine",
              "k_factor"}
# absent in files written before them
_OPTIONAL_META = {"prefilter", "centered", "center_term", "pca"}
_IVF_META = {"nlist", "nprobe", "seed", "niter", "trained"}
_GRAPH_META = {"M", "efSearch", "ef_construction", "entry"}
_NOT_PER_ROW = {"center", "ivf.centroids", "pca.basis", "pca.variances", "graph.upper"}


# -- writing -----------------------------------------------------------------------------------

def _codes_arrays(prefix: str, codes: Codes | None, out: dict) -> None:
    if codes is None:
        return
    out[f"{prefix}.payload"] = codes.payload.cpu().numpy()
    for k, v in codes.scalars.items():
        out[f"{prefix}.scalar.{k}"] = v.cpu().numpy()


def _rows_state(index: FlatIndex | IVFIndex, rows: Rows, kind: str
                ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    arrays: dict[str, np.ndarray] = {"ids": rows.ids.numpy()}
    _codes_arrays("codes", rows.codes, arrays)
    refine: Any = None
    if isinstance(index.refine, Codec):
        refine = {"params": index.refine.params, "fingerprint": index.refine.fingerprint()}
        _codes_arrays("refine", rows.ref, arrays)
    elif index.refine == "flat":
        refine = "flat"
        if rows.ref is not None:
            arrays["refine.vectors"] = rows.ref.numpy()
    meta = {"type": kind, "params": index.codec.params,
            "fingerprint": index.codec.fingerprint(), "metric": metric_name(index.metric_type),
            "ntotal": rows.n, "next_id": rows.next_id, "refine": refine,
            "k_factor": index.k_factor, "prefilter": index.prefilter,
            "centered": bool(index.centered)}
    if index.centered and not index.center_term:
        meta["center_term"] = False
    return meta, arrays


def flat_state(index: FlatIndex, rows: Rows, center: torch.Tensor | None
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta, arrays = _rows_state(index, rows, "flat")
    if index.centered:
        if center is None:
            raise ValueError("index must be trained before it is written (center='fit' has no "
                             "center yet)")
        arrays["center"] = center.cpu().numpy()
        corr = rows.term("ipcorr")
        if corr.numel():
            arrays["ipcorr"] = corr.cpu().numpy()
    return meta, arrays


def ivf_state(index: IVFIndex, rows: Rows) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta, arrays = _rows_state(index, rows, "ivf")
    meta.update(nlist=index.nlist, nprobe=index.nprobe, seed=index.seed, niter=index.niter,
                trained=index.is_trained)
    if index.is_trained:
        arrays["ivf.centroids"] = index.centroids.numpy()
        arrays["ivf.lists"] = rows.term("lists").numpy().astype(np.int64)
        if index.metric_type == METRIC_INNER_PRODUCT:  # a <c, r> - est<c, r>: from x, not codes
            arrays["ivf.rowterm"] = rows.term("rowterm").numpy()
    return meta, arrays


def graph_state(index: GraphIndex, rows: Rows, graph: Graph | None
                ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta, arrays = _rows_state(index, rows, "graph")
    meta.update(M=index.M, efSearch=index.efSearch, ef_construction=index.ef_construction,
                entry=-1 if graph is None else graph.entry)
    if graph is not None:
        arrays["graph.levels"] = graph.levels
        arrays["graph.base"] = graph.base
        # the upper layers' rows one after another (layer 1's, then 2's ...): their sizes
        # follow from the levels
        arrays["graph.upper"] = (np.concatenate(graph.upper) if graph.upper
                                 else np.zeros((0, index.M), np.int32))
    return meta, arrays


def index_state(index: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) of a ``FlatIndex``, ``GraphIndex``, ``IVFIndex`` or ``PCAIndex``."""
    if isinstance(index, (FlatIndex, IVFIndex, PCAIndex)):
        return index.state()
    raise TypeError(f"index must be a tqvec FlatIndex, GraphIndex, IVFIndex or PCAIndex, got "
                    f"{type(index).__name__}")


# -- reading -----------------------------------------------------------------------------------

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
    """(required, optional) array names of a meta: a state holds the required ones, any of
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
        if meta.get("center_term", True):
            optional.add("ipcorr")
    if meta["type"] == "ivf" and meta["trained"]:
        required.add("ivf.centroids")
        (required if ntotal else optional).add("ivf.lists")
        optional.add("ivf.rowterm")
    if "pca" in meta:
        required.update({"pca.basis", "pca.variances"})
    if meta["type"] == "graph" and ntotal:
        required.update({"graph.levels", "graph.base", "graph.upper"})
    return required, optional


def _empty_index(meta: dict, codec: Codec, ref_codec: Any, arrays: dict
                 ) -> FlatIndex | IVFIndex:
    """The empty index a meta describes, its values checked by the constructors."""
    centered = meta.get("centered", False)
    if not isinstance(centered, bool):
        raise TypeError(f"centered must be a bool, got {centered!r:.40}")
    if meta["type"] == "graph":
        if centered or "prefilter" in meta and meta["prefilter"] != 0 or "pca" in meta:
            raise ValueError("a graph index has no center, prefilter or PCA basis")
        return GraphIndex(codec, meta["M"], meta["metric"], refine=ref_codec,
                          k_factor=meta["k_factor"], efSearch=meta["efSearch"],
                          ef_construction=meta["ef_construction"])
    if meta["type"] == "ivf":
        if centered or "prefilter" in meta and meta["prefilter"] != 0 or "pca" in meta:
            raise ValueError("an IVF index has no center, prefilter or PCA basis")
        if not isinstance(meta["trained"], bool):
            raise TypeError(f"trained must be a bool, got {meta['trained']!r:.40}")
        index: FlatIndex | IVFIndex = IVFIndex(
            codec, meta["nlist"], meta["metric"], refine=ref_codec, k_factor=meta["k_factor"],
            nprobe=meta["nprobe"], seed=meta["seed"], niter=meta["niter"])
        if meta["trained"]:
            index.centroids = _float_rows(arrays, "ivf.centroids",
                                          (index.nlist, codec.dim)).clone()
            index.is_trained = True
        return index
    center = None
    center_term = meta.get("center_term", True)
    if not isinstance(center_term, bool) or not (center_term or centered):
        raise ValueError(f"center_term must be a bool, False only for a centred index, got "
                         f"{center_term!r:.40}")
    if centered:
        if "center" not in arrays:
            raise ValueError("arrays must hold 'center' for a centred index")
        center = _float_rows(arrays, "center", (codec.dim,)).numpy().copy()
    return FlatIndex(codec, meta["metric"], refine=ref_codec, k_factor=meta["k_factor"],
                     prefilter=meta.get("prefilter", 0), center=center,
                     center_term=center_term)


def _row_correction(arrays: dict, ntotal: int, name: str) -> torch.Tensor:
    """An inner-product index's per-row correction (a centred flat index's ``ipcorr``, an IVF
    index's ``ivf.rowterm``); zeros (the estimator without it) for files written before it
    existed."""
    if name not in arrays:
        return torch.zeros(ntotal, dtype=torch.float32)
    return _float_rows(arrays, name, (ntotal,)).clone()


def _rows(index: FlatIndex | IVFIndex, meta: dict, arrays: dict, ref_codec: Any, ntotal: int,
          where: str, mapped: Any, source: Any) -> Rows:
    """The stored rows, every array checked against the index; derived terms recomputed.
    ``mapped``: the file the arrays are mapped from (None: read into memory); ``source``: what
    the codes check at each use (``verify_fingerprints``)."""
    rows = Rows()
    ids = arrays["ids"]
    if ids.dtype != np.int64 or ids.shape != (ntotal,):
        raise ValueError(f"ids must be int64 of shape ({ntotal},), got {ids.dtype} {ids.shape}")
    next_id = V.positive_int(meta["next_id"], "next_id", 0, V.INT64_MAX + 1)
    if ntotal and next_id <= int(ids.max()):
        raise ValueError(f"next_id must exceed every stored id, got {next_id} <= {int(ids.max())}")
    if ntotal:
        ivf = isinstance(index, IVFIndex)
        if ivf and not index.is_trained:
            raise ValueError(f"an untrained IVF index must be empty, got ntotal={ntotal}")
        codes = codes_from_arrays(where, index.codec, arrays, "codes.", ntotal, source)
        ref = None
        if isinstance(ref_codec, Codec):
            ref = codes_from_arrays(where, ref_codec, arrays, "refine.", ntotal, source)
        elif ref_codec == "flat":
            ref = _float_rows(arrays, "refine.vectors", (ntotal, index.d))
            if mapped is None:  # read into memory: onto huge pages, as added rows are
                ref = pages.host_cat([ref])
        if ivf:
            lists = arrays["ivf.lists"]
            if lists.dtype != np.int64 or lists.shape != (ntotal,) or (
                    int(lists.min()) < 0 or int(lists.max()) >= index.nlist):
                raise ValueError(f"ivf.lists must be {ntotal} int64 list numbers < "
                                 f"{index.nlist}")
            lists = torch.from_numpy(lists)
            rowterm = (_row_correction(arrays, ntotal, "ivf.rowterm")
                       if index.metric_type == METRIC_INNER_PRODUCT
                       else index.row_terms(lists, codes))
            per_row = {"lists": lists, "rowterm": rowterm}
        else:
            per_row = {"sqnorms": sqnorms_of(index.codec, codes, index.scoring, index.device)}
            if (index.centered and index.scoring == METRIC_INNER_PRODUCT
                    and index.center_term):
                per_row["ipcorr"] = _row_correction(arrays, ntotal, "ipcorr")
        rows.append(codes, torch.from_numpy(ids), ref, per_row)
    rows.next_id = next_id
    return rows


def _graph(meta: dict, arrays: dict, index: GraphIndex, ntotal: int) -> Graph | None:
    """The stored graph (checked by ``GraphIndex.install_graph``), or None for no rows."""
    if not ntotal:
        return None
    levels, base, upper = arrays["graph.levels"], arrays["graph.base"], arrays["graph.upper"]
    if levels.dtype != np.int32 or levels.shape != (ntotal,) or int(levels.min()) < 1 or \
            int(levels.max()) > 64:
        raise ValueError(f"graph.levels must be ({ntotal},) int32 in 1..64")
    sizes = [int((levels > lv).sum()) for lv in range(1, int(levels.max()))]
    if upper.ndim != 2 or upper.shape[0] != sum(sizes):
        raise ValueError(f"graph.upper must have {sum(sizes)} rows, got shape {upper.shape}")
    parts = np.split(np.asarray(upper), np.cumsum(sizes)[:-1]) if sizes else []
    entry = V.positive_int(meta["entry"], "entry", 0, ntotal - 1)
    return Graph(np.asarray(levels), np.asarray(base), list(parts), entry)


def _pca(meta: dict, arrays: dict, index: FlatIndex | IVFIndex) -> PCAIndex:
    """Wrap the inner index of a ``PCAIndex`` state again, checking its fit."""
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
    pca.install(basis, var, index)
    return pca


def index_from_state(meta: dict[str, Any], arrays: dict[str, np.ndarray], mapped: Any = None,
                     where: str = "state") -> FlatIndex | IVFIndex | PCAIndex:
    """The index a state describes (``where`` names it in errors: a file's path). Every
    malformed value or array raises ``FormatError``."""
    keys = set(meta)
    kind = meta.get("type")
    extra = {"ivf": _IVF_META, "graph": _GRAPH_META}
    want = _FLAT_META | (extra.get(kind, set()) if isinstance(kind, str) else set())
    if kind not in ("flat", "ivf", "graph") or not want <= keys <= want | _OPTIONAL_META:
        raise FormatError(f"{where!r} has a malformed index header: type {kind!r:.40}, keys "
                          f"{sorted(keys)}")
    codec = codec_from_header(where, meta["params"])
    refine = meta["refine"]
    if isinstance(refine, dict):
        if set(refine) != {"params", "fingerprint"}:
            raise FormatError(f"{where!r} has a malformed refinement: keys {sorted(refine)}")
        ref_codec: Any = codec_from_header(where, refine["params"], "refinement codec")
    elif refine is None or refine == "flat":
        ref_codec = refine
    else:
        raise FormatError(f"{where!r} has a malformed refinement {refine!r:.80}")
    errors = (KeyError, TypeError, ValueError, IndexError, OverflowError, RecursionError)
    try:
        ntotal = V.positive_int(meta["ntotal"], "ntotal", 0, V.INT64_MAX)
        index = _empty_index(meta, codec, ref_codec, arrays)
    except errors as e:
        raise FormatError(f"{where!r} has an invalid index header: {e}") from e
    required, optional = _expected_arrays(meta, codec, ref_codec, ntotal)
    if not required <= set(arrays) <= required | optional:
        raise FormatError(f"{where!r} must hold the arrays {sorted(required)} (and optionally "
                          f"{sorted(optional)}), got {sorted(arrays)}")
    for name, a in arrays.items():  # one row per vector, however many the header says
        if name not in _NOT_PER_ROW and (a.ndim == 0 or a.shape[0] != ntotal):
            raise FormatError(f"{where!r} says it holds {ntotal} vectors, array {name!r} has "
                              f"shape {a.shape}")
    source = mapped
    if ntotal:  # the arrays agree with the header: now the rotations may be drawn
        checks = [(codec, meta["fingerprint"], "codec")]
        if isinstance(ref_codec, Codec):
            checks.append((ref_codec, refine["fingerprint"], "refinement codec"))
        source = verify_fingerprints(where, checks, sum(a.nbytes for a in arrays.values()),
                                     mapped)
    try:
        index.install_rows(_rows(index, meta, arrays, ref_codec, ntotal, where, mapped, source),
                           source)
    except errors as e:
        raise FormatError(f"{where!r} does not match its header: {e}") from e
    if kind == "graph":
        try:
            index.install_graph(_graph(meta, arrays, index, ntotal))
        except errors as e:
            raise FormatError(f"{where!r} has an invalid graph: {e}") from e
    if "pca" in meta:
        try:
            return _pca(meta, arrays, index)
        except errors as e:
            raise FormatError(f"{where!r} has an invalid PCA basis: {e}") from e
    return index
