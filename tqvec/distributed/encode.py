"""Encoding a collection on Ray: ``Dataset.map_batches`` with a callable class that builds the
codec once per worker from its params (the same params and seed give the same codes on every
worker, bit for bit), emitting the Arrow form of the codes (``tqvec.codecs.arrow``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import ray
import torch

from .. import _validate as V
from ..codecs.arrow import codes_to_arrow
from ..codecs.base import Codec, codec_from_params

__all__ = ["encode_dataset", "as_dataset", "batch_vectors", "DEFAULT_BLOCK_ROWS"]

#: Rows per block of a dataset made from an array (one encode task each).
DEFAULT_BLOCK_ROWS = 65536


def as_dataset(data: Any, column: str = "emb", *, id_column: str = "id",
               block_rows: int = DEFAULT_BLOCK_ROWS) -> ray.data.Dataset:
    """A Ray Dataset of ``data``: a Dataset as it is, Parquet paths (``read_parquet``), or an
    (n, d) numpy array / torch tensor cut into blocks of ``block_rows`` rows with the vectors
    in ``column`` and ids 0..n-1 in ``id_column``."""
    if isinstance(data, ray.data.Dataset):
        return data
    if isinstance(data, str) or (isinstance(data, Sequence) and data
                                 and all(isinstance(p, str) for p in data)):
        return ray.data.read_parquet(data)
    if isinstance(data, (np.ndarray, torch.Tensor)):
        t, _ = V.float_matrix(data, "data")
        x = t.to(torch.float32).numpy()
        block_rows = V.positive_int(block_rows, "block_rows", 1)
        tables = []
        for a in range(0, max(len(x), 1), block_rows):
            b = min(len(x), a + block_rows)
            vec = pa.FixedSizeListArray.from_arrays(pa.array(x[a:b].reshape(-1)), x.shape[1])
            tables.append(pa.table({id_column: np.arange(a, b, dtype=np.int64), column: vec}))
        return ray.data.from_arrow(tables)
    raise TypeError(f"data must be a ray.data.Dataset, Parquet path(s), or a numpy array or "
                    f"torch tensor, got {type(data).__name__}")


def batch_vectors(batch: dict[str, np.ndarray], column: str, d: int | None = None
                  ) -> np.ndarray:
    """The (n, d) float32 vectors of a numpy-format batch's ``column`` (a tensor column, or
    a list column that Ray hands over as an array of arrays), checked as every input is."""
    if column not in batch:
        raise ValueError(f"column must name the vectors' column, got {column!r}; the data has "
                         f"{sorted(batch)}")
    x = batch[column]
    if x.dtype == object:
        x = np.stack(list(x)) if len(x) else np.zeros((0, d or 0), np.float32)
    t, _ = V.float_matrix(x, column, d)
    return t.to(torch.float32).numpy()


class _Encoder:
    """The map_batches UDF: one codec per worker, built from params."""

    def __init__(self, params: dict[str, Any], column: str, keep: bool, device: str):
        self.codec = codec_from_params(params)
        self.column, self.keep, self.device = column, keep, device

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        x = batch_vectors(batch, self.column, self.codec.dim)
        codes = self.codec.encode(torch.from_numpy(x).to(self.device)).to("cpu")
        others = {k: v for k, v in batch.items() if k != self.column} if self.keep else {}
        return codes_to_arrow(codes, {k: _arrow_column(v) for k, v in others.items()})


def _arrow_column(v: np.ndarray) -> pa.Array:
    if v.ndim > 1:  # a tensor column passed through: one fixed-size list per row
        return pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(len(v), -1).reshape(-1)),
                                                 int(np.prod(v.shape[1:])))
    return pa.array(v)


def encode_dataset(data: Any, codec: Codec, *, column: str = "emb", batch_size: int = 8192,
                   concurrency: int | None = None, num_gpus: float = 0,
                   keep_columns: bool = True) -> ray.data.Dataset:
    """Encode the vectors in ``column`` of ``data`` (anything ``as_dataset`` takes) with
    ``codec`` through ``map_batches``: a lazy Dataset of the codes' Arrow form (the payload as
    fixed-size binary, the scalars as float columns, the codec's params and fingerprint in the
    schema metadata; ``tqvec.codes_from_arrow`` reads it back), the other columns kept beside
    them unless ``keep_columns=False``. ``concurrency`` workers (default: the cluster's CPUs,
    or GPUs with ``num_gpus``), each building the codec once from its params; with
    ``num_gpus`` > 0 each worker encodes on its GPU."""
    if not isinstance(codec, Codec):
        raise TypeError(f"codec must be a tqvec codec, got {type(codec).__name__}")
    ds = as_dataset(data, column)
    batch_size = V.positive_int(batch_size, "batch_size", 1)
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    if concurrency is None:
        res = ray.cluster_resources()
        concurrency = max(1, int(res.get("GPU", 0) // num_gpus if num_gpus
                                 else res.get("CPU", 1)))
    concurrency = V.positive_int(concurrency, "concurrency", 1)
    return ds.map_batches(
        _Encoder, fn_constructor_kwargs={"params": codec.params, "column": column,
                                         "keep": keep_columns,
                                         "device": "cuda" if num_gpus else "cpu"},
        batch_format="numpy", batch_size=batch_size, concurrency=concurrency,
        num_cpus=0 if num_gpus else 1, num_gpus=num_gpus)
