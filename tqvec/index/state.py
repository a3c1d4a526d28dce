"""An index as (meta, arrays) - what ``tqvec.index.io`` writes - and back.

``index_state`` turns any index into a JSON-able meta dict and named numpy arrays;
``index_from_state`` rebuilds it, trusting nothing: every meta value goes through the index's
own constructor checks (whose limits bound what it can make tqvec allocate), the arrays must be
exactly those the meta implies, each with one row per stored vector, and the codecs' rotations
are drawn (to check their fingerprints) only once the arrays agree. Errors are ValueError or
TypeError, or ``FormatError`` for a fingerprint that does not match.

This module owns what every index file shares (the rows: ids, codes, a refinement) and the
order of the checks; each index type says what is its own in a ``StoredKind`` it registers
(``register_kind``) from its own module, and an index that wraps another (``PCAIndex``) in a
``StoredWrapper``. Nothing here imports an index class, so a new index type edits no line of
this file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import _validate as V
from ..codecs.base import Codec, Codes
from ..codecs.storage import codec_from_header, codes_from_arrays, verify_fingerprints
from ..errors import FormatError
from ..ops import pages
from .metrics import metric_name
from .rows import Rows

__all__ = ["index_state", "index_from_state", "StoredKind", "StoredWrapper", "register_kind",
           "register_wrapper", "rows_state", "float_rows", "row_correction",
           "no_center_or_prefilter"]

_ROWS_META = {"type", "params", "fingerprint", "metric", "ntotal", "next_id", "refine",
              "k_factor"}
# absent in files written before them
_OPTIONAL_META = {"prefilter", "prefilter_sigmas", "centered", "center_term"}
# the errors a malformed value raises in the constructors and checks
_ERRORS = (KeyError, TypeError, ValueError, IndexError, OverflowError, RecursionError)


@dataclass(frozen=True)
class StoredKind:
    """What one index type's files hold beyond the rows, and how it is made from them.

    ``empty(meta, codec, refine, arrays)``: the empty index a header describes (its values
    checked by the constructor; ``refine`` a codec, ``"flat"`` or None). ``arrays(meta,
    ntotal)``: the (required, optional) array names of its own. ``per_row(index, arrays,
    codes, ntotal)``: the rows' derived terms (read and checked, or recomputed from the codes).
    ``finish(index, meta, arrays, ntotal)``: the rest, once the rows are in (a graph).
    """

    cls: type
    empty: Callable[..., Any]
    per_row: Callable[..., dict[str, torch.Tensor]]
    meta: frozenset[str] = frozenset()  # header keys of its own (all required)
    not_per_row: frozenset[str] = frozenset()
    arrays: Callable[[dict, int], tuple[set[str], set[str]]] = lambda meta, n: (set(), set())
    finish: Callable[..., None] | None = None
    what: str = "index"  # how errors name the finishing step's data


@dataclass(frozen=True)
class StoredWrapper:
    """An index that holds another of type ``inner`` (its ``meta_key`` in the inner index's
    header): ``wrap(meta, arrays, inner)`` checks its arrays (``arrays``; none per row) and
    returns it."""

    cls: type
    inner: type
    meta_key: str
    arrays: frozenset[str]
    wrap: Callable[..., Any]
    what: str


KINDS: dict[str, StoredKind] = {}
WRAPPERS: dict[str, StoredWrapper] = {}


def register_kind(name: str, kind: StoredKind) -> None:
    """Make files of ``meta["type"] == name`` readable (called by the index's module)."""
    KINDS[name] = kind


def register_wrapper(wrapper: StoredWrapper) -> None:
    WRAPPERS[wrapper.meta_key] = wrapper


# -- writing -----------------------------------------------------------------------------------

def _codes_arrays(prefix: str, codes: Codes | None, out: dict) -> None:
    if codes is None:
        return
    out[f"{prefix}.payload"] = codes.payload.cpu().numpy()
    for k, v in codes.scalars.items():
        out[f"{prefix}.scalar.{k}"] = v.cpu().numpy()


def rows_state(index: Any, rows: Rows, kind: str, **meta: Any
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The (meta, arrays) every index file shares - the codec, the metric, the ids, the codes
    and the refinement - with the kind's own ``meta`` after them (the order files hold)."""
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
    out = {"type": kind, "params": index.codec.params,
           "fingerprint": index.codec.fingerprint(), "metric": metric_name(index.metric_type),
           "ntotal": rows.n, "next_id": rows.next_id, "refine": refine,
           "k_factor": index.k_factor, **meta}
    return out, arrays


def index_state(index: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) of any index type a module registered (``FlatIndex``, ``GraphIndex``,
    ``IVFIndex``, ``PCAIndex``)."""
    known = [k.cls for k in KINDS.values()] + [w.cls for w in WRAPPERS.values()]
    if isinstance(index, tuple(known)):
        return index.state()
    names = " or ".join(", ".join(sorted(c.__name__ for c in known)).rsplit(", ", 1))
    raise TypeError(f"index must be a tqvec {names}, got {type(index).__name__}")


# -- reading -----------------------------------------------------------------------------------

def float_rows(arrays: dict, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A stored float32 array of ``shape`` with finite values (ValueError otherwise)."""
    a = arrays[name]
    if a.dtype != np.float32 or a.shape != shape:
        raise ValueError(f"{name} must be float32 of shape {shape}, got {a.dtype} {a.shape}")
    t = torch.from_numpy(a)
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite")
    return t


def row_correction(arrays: dict, ntotal: int, name: str) -> torch.Tensor:
    """An inner-product index's per-row correction (a centred flat index's ``ipcorr``, an IVF
    index's ``ivf.rowterm``); zeros (the estimator without it) for files written before it
    existed."""
    if name not in arrays:
        return torch.zeros(ntotal, dtype=torch.float32)
    return float_rows(arrays, name, (ntotal,)).clone()


def no_center_or_prefilter(meta: dict, what: str) -> None:
    """Refuse a centre or a prefilter in the header of an index type that has neither."""
    centered = meta.get("centered", False)
    if not isinstance(centered, bool):
        raise TypeError(f"centered must be a bool, got {centered!r:.40}")
    if centered or meta.get("prefilter", 0) != 0 or meta.get("prefilter_sigmas", 0) != 0:
        raise ValueError(f"{what} has no center or prefilter")


def _expected_arrays(meta: dict, kind: StoredKind, wrapper: StoredWrapper | None, codec: Codec,
                     ref_codec: Any, ntotal: int) -> tuple[set[str], set[str]]:
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
    own, own_optional = kind.arrays(meta, ntotal)
    required |= own
    optional |= own_optional
    if wrapper is not None:
        required |= wrapper.arrays
    return required, optional


def _rows(index: Any, kind: StoredKind, meta: dict, arrays: dict, ref_codec: Any, ntotal: int,
          where: str, mapped: Any, source: Any) -> Rows:
    """The stored rows, every array checked against the index; derived terms from the kind.
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
        codes = codes_from_arrays(where, index.codec, arrays, "codes.", ntotal, source)
        ref = None
        if isinstance(ref_codec, Codec):
            ref = codes_from_arrays(where, ref_codec, arrays, "refine.", ntotal, source)
        elif ref_codec == "flat":
            ref = float_rows(arrays, "refine.vectors", (ntotal, index.d))
            if mapped is None:  # read into memory: onto huge pages, as added rows are
                ref = pages.host_cat([ref])
        rows.append(codes, torch.from_numpy(ids), ref, kind.per_row(index, arrays, codes, ntotal))
    rows.next_id = next_id
    return rows


def _kind_of(meta: dict, where: str) -> tuple[StoredKind, StoredWrapper | None]:
    """The registered kind (and wrapper) of a header whose keys are exactly theirs."""
    keys = set(meta)
    name = meta.get("type")
    kind = KINDS.get(name) if isinstance(name, str) else None
    wrappers = [w for key, w in WRAPPERS.items() if key in keys]
    want = _ROWS_META | (kind.meta if kind else set())
    allowed = want | _OPTIONAL_META | {w.meta_key for w in wrappers}
    if kind is None or len(wrappers) > 1 or not want <= keys <= allowed:
        raise FormatError(f"{where!r} has a malformed index header: type {name!r:.40}, keys "
                          f"{sorted(keys)}")
    return kind, wrappers[0] if wrappers else None


def index_from_state(meta: dict[str, Any], arrays: dict[str, np.ndarray], mapped: Any = None,
                     where: str = "state") -> Any:
    """The index a state describes (``where`` names it in errors: a file's path). Every
    malformed value or array raises ``FormatError``."""
    kind, wrapper = _kind_of(meta, where)
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
    try:
        ntotal = V.positive_int(meta["ntotal"], "ntotal", 0, V.INT64_MAX)
        index = kind.empty(meta, codec, ref_codec, arrays)
        if wrapper is not None and type(index) is not wrapper.inner:
            raise ValueError(f"an index of type {type(index).__name__} has no {wrapper.what}")
    except _ERRORS as e:
        raise FormatError(f"{where!r} has an invalid index header: {e}") from e
    required, optional = _expected_arrays(meta, kind, wrapper, codec, ref_codec, ntotal)
    if not required <= set(arrays) <= required | optional:
        raise FormatError(f"{where!r} must hold the arrays {sorted(required)} (and optionally "
                          f"{sorted(optional)}), got {sorted(arrays)}")
    not_per_row = kind.not_per_row | (wrapper.arrays if wrapper else set())
    for name, a in arrays.items():  # one row per vector, however many the header says
        if name not in not_per_row and (a.ndim == 0 or a.shape[0] != ntotal):
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
        index.install_rows(_rows(index, kind, meta, arrays, ref_codec, ntotal, where, mapped,
                                 source), source)
    except _ERRORS as e:
        raise FormatError(f"{where!r} does not match its header: {e}") from e
    if kind.finish is not None:
        try:
            kind.finish(index, meta, arrays, ntotal)
        except _ERRORS as e:
            raise FormatError(f"{where!r} has an invalid {kind.what}: {e}") from e
    if wrapper is not None:
        try:
            return wrapper.wrap(meta, arrays, index)
        except _ERRORS as e:
            raise FormatError(f"{where!r} has an invalid {wrapper.what}: {e}") from e
    return index
