"""Every check of user input, done once at the public boundary.

Messages follow ``<param> must be <expected>, got <actual>``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_FLOAT_TORCH = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# Limits on what a parameter may make tqvec allocate, checked where the parameter enters (the
# constructors, setters and file readers), so that neither a typo nor a crafted file header
# can ask for terabytes or hours.
#: Largest vector dimension (and JL sketch size) of any codec.
MAX_DIM = 1 << 20
#: Largest dense random matrix in elements: a JL matrix (m d; 2^26 float64 elements are
#: 512 MiB).
MAX_DENSE = 1 << 26
#: Most multiply-adds of the QR factorizations behind orthogonal draws (d m^2 per (d, m)
#: draw): a Haar rotation up to d = 4,096 (twice that d is eight times the work: the time a
#: crafted file header could make a reader spend).
MAX_QR_WORK = 1 << 36
#: Largest candidates-per-result factor (``prefilter``, ``k_factor``): beyond ntotal / k every
#: row is a candidate anyway.
MAX_CANDIDATE_FACTOR = 1 << 20
#: Largest k a search pads beyond ntotal (faiss pads k > ntotal with -1 results).
MAX_PADDED_K = 1 << 16
INT64_MAX = (1 << 63) - 1


def describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"torch.Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    if isinstance(x, np.ndarray):
        return f"numpy.ndarray(shape={x.shape}, dtype={x.dtype})"
    return f"{type(x).__name__}"


def as_tensor(x: Any, name: str) -> tuple[torch.Tensor, bool]:
    """Return ``(tensor, was_numpy)`` without copying where possible."""
    if isinstance(x, torch.Tensor):
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} must be on the 'cpu' or a 'cuda' device, got {describe(x)}")
        return (x.detach() if x.requires_grad else x), False  # codes are never differentiated
    if isinstance(x, np.ndarray):
        if x.dtype == np.float64:
            # float64 is coerced to float32 as faiss does; a copy is unavoidable anyway.
            x = x.astype(np.float32)
        if x.dtype.kind == "f" or x.dtype.kind in "biu":
            if not x.flags.writeable:
                x = x.copy()
            return torch.from_numpy(np.ascontiguousarray(x)), True
        raise TypeError(f"{name} must be a floating array, got {describe(x)}")
    raise TypeError(f"{name} must be a numpy array or torch tensor, got {describe(x)}")


def query_rows(x: Any, name: str, dim: int, device: torch.device) -> torch.Tensor:
    """``float_matrix`` for an index's queries, as float32 on ``device``, each row's norm
    within float32 (as ``add`` requires: a finite query of norm 1e20 would score NaN against
    every row). The common case - a C-contiguous, writable float32 numpy array for a CPU index
    - is checked by one float32 sum of squares and wrapped without a copy (a NaN or Inf
    anywhere, or a row norm past float32, makes that sum non-finite; the general checks would
    weigh on a one-query search: docs/kernel-costs.md)."""
    if (type(x) is np.ndarray and x.dtype == np.float32 and x.ndim == 2 and x.shape[1] == dim
            and device.type == "cpu" and x.flags.c_contiguous and x.flags.writeable
            and norms_fit(x)):
        return torch.from_numpy(x)
    t, _ = float_matrix(x, name, dim)
    t = t.to(dtype=torch.float32)
    if t.numel():
        finite_rows(t, torch.linalg.vector_norm(t, dim=1), name, 0)
    return t.to(device=device)


def norms_fit(x: np.ndarray) -> bool:
    """Whether a float32 numpy matrix is finite with every row's squared norm within float32,
    by one float32 sum of squares (a NaN or Inf anywhere, or one row past float32, makes it
    non-finite); rows fine on their own but past float32 together take the row-wise check."""
    flat = x.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.dot(flat, flat)):
            return True
        return bool(np.isfinite(np.einsum("ij,ij->i", x, x)).all())


def float_matrix(x: Any, name: str, dim: int | None = None, allow_empty: bool = True,
                 check_finite: bool = True) -> tuple[torch.Tensor, bool]:
    """Validate an ``(n, d)`` floating matrix of finite values.

    Returns the tensor (dtype float32/float16/bfloat16; float64 becomes float32) and whether
    the input was numpy. ``check_finite=False`` leaves the NaN/Inf check to the caller, which
    then calls ``finite_rows`` per block (no n x d temporary).
    """
    t, was_numpy = as_tensor(x, name)
    if t.dtype not in _FLOAT_TORCH:
        given = f"numpy {x.dtype}" if was_numpy else str(t.dtype)
        fix = "x.astype(np.float32)" if was_numpy else "x.float()"
        raise TypeError(
            f"{name} must have dtype float32, float16 or bfloat16, got {given} "
            f"(convert integers explicitly, e.g. {fix})")
    if t.dtype == torch.float64:
        t = t.to(torch.float32)
    if t.ndim != 2:
        hint = " (use x[None, :] for a single vector)" if t.ndim == 1 else ""
        raise ValueError(f"{name} must be 2-D (n, d), got shape {tuple(t.shape)}{hint}")
    if dim is not None and t.shape[1] != dim:
        raise ValueError(f"{name} must have {dim} columns (the codec's dim), got {t.shape[1]}")
    if t.shape[1] == 0:
        raise ValueError(f"{name} must have at least one column, got shape {tuple(t.shape)}")
    if t.shape[0] == 0 and not allow_empty:
        raise ValueError(f"{name} must have at least one row, got shape {tuple(t.shape)}")
    if check_finite and t.numel() and not _all_finite(t):
        raise_nonfinite(t, name)
    return t, was_numpy


#: From this many elements on, finiteness is checked by one float32 sum (a NaN or Inf anywhere
#: makes it non-finite, so a finite sum proves every element finite; a sum that overflows
#: falls back to the element-wise check): one read of the array and nothing written, where
#: np.isfinite(x).all() writes a boolean per element.
SUM_CHECK_MIN = 1 << 16


def _all_finite(t: torch.Tensor) -> bool:
    if t.numel() >= SUM_CHECK_MIN and bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    # numpy's check has a fraction of torch's per-call cost: it matters for one-query searches
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float16):
        return bool(np.isfinite(t.numpy()).all())
    return bool(torch.isfinite(t).all())


def raise_nonfinite(t: torch.Tensor, name: str, row_offset: int = 0) -> None:
    """Raise the ValueError for a block that holds NaN/Inf, or whose row norms overflow."""
    bad = (~torch.isfinite(t)).any(dim=1).nonzero()[:, 0]
    if bad.numel():
        raise ValueError(f"{name} must be finite, got NaN/Inf in {bad.numel()} row(s), first "
                         f"at row {int(bad[0]) + row_offset}")
    raise ValueError(f"{name} must have rows whose norm fits in float32, got an overflowing "
                     "norm")


def finite_rows(block: torch.Tensor, norms: torch.Tensor, name: str, row_offset: int) -> None:
    """Per-block check through the row norms: a NaN/Inf entry makes its row norm NaN/Inf, so
    checking the (n,) norms is enough and costs nothing extra."""
    finite = (np.isfinite(norms.numpy()).all() if norms.device.type == "cpu"
              else torch.isfinite(norms).all())
    if not bool(finite):
        raise_nonfinite(block, name, row_offset)


def any_above(t: torch.Tensor, limit: float) -> bool:
    """Whether any element of ``t`` exceeds ``limit``. On the CPU through numpy: a torch
    reduction and its host read cost more than a small codec call's arithmetic."""
    if t.device.type == "cpu":
        return bool((t.numpy() > limit).any())
    return bool((t > limit).any())


def positive_int(value: Any, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if v < minimum or (maximum is not None and v > maximum):
        rng = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ValueError(f"{name} must be {rng}, got {v}")
    return v


def finite_float(value: Any, name: str) -> float:
    """A finite real number (an int or a float, not a bool)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not np.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def search_k(value: Any, ntotal: int) -> int:
    """k of a search: 1..max(ntotal, MAX_PADDED_K) (more than ntotal pads with -1, as faiss)."""
    return positive_int(value, "k", 1, max(int(ntotal), MAX_PADDED_K))


def part_k(value: Any, n: int, rows: Any) -> tuple[int, int, int | None]:
    """k of a search over one part (n rows) of a collection of ``rows`` rows (None: the part
    is the whole): (k checked against the collection, the k this part can answer - at most
    its rows, the rows checked to be >= n)."""
    if rows is not None:
        rows = positive_int(rows, "rows", n, INT64_MAX)
    k = search_k(value, n if rows is None else rows)
    return k, min(k, n) if n else k, rows


def row_ids(ids: Any, n: int) -> np.ndarray:
    """The ids of n new rows: ``id_array`` of shape (n,), each in 0..2**63-1 (-1 is faiss's
    "no result")."""
    a = id_array(ids)
    if a.shape != (n,):
        raise ValueError(f"ids must be an int64 array of shape ({n},), got shape "
                         f"{np.shape(ids)}")
    if a.size and int(a.min()) < 0:
        raise ValueError(f"ids must be in 0..2**63-1, got {int(a.min())}")
    return a


def id_array(ids: Any, name: str = "ids") -> np.ndarray:
    """Vector ids as a 1-D int64 numpy array: integers only (a float id is refused, never
    truncated), each within int64."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    if isinstance(ids, (bool, np.bool_)) or isinstance(ids, (float, np.floating)):
        raise TypeError(f"{name} must be integers, got {type(ids).__name__} {ids!r}")
    try:
        a = np.asarray(ids)
    except (ValueError, TypeError) as e:
        raise TypeError(f"{name} must be an integer array, got {type(ids).__name__}") from e
    if a.dtype == object:  # Python ints beyond int64 (or a mixture of types)
        vals = a.reshape(-1).tolist()
        for v in vals:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} must be integers, got {type(v).__name__} {v!r}")
            if not -INT64_MAX - 1 <= int(v) <= INT64_MAX:
                raise ValueError(f"{name} must be int64 values, got {int(v)}")
        a = np.array(vals, dtype=np.int64)
    if a.size == 0 and a.dtype.kind == "f":  # np.asarray([]) is float64: an empty id list
        a = a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.dtype == np.uint64 and a.size and int(a.max()) > INT64_MAX:
        raise ValueError(f"{name} must be int64 values, got {int(a.max())}")
    return a.astype(np.int64, copy=False).reshape(-1)


def id_scalar(value: Any, name: str = "key") -> int:
    """One vector id: an int within int64 (not a bool or a float)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int id, got {type(value).__name__} {value!r}")
    v = int(value)
    if not -INT64_MAX - 1 <= v <= INT64_MAX:
        raise ValueError(f"{name} must be an int64 id, got {v}")
    return v


def choice(value: Any, name: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


def seed(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if not 0 <= v < 2**63:
        raise ValueError(f"seed must be in 0..2**63-1, got {v}")
    return v


def uint8_codes(payload: Any, name: str, row_bytes: int) -> torch.Tensor:
    """Codes are never cast: uint8 or TypeError (as faiss)."""
    t, _ = as_tensor(payload, name)
    if t.dtype != torch.uint8:
        raise TypeError(f"{name} must have dtype uint8, got {t.dtype}")
    if t.ndim != 2 or t.shape[1] != row_bytes:
        raise ValueError(f"{name} must have shape (n, {row_bytes}), got {tuple(t.shape)}")
    return t
