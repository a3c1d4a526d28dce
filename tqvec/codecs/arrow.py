"""Codes as an Arrow table, for the stores that hold columns (Parquet, Lance, DuckDB, Spark, a
vector database): the packed payload as one ``fixed_size_binary(payload_bytes)`` column, each
per-vector scalar as a float column (a ``fixed_size_list`` for several per vector), and the
codec's params and fingerprint in the schema metadata. Extra columns (ids, text) may sit beside
them; ``codes_from_arrow`` reads only its own. pyarrow is imported here, on first use.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from ..errors import FormatError
from .base import Codes, codec_from_params
from .storage import HEADER_ERRORS

__all__ = ["codes_to_arrow", "codes_from_arrow", "ARROW_FORMAT", "PAYLOAD_COLUMN"]

#: Schema metadata key -> value naming this layout; a table without it is not tqvec codes.
ARROW_FORMAT = "tqvec.codes/1"
PAYLOAD_COLUMN = "tqvec_payload"
_SCALAR_PREFIX = "tqvec_"
_KEYS = (b"tqvec.format", b"tqvec.params", b"tqvec.fingerprint")


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError as e:
        raise ImportError("the Arrow form of codes needs pyarrow: pip install pyarrow (or "
                          "pip install 'tqvec[ray]')") from e
    return pyarrow


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return np.dtype({torch.float32: "float32", torch.float16: "float16"}[dtype])


def codes_to_arrow(codes: Codes, columns: dict[str, Any] | None = None) -> Any:
    """``codes`` as a ``pyarrow.Table`` (module docstring); ``columns`` adds name -> array
    columns of the same length (e.g. ``{"id": ids}``)."""
    pa = _pyarrow()
    if not isinstance(codes, Codes):
        raise TypeError(f"codes must be tqvec.Codes, got {type(codes).__name__}")
    codec = codec_from_params(codes.params)
    codes = codec.check_codes(codes.to("cpu"))
    n, width = codes.payload.shape
    payload = np.ascontiguousarray(codes.payload.numpy())
    arrays = {PAYLOAD_COLUMN: pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width), n, [None, pa.py_buffer(payload)])}
    for name, v in codes.scalars.items():
        a = np.ascontiguousarray(v.numpy())
        if a.ndim == 1:
            arrays[_SCALAR_PREFIX + name] = pa.array(a)
        else:
            arrays[_SCALAR_PREFIX + name] = pa.FixedSizeListArray.from_arrays(
                pa.array(a.reshape(-1)), a.shape[1])
    for name, col in (columns or {}).items():
        if name in arrays:
            raise ValueError(f"columns must not use the name {name!r} (a codes column)")
        if len(col) != n:
            raise ValueError(f"columns[{name!r}] must have {n} rows, got {len(col)}")
        arrays[name] = col if isinstance(col, (pa.Array, pa.ChunkedArray)) else pa.array(col)
    meta = {_KEYS[0]: ARROW_FORMAT.encode(),
            _KEYS[1]: json.dumps(dict(codes.params), sort_keys=True).encode(),
            _KEYS[2]: (codec.fingerprint() if n else "").encode()}
    return pa.table(arrays).replace_schema_metadata(meta)


def codes_from_arrow(table: Any) -> Codes:
    """The ``Codes`` of a table written by ``codes_to_arrow`` (a ``pyarrow.Table`` or
    ``RecordBatch``, its chunks in order). A table without tqvec's metadata, with columns of
    other types or widths, non-finite scalars, or a fingerprint that this tqvec's codec does
    not reproduce raises ``FormatError``."""
    pa = _pyarrow()
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if not isinstance(table, pa.Table):
        raise TypeError(f"table must be a pyarrow Table or RecordBatch, got "
                        f"{type(table).__name__}")
    meta = table.schema.metadata or {}
    if meta.get(_KEYS[0]) != ARROW_FORMAT.encode():
        raise FormatError(f"table is not tqvec codes: schema metadata {_KEYS[0]!r} must be "
                          f"{ARROW_FORMAT!r}, got {meta.get(_KEYS[0])!r}")
    try:
        params = json.loads(meta.get(_KEYS[1], b""))
        codec = codec_from_params(params, strict=True)
    except (json.JSONDecodeError, UnicodeDecodeError, *HEADER_ERRORS) as e:
        raise FormatError(f"table has invalid codec params in its metadata: {e}") from e
    names = set(table.column_names)
    layout = codec.scalar_layout()
    want = {PAYLOAD_COLUMN, *(_SCALAR_PREFIX + k for k in layout)}
    if not want <= names:
        raise FormatError(f"table must hold the columns {sorted(want)}, missing "
                          f"{sorted(want - names)}")
    col = table.column(PAYLOAD_COLUMN)
    if col.type != pa.binary(codec.payload_bytes):
        raise FormatError(f"table column {PAYLOAD_COLUMN!r} must be "
                          f"fixed_size_binary({codec.payload_bytes}), got {col.type}")
    n = table.num_rows
    if col.null_count:
        raise FormatError(f"table column {PAYLOAD_COLUMN!r} must not hold nulls")
    payload = np.empty((n, codec.payload_bytes), np.uint8)
    at = 0
    for chunk in col.chunks:
        m = len(chunk)
        if m == 0:
            continue
        buf = np.frombuffer(chunk.buffers()[1], np.uint8)
        start = chunk.offset * codec.payload_bytes
        payload[at:at + m] = buf[start:start + m * codec.payload_bytes].reshape(m, -1)
        at += m
    scalars = {}
    for name, (shape, dtype) in layout.items():
        c = table.column(_SCALAR_PREFIX + name)
        npd = _numpy_dtype(dtype)
        per = int(np.prod(shape, dtype=np.int64))
        expected = pa.from_numpy_dtype(npd) if not shape else pa.list_(
            pa.from_numpy_dtype(npd), per)
        if c.type != expected or c.null_count:
            raise FormatError(f"table column {_SCALAR_PREFIX + name!r} must be {expected} "
                              f"without nulls, got {c.type} ({c.null_count} nulls)")
        flat = c.combine_chunks()
        values = (flat.to_numpy(zero_copy_only=False) if not shape
                  else flat.flatten().to_numpy(zero_copy_only=False))
        a = np.array(values, npd).reshape((n, *shape))  # a writable copy
        if not np.isfinite(a).all():
            raise FormatError(f"table column {_SCALAR_PREFIX + name!r} holds NaN or Inf")
        scalars[name] = torch.from_numpy(a)
    codes = codec.check_codes(Codes(torch.from_numpy(payload), scalars, codec.params))
    if n and meta.get(_KEYS[2], b"").decode(errors="replace") != codec.fingerprint():
        raise FormatError("table was encoded with a different rotation/codebook for the same "
                          "codec params (fingerprint mismatch); decoding would be wrong")
    return codes
