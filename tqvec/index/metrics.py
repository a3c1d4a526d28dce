"""Metrics and faiss's result layout: metric codes and names, query normalization, and (D, I)
arrays assembled from best-first (similarity, position) results with faiss's padding."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import _validate as V
from .. import ops

__all__ = ["METRIC_INNER_PRODUCT", "METRIC_L2", "METRIC_COSINE", "metric_code", "metric_name",
           "FLT_MAX", "QUERY_BLOCK", "unit_rows", "normalized", "row_mean", "padded",
           "put_results", "results", "device_of", "similarities", "range_results",
           "one_call_queries"]

# faiss's integer codes for its metrics (faiss.METRIC_INNER_PRODUCT = 0, faiss.METRIC_L2 = 1);
# cosine has no faiss code: it is faiss's inner product on normalized vectors.
METRIC_INNER_PRODUCT = 0
METRIC_L2 = 1
METRIC_COSINE = 100
_METRICS = {"ip": METRIC_INNER_PRODUCT, "inner_product": METRIC_INNER_PRODUCT,
            "l2": METRIC_L2, "euclidean": METRIC_L2, "cosine": METRIC_COSINE,
            "angular": METRIC_COSINE}
FLT_MAX = float(np.finfo(np.float32).max)
#: Queries searched at once (bounds the (queries, rows) score blocks of the general paths).
QUERY_BLOCK = 1024


def metric_code(metric: Any) -> int:
    """'ip' | 'l2' | 'cosine' (or faiss's integer metric) -> the integer code."""
    if isinstance(metric, (int, np.integer)) and not isinstance(metric, bool):
        if int(metric) in (METRIC_INNER_PRODUCT, METRIC_L2, METRIC_COSINE):
            return int(metric)
    elif isinstance(metric, str) and metric.lower() in _METRICS:
        return _METRICS[metric.lower()]
    raise ValueError(f"metric must be one of ['ip', 'l2', 'cosine'] or faiss.METRIC_INNER_PRODUCT"
                     f"/METRIC_L2, got {metric!r}")


def metric_name(code: int) -> str:
    return {METRIC_INNER_PRODUCT: "ip", METRIC_L2: "l2", METRIC_COSINE: "cosine"}[code]


def unit_rows(q: np.ndarray) -> np.ndarray:
    """Rows scaled to unit norm (cosine queries on the CPU; zero rows stay zero): q / max(sqrt(
    row_sqnorms(q)), 1e-30), the float operations of the one-call search's ``normalize``."""
    nrm = np.sqrt(ops.row_sqnorms(torch.from_numpy(q)).numpy())[:, None]
    return q / np.maximum(nrm, np.float32(1e-30))


def normalized(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit norm (torch, any device; zero rows stay zero). A row whose norm
    overflows float32 is refused (ValueError) as the codecs refuse it, not scaled to zero."""
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    V.finite_rows(x, norms[:, 0], "x", 0)
    return x / norms.clamp_min(1e-30)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """(d,) float64 mean of the rows of x: numpy sums float32 CPU rows into float64 without a
    float64 copy (torch's float64 sum converts the rows first)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.numpy().sum(0, dtype=np.float64) / x.shape[0])
    return x.to(torch.float64).mean(0)


def device_of(device: Any) -> torch.device:
    """An index's ``device`` argument: None (the CPU), 'cpu', 'cuda' or 'cuda:N'."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device must be a device torch can use, got {device!r} but torch "
                         f"{torch.__version__} sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return dev


def padded(metric_type: int, nq: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """faiss's padding: D = -FLT_MAX (similarities) or +FLT_MAX (L2), I = -1."""
    fill = FLT_MAX if metric_type == METRIC_L2 else -FLT_MAX
    return np.full((nq, k), fill, dtype=np.float32), np.full((nq, k), -1, dtype=np.int64)


def put_results(D: np.ndarray, I: np.ndarray, vals: np.ndarray, pos: np.ndarray,
                ids: np.ndarray) -> None:
    """Write the first columns of D, I (row views) from best-first (vals, pos); non-finite
    values (fewer results than asked) keep the padding."""
    m = vals.shape[1]
    valid = np.isfinite(vals)
    if valid.all():  # the common case: k results per query
        D[:, :m], I[:, :m] = vals, ids[pos]
    else:
        D[:, :m] = np.where(valid, vals, D[:, :m])
        I[:, :m] = np.where(valid, ids[np.where(valid, pos, 0)], -1)


def results(metric_type: int, vals: np.ndarray, pos: np.ndarray, ids: np.ndarray, k: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """(D, I) of one block of queries from best-first (vals, pos) in the metric's units: into
    the padding, or, in the common case of k finite results per query, the arrays themselves
    (a one-query search's last steps run cache-cold after a scan: fewer is faster)."""
    if vals.shape[1] == k and np.isfinite(vals).all():
        return np.ascontiguousarray(vals, np.float32), ids[pos]
    D, I = padded(metric_type, vals.shape[0], k)
    put_results(D, I, vals, pos, ids)
    return D, I


def similarities(metric_type: int, D: np.ndarray, I: np.ndarray) -> np.ndarray:
    """faiss's D as larger-is-better float32 similarities (l2: -D), -inf where I is -1."""
    s = -D if metric_type == METRIC_L2 else D
    return np.where(I >= 0, s, np.float32(-np.inf)).astype(np.float32)


def range_results(per_query: list[list[tuple[np.ndarray, np.ndarray]]]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """faiss's (lims, D, I) from each query's list of (distances, ids) parts; lims uint64 as
    faiss returns it."""
    counts = [sum(len(dd) for dd, _ in parts) for parts in per_query]
    lims = np.zeros(len(per_query) + 1, dtype=np.uint64)
    lims[1:] = np.cumsum(counts, dtype=np.uint64)
    flat = [part for parts in per_query for part in parts]
    D = np.concatenate([dd for dd, _ in flat]).astype(np.float32) if flat else np.zeros(
        0, np.float32)
    I = np.concatenate([ii for _, ii in flat]) if flat else np.zeros(0, np.int64)
    return lims, D, I


def one_call_queries(x: Any, d: int, max_rows: int | None = QUERY_BLOCK) -> bool:
    """Whether x is what an index's one compiled call takes as it is: a float32 numpy matrix
    of ``d`` columns and 1 to ``max_rows`` rows (None: any number); anything else takes the
    composition, which checks and converts it."""
    return (type(x) is np.ndarray and x.dtype == np.float32 and x.ndim == 2
            and 0 < x.shape[0] and (max_rows is None or x.shape[0] <= max_rows)
            and x.shape[1] == d)
