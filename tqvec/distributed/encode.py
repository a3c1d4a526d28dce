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
               block_rows: int | None = None, consumers: int = 1) -> ray.data.Dataset:
    """A Ray Dataset of ``data``: a Dataset as it is, Parquet paths (``read_parquet``), or an
    (n, d) numpy array / torch tensor cut into blocks of ``block_rows`` rows with the vectors
    in ``column`` and ids 0..n-1 in ``id_column``. By default an array gets a few blocks per
    consumer (workers, shards: a block is the unit Ray Data hands out), at most
    ``DEFAULT_BLOCK_ROWS`` rows each."""
    if isinstance(data, ray.data.Dataset):
        return data
    if isinstance(data, str) or (isinstance(data, Sequence) and data
                                 and all(isinstance(p, str) for p in data)):
        return ray.data.read_parquet(data)
    if isinstance(data, (np.ndarray, torch.Tensor)):
        t, _ = V.float_matrix(data, "data")
        x = t.to(torch.float32).numpy()
        if block_rows is None:
            consumers = V.positive_int(consumers, "consumers", 1)
            block_rows = max(1, min(DEFAULT_BLOCK_ROWS, -(-len(x) // (4 * consumers))))
        block_rows = V.positive_int(block_rows, "block_rows", 1)
        tables = []
        for a in range(0, max(len(x), 1), block_rows):
            b = min(len(x), a + block_rows)
            vec = pa.FixedSizeListArray.from_arrays(pa.array(x[a:b].reshape(-1)), x.shape[1])
            tables.append(pa.table({id_column: np.arange(a, b, dtype=np.int64), column: vec}))
        return ray.data.from_arrow(tables)
    raise TypeError(f"data must be a ray.data.Dataset, Parquet path(s), or a numpy array or "
                    f"torch tensor, got {type(data).__name__}")


def batch_vectors(batch: Any, column: str, d: int | None = None) -> np.ndarray:
    """The (n, d) float32 vectors of a batch's ``column``: a ``pyarrow.Table`` whose column is
    a fixed-size list, a list of equal lengths or Ray's tensor type (read without a copy per
    row), or a dict of numpy arrays; checked as every input is (finite, d columns)."""
    names = batch.column_names if isinstance(batch, pa.Table) else list(batch)
    if column not in names:
        raise ValueError(f"column must name the vectors' column, got {column!r}; the data has "
                         f"{sorted(names)}")
    x = batch[column]
    if isinstance(x, pa.ChunkedArray):
        x = _arrow_matrix(x.combine_chunks() if x.num_chunks != 1 else x.chunk(0), column)
    elif x.dtype == object:
        x = np.stack(list(x)) if len(x) else np.zeros((0, d or 0), np.float32)
    t, _ = V.float_matrix(x, column, d)
    return t.to(torch.float32).numpy()


def _arrow_matrix(a: pa.Array, column: str) -> np.ndarray:
    if a.null_count:
        raise ValueError(f"{column} must not hold nulls, got {a.null_count}")
    n = len(a)
    if pa.types.is_fixed_size_list(a.type):
        return a.flatten().to_numpy(zero_copy_only=False).reshape(n, a.type.list_size)
    if pa.types.is_list(a.type) or pa.types.is_large_list(a.type):
        lengths = np.unique(a.value_lengths().to_numpy(zero_copy_only=False))
        if len(lengths) > 1:
            raise ValueError(f"{column} must hold vectors of one length, got lengths "
                             f"{lengths[:5].tolist()}")
        return a.flatten().to_numpy(zero_copy_only=False).reshape(n, -1)
    if isinstance(a.type, pa.ExtensionType) and hasattr(a, "to_numpy"):  # Ray's tensors
        return np.asarray(a.to_numpy())
    raise TypeError(f"{column} must be a column of float vectors (fixed-size list, list or "
                    f"tensor), got {a.type}")


class _Encoder:
    """The map_batches UDF: one codec per worker, built from params."""

    def __init__(self, params: dict[str, Any], column: str, keep: bool, device: str,
                 threads: int):
        torch.set_num_threads(threads)
        self.codec = codec_from_params(params)
        self.column, self.keep, self.device = column, keep, device

    def __call__(self, batch: pa.Table) -> pa.Table:
        x = batch_vectors(batch, self.column, self.codec.dim)
        codes = self.codec.encode(torch.from_numpy(x).to(self.device)).to("cpu")
        keep = [k for k in batch.column_names if k != self.column] if self.keep else []
        return codes_to_arrow(codes, {k: batch.column(k) for k in keep})


def encode_dataset(data: Any, codec: Codec, *, column: str = "emb", batch_size: int = 32768,
                   concurrency: int | None = None, num_gpus: float = 0,
                   keep_columns: bool = True) -> ray.data.Dataset:
    """Encode the vectors in ``column`` of ``data`` (anything ``as_dataset`` takes) with
    ``codec`` through ``map_batches``: a lazy Dataset of the codes' Arrow form (the payload as
    fixed-size binary, the scalars as float columns, the codec's params and fingerprint in the
    schema metadata; ``tqvec.codes_from_arrow`` reads it back), the other columns kept beside
    them unless ``keep_columns=False``. ``batch_size``: rows per call of a worker (32,768 x
    768 float32 is 100 MB; fewer, larger tasks amortize Ray Data's cost per task).
    ``concurrency`` workers (default: the cluster's CPUs, or GPUs with ``num_gpus``), each
    building the codec once from its params; with ``num_gpus`` > 0 each worker encodes on
    its GPU."""
    if not isinstance(codec, Codec):
        raise TypeError(f"codec must be a tqvec codec, got {type(codec).__name__}")
    batch_size = V.positive_int(batch_size, "batch_size", 1)
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    if concurrency is None:
        res = ray.cluster_resources()
        concurrency = max(1, int(res.get("GPU", 0) // num_gpus if num_gpus
                                 else res.get("CPU", 1)))
    concurrency = V.positive_int(concurrency, "concurrency", 1)
    ds = as_dataset(data, column, consumers=concurrency)
    return ds.map_batches(
        _Encoder, fn_constructor_kwargs={"params": codec.params, "column": column,
                                         "keep": keep_columns,
                                         "device": "cuda" if num_gpus else "cpu",
                                         "threads": 1},
        batch_format="pyarrow", batch_size=batch_size, concurrency=concurrency,
        num_cpus=0 if num_gpus else 1, num_gpus=num_gpus)
