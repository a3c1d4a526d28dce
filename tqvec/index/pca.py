"""``PCAIndex``: a fitted PCA basis, then TurboQuant at mixed widths (factory ``PCA,TQ{b}``).

The one index here that learns more than a mean - say so wherever it is compared. Data of low
intrinsic dimension (a few principal components holding most of the variance: docs/search.md)
wastes a data-oblivious code's bits: the random rotation spreads every direction's energy over
every coordinate, so a 2-bit TurboQuant code spends as much on noise directions as on the
leading ones. Trained PQ exploits the structure and wins there.

``train(x)`` fits the mean mu and the eigenvectors V of the covariance (descending variance;
for cosine, of the unit rows), then gives the components bits by their variance: a greedy
reverse water-filling over widths (0, 1, 2, 3, 4, 8), each step buying the largest drop of
expected squared error per bit (variance x the Lloyd-Max cost of the width), until the codes
fill the bytes of ``TQ{b}`` (ceil(b d / 8) + 4). Components of one width form a run, coded by
``MixedTurboQuant`` (its own rotation and float16 scale per run). Vectors are coded as
(x - mu) V; V is orthogonal, so inner products and distances are those of the original
space, and the index behind it is a centred ``FlatIndex`` over x V (faiss's
``IndexPreTransform`` idea) - ids, removal, filters, range search, refinement, threads and
the fast-scan kernel (one term per width) come from it.

Cost: d^2 floats of basis (2.4 MB at d = 784) and a training pass (covariance + eigh:
O(n d^2 + d^3)); a query pays one (d, m) product, the basis and
every run's rotation folded together (``MixedTurboQuant.query_matrix``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .. import _validate as V
from .. import ops
from ..codebooks import sphere_codebook, sphere_grid_codebook
from ..codecs import TurboQuant
from ..codecs.base import Codec
from ..codecs.mixed import MIXED_WIDTHS, MixedTurboQuant, mixed_code_size
from .flat import FlatIndex
from .memory import held_bytes
from .metrics import (
    METRIC_COSINE,
    METRIC_L2,
    metric_code,
    normalized,
    one_call_queries,
    row_mean,
    similarities,
    unit_rows,
)
from .rerank import check_refine
from .state import StoredWrapper, float_rows, register_wrapper

__all__ = ["PCAIndex", "allocate_widths", "first_pass_runs", "FIRST_PASS_VARIANCE"]


def _width_costs() -> dict[int, float]:
    """Expected squared error per unit of a component's variance at each width: the Lloyd-Max
    cost of a rotated coordinate (the uniform grid's at 8 bits, which MixedTurboQuant uses)."""
    d = 1024  # the per-coordinate costs barely move with the run's length (d >= 16: < 3 %)
    cost = {0: 1.0, 8: sphere_grid_codebook(d, 8).mse}
    cost.update({b: sphere_codebook(d, b).mse for b in (1, 2, 3, 4)})
    return cost


def _runs(widths: np.ndarray) -> list[tuple[int, int]]:
    """Non-increasing per-component widths -> (length, width) runs; a coded run of one
    component (MixedTurboQuant needs two) joins the wider run before it, or the next one."""
    runs: list[list[int]] = []
    for w in widths.tolist():
        if runs and runs[-1][1] == w:
            runs[-1][0] += 1
        else:
            runs.append([1, w])
    i = 0
    while i < len(runs):
        if runs[i][1] and runs[i][0] == 1 and len(runs) > 1:
            j = i - 1 if i > 0 else i + 1
            runs[j][0] += 1
            runs.pop(i)
            i = 0
            continue
        i += 1
    return [(n, w) for n, w in runs]


def allocate_widths(variances: Any, target_bytes: int) -> list[tuple[int, int]]:
    """Runs (length, bits) for components with the given variances (sorted descending) whose
    ``MixedTurboQuant`` codes take at most ``target_bytes`` per vector (scales included).

    Greedy reverse water-filling: widths rise one allowed step at a time where the variance-
    weighted cost drop per bit is largest (a heap; widths stay non-increasing along the sorted
    components, so equal widths form runs). The budget shrinks by what rounding the runs to
    whole bytes and their 2-byte scales overshoot (an overshoot of several
    scales may vanish when fewer runs form), 2 bits at a time, until the codes fit."""
    var = np.asarray(variances, dtype=np.float64)
    if var.ndim != 1 or var.size < 2 or not np.isfinite(var).all() or (var < 0).any():
        raise ValueError(f"variances must be >= 2 finite non-negative values, got shape "
                         f"{var.shape}")
    if (np.diff(var) > 1e-12 * max(float(var[0]), 1e-300)).any():
        raise ValueError("variances must be sorted in descending order")
    cost = _width_costs()
    steps = {w: nxt for w, nxt in zip(MIXED_WIDTHS[:-1], MIXED_WIDTHS[1:], strict=True)}
    d = var.size
    budget = 8 * int(target_bytes)
    # components with < 1e-6 of the variance (rank-deficient data: float32 noise of the
    # covariance) get no bits: they could buy no error worth a bit; the budget may then stay
    # partly unused
    first = [(-(var[i] * (cost[0] - cost[1])), i) for i in range(d)
             if var[i] > 1e-6 * float(var.sum())]
    heapq.heapify(first)
    while budget > 0:
        widths = np.zeros(d, dtype=np.int64)
        heap = list(first)
        used = 0
        while heap:
            _, i = heapq.heappop(heap)
            cur = int(widths[i])
            nxt = steps[cur]
            if used + nxt - cur > budget:
                continue  # too dear now; a cheaper step elsewhere may still fit
            used += nxt - cur
            widths[i] = nxt
            if nxt in steps:
                after = steps[nxt]
                heapq.heappush(heap, (-(var[i] * (cost[nxt] - cost[after]) / (after - nxt)), i))
        widths = np.sort(widths)[::-1]  # ties in variance can leave steps out of order
        runs = _runs(widths)
        if not any(w for _, w in runs):
            break
        size = mixed_code_size(runs)
        if size <= target_bytes:
            return runs
        budget -= 2
    raise ValueError(f"target_bytes={target_bytes} is too small to code any component of "
                     f"{d} (a run needs 2 components and a 2-byte scale)")


#: The share of the variance that a prefilter's first pass reads (``first_pass_runs``).
FIRST_PASS_VARIANCE = 0.9


def first_pass_runs(runs: Sequence[tuple[int, int]], variances: Any,
                    share: float = FIRST_PASS_VARIANCE) -> int:
    """How many leading coded runs hold ``share`` of the variance (at least one, at most all):
    the first pass of ``PCAIndex``'s prefilter (on low-rank data the 8- and 4-bit runs at
    2 bits/dim, a quarter of the code bytes; at 4 bits the 8-bit run alone)."""
    var = np.asarray(variances, dtype=np.float64)
    total, held, start, coded = max(float(var.sum()), 1e-300), 0.0, 0, 0
    for n, b in runs:
        if b:
            coded += 1
            held += float(var[start:start + n].sum())
            if held >= share * total:
                return coded
        start += n
    return max(coded, 1)


class PCAIndex:
    """A flat index over TurboQuant codes at mixed widths in a fitted PCA basis (module
    docstring). faiss's surface: ``train`` (required), ``add``/``add_with_ids``/``search``/
    ``range_search``/``remove_ids``/``reconstruct``/``reset``, ``ntotal``, ``d``,
    ``metric_type``, ``is_trained``, ``code_size``.

    Parameters
    ----------
    d: dimension. bits: average budget in bits per coordinate (1-8): the codes take at most the
    bytes of ``TQ{bits}``. metric, refine, k_factor: as ``FlatIndex`` (a refinement codec
    works in the PCA basis, ``"flat"`` keeps the exact vectors). seed: the runs' rotations.
    prefilter: 0 (default: every row's whole code is scored, the exact top k of the estimator)
        or P: a first pass scores the leading runs that hold ``FIRST_PASS_VARIANCE`` of the
        variance (an 8-bit run by both its nibbles), and its P k best rows are re-scored with
        their whole codes (``FlatIndex.prefilter``; an attribute, like faiss's ``nprobe``).
    """

    def __init__(self, d: int, bits: int, metric: Any = "l2", *,
                 refine: Codec | str | None = None, k_factor: int = 4, prefilter: int = 0,
                 seed: int = 0):
        self.d = V.positive_int(d, "d", 2, V.MAX_DIM)
        self.bits = V.positive_int(bits, "bits", 1, 8)
        self.metric_type = metric_code(metric)
        self.refine = check_refine(refine, self.d)  # checked now; used by train's FlatIndex
        self._k_factor = V.positive_int(k_factor, "k_factor", 1, V.MAX_CANDIDATE_FACTOR)
        self._prefilter = V.positive_int(prefilter, "prefilter", 0, V.MAX_CANDIDATE_FACTOR)
        self.seed = V.seed(seed)
        # the bytes of TQ{bits}; an inner-product (or cosine) index may spend 4 of them on the
        # centred index's exact <mu, x - mu> term (``_allocate``)
        self.target_bytes = TurboQuant(self.d, self.bits).code_size
        self.basis: torch.Tensor | None = None  # (d, d) float32, columns = components
        self.variances: np.ndarray | None = None  # (d,) of the components, descending
        self.index: FlatIndex | None = None

    # -- training ---------------------------------------------------------------------------
    @property
    def is_trained(self) -> bool:
        return self.index is not None

    def train(self, x: Any) -> None:
        """Fit mu and the basis on x (n >= 2 rows), choose the runs, build the inner index.
        Refuses once vectors are added (their codes are in the old basis)."""
        if self.index is not None and self.index.ntotal:
            raise ValueError(f"index must be empty to be trained again, got ntotal="
                             f"{self.index.ntotal} (reset() first)")
        t, _ = V.float_matrix(x, "x", self.d)
        if t.shape[0] < 2:
            raise ValueError(f"x must have >= 2 rows to fit a PCA basis, got {t.shape[0]}")
        t = t.to(torch.float32)
        if self.metric_type == METRIC_COSINE:  # the inner index codes unit rows
            t = normalized(t)
        mu = row_mean(t)
        # float32 products of centred blocks, summed in float64 (faster than float64
        # products; the components' variances span orders of magnitude)
        cov = torch.zeros((self.d, self.d), dtype=torch.float64)
        mu32 = mu.to(torch.float32)
        for s in range(0, t.shape[0], 8192):
            c = t[s:s + 8192] - mu32
            cov += (c.T @ c).to(torch.float64)
        cov /= t.shape[0]
        evals, evecs = torch.linalg.eigh(cov)  # ascending
        order = torch.argsort(evals, descending=True)
        var = evals[order].clamp_min(0).numpy()
        basis = evecs[:, order].to(torch.float32).contiguous()
        center = (mu.to(torch.float32) @ basis).numpy()
        runs, center_term = self._allocate(var, center)
        codec = MixedTurboQuant(self.d, runs, seed=self.seed,
                                first_runs=first_pass_runs(runs, var))
        self.install(basis, var.astype(np.float32),
                      FlatIndex(codec, self.metric_type, refine=self.refine,
                                k_factor=self._k_factor, prefilter=self._prefilter,
                                center=center, center_term=center_term))

    def _allocate(self, var: np.ndarray, center: np.ndarray) -> tuple[list[tuple[int, int]],
                                                                       bool]:
        """The runs in the bytes of TQ{b}, and for inner products (cosine included) whether a
        row stores the exact centring term <mu, y> (4 bytes) or the codes estimate it too.
        Chosen by the expected squared error of a score <q, x> for queries like the rows: with
        the term, sum_j s_j^2 D(w_j) over the components (variances s_j^2, widths w_j, D the
        width's error per unit variance); without it, sum_j (s_j^2 + m_j^2) s_j^2 D(w_j), m the
        centre in the basis, but with 4 more bytes of codes. On 20-d data the term took 4 of
        14 bytes and halved recall@10; at hundreds of dimensions it is kept."""
        if self.metric_type == METRIC_L2:
            return allocate_widths(var, self.target_bytes), False
        cost = _width_costs()

        def error(runs: list[tuple[int, int]], weight: np.ndarray) -> float:
            widths = np.zeros(len(var), dtype=np.int64)
            at = 0
            for length, bits in runs:
                widths[at:at + length] = bits
                at += length
            return float(np.sum(weight * var * np.array([cost[int(w)] for w in widths])))

        with_term = allocate_widths(var, self.target_bytes - 4)
        without = allocate_widths(var, self.target_bytes)
        m2 = np.asarray(center, dtype=np.float64) ** 2
        if error(without, var + m2) < error(with_term, var):
            return without, False
        return with_term, True

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(meta, arrays): the inner index's state with the fit beside it (``tqvec.index.io``)."""
        if self.index is None:
            raise ValueError("index must be trained before it is written (PCA,TQ{b} has no "
                             "basis yet)")
        meta, arrays = self.index.state()
        meta["pca"] = {"bits": self.bits, "seed": self.seed}
        arrays["pca.basis"] = self.basis.numpy()
        arrays["pca.variances"] = self.variances
        return meta, arrays

    def install(self, basis: torch.Tensor, variances: np.ndarray, index: FlatIndex) -> None:
        """Take a fit and the centred inner index that codes in its basis (``train``, or a
        state read back), and give that index the query map of this fit."""
        self.basis, self.variances, self.index = basis, variances, index
        M, slices = self.codec.query_matrix()
        mu = torch.from_numpy(np.asarray(index.center, dtype=np.float32))
        index.query_map = ((basis @ M).contiguous(), slices, (mu @ basis.T).contiguous())

    def _fused_query_map(self) -> tuple[torch.Tensor, list[slice], torch.Tensor]:
        """(W, slices, mu): the basis and the runs' rotations as one (d, m) matrix W = V M
        (``MixedTurboQuant.query_matrix``) and the centre in the original space, mu V^T (the
        inner index's ``query_map``, set by ``install``)."""
        return self.index.query_map

    def _search_fused(self, x: Any, k: int, snap: Any) -> tuple[np.ndarray, np.ndarray] | None:
        """``search`` of float32 numpy queries without a filter or refinement on the CPU fast
        scan, with one product per query block, x W, for the basis and every run's rotation
        (instead of a basis product and one rotation per run); None where that
        does not apply (the general path then also reports bad input). The inner index's
        query steps, in the original space: L2 queries centred by mu (||q - mu|| is the
        basis's, V being orthogonal), inner products offset by <q, mu>, cosine on unit rows -
        all of it one compiled call where the inner index has it (``FlatIndex.search_mapped``:
        at one query the Python steps are a fifth of the search), else these steps composed."""
        index = self.index
        if not (one_call_queries(x, self.d) and index.refine is None):
            return None
        out = index.search_mapped(np.ascontiguousarray(x), k, snap)  # one compiled call
        if out is not None:
            return out

        def prepare() -> tuple[list[np.ndarray], torch.Tensor, np.ndarray | None] | None:
            if not V.norms_fit(x):
                return None
            q = torch.from_numpy(unit_rows(x) if self.metric_type == METRIC_COSINE else x)
            W, slices, mu = self._fused_query_map()
            offsets = None
            if self.metric_type == METRIC_L2:
                q = q - mu
            else:
                offsets = ops.row_dots(q, mu).numpy()
            # the terms as numpy views: the kernel takes them as they are
            t = ops.row_project(q, W, self.codec.backend).numpy()
            return [t[:, s] for s in slices], q, offsets

        return index.search_prepared(k, prepare, snap)

    @property
    def codec(self) -> MixedTurboQuant | None:
        return None if self.index is None else self.index.codec  # type: ignore[return-value]

    @property
    def groups(self) -> list[tuple[int, int]] | None:
        """The runs (components, bits) chosen by ``train``."""
        return None if self.index is None else list(self.codec.groups)

    # -- the transform ----------------------------------------------------------------------
    def _trained(self, what: str) -> FlatIndex:
        if self.index is None:
            raise ValueError(f"index must be trained before {what}: PCA,TQ{self.bits} fits its "
                             f"basis in train(x)")
        return self.index

    def _to_basis(self, x: Any, name: str) -> np.ndarray:
        # the compiled product sums each entry in one order: a torch GEMM's rounding depends on
        # how many threads it gets, which varies with other threads' searches
        return ops.row_project(V.query_rows(x, name, self.d, torch.device("cpu")),
                               self.basis).numpy()

    def _from_basis(self, y: np.ndarray) -> np.ndarray:
        return (torch.from_numpy(y) @ self.basis.T).numpy()

    # -- faiss surface ----------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        return 0 if self.index is None else self.index.ntotal

    def memory_bytes(self) -> int:
        """Bytes of memory this index holds: the basis and mean, and its flat index's
        (``FlatIndex.memory_bytes``), each buffer once."""
        return held_bytes(self)

    @property
    def code_size(self) -> int:
        """Bytes stored per vector (after train; before it, the budget ``TQ{bits}`` has)."""
        return self.target_bytes if self.index is None else self.index.code_size

    @property
    def k_factor(self) -> int:
        return self._k_factor

    @k_factor.setter
    def k_factor(self, value: int) -> None:
        self._k_factor = V.positive_int(value, "k_factor", 1, V.MAX_CANDIDATE_FACTOR)
        if self.index is not None:
            self.index.k_factor = self._k_factor

    @property
    def prefilter(self) -> int:
        """Candidates per result of the first pass over the leading runs (0: exact scan)."""
        return self._prefilter

    @prefilter.setter
    def prefilter(self, value: int) -> None:
        self._prefilter = V.positive_int(value, "prefilter", 0, V.MAX_CANDIDATE_FACTOR)
        if self.index is not None:
            self.index.prefilter = self._prefilter

    def add(self, x: Any) -> None:
        self._trained("add").add(self._to_basis(x, "x"))

    def add_with_ids(self, x: Any, ids: Any) -> None:
        self._trained("add").add_with_ids(self._to_basis(x, "x"), ids)

    def search(self, x: Any, k: int, *, allowed_ids: Sequence[int] | np.ndarray | None = None,
               params: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """As ``FlatIndex.search`` (distances and inner products of the original space)."""
        index = self._trained("search")
        snap = index.snapshot()  # one state answers the whole search, whichever route runs
        k = V.search_k(k, snap.n)
        if allowed_ids is None and params is None:
            out = self._search_fused(x, k, snap)
            if out is not None:
                return out
        return index.search_in(snap, self._to_basis(x, "x"), k, allowed_ids=allowed_ids,
                               params=params)

    def search_candidates(self, x: Any, k: int, *,
                          allowed_ids: Sequence[int] | np.ndarray | None = None,
                          rows: int | None = None, probes: Any = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As ``FlatIndex.search_candidates`` (no ``probes``: a PCA index has no lists)."""
        if probes is not None:
            raise ValueError("probes apply to an IVF index, not a PCAIndex")
        if self.index is not None and self.index.refine is None:
            _, k_here, _ = V.part_k(k, self.ntotal, rows)
            D, I = self.search(x, k_here, allowed_ids=allowed_ids)  # the fused path
            s = similarities(self.metric_type, D, I)
            return s, s, I
        return self._trained("search").search_candidates(self._to_basis(x, "x"), k,
                                                          allowed_ids=allowed_ids, rows=rows)

    def scan_candidates(self, x: Any, k: int, *,
                        allowed_ids: Sequence[int] | np.ndarray | None = None,
                        rows: int | None = None, probes: Any = None
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As ``FlatIndex.scan_candidates`` (no ``probes``)."""
        if probes is not None:
            raise ValueError("probes apply to an IVF index, not a PCAIndex")
        return self._trained("search").scan_candidates(self._to_basis(x, "x"), k,
                                                       allowed_ids=allowed_ids, rows=rows)

    def refine_candidates(self, x: Any, positions: Any) -> np.ndarray:
        """As ``FlatIndex.refine_candidates``."""
        return self._trained("search").refine_candidates(self._to_basis(x, "x"), positions)

    @property
    def next_id(self) -> int:
        return 0 if self.index is None else self.index.next_id

    def range_search(self, x: Any, radius: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._trained("range_search").range_search(self._to_basis(x, "x"), radius)

    def remove_ids(self, ids: Any) -> int:
        return 0 if self.index is None else self.index.remove_ids(ids)

    def reset(self) -> None:
        """Drop the vectors, keep the fit (as faiss's reset keeps training)."""
        if self.index is not None:
            self.index.reset()

    def reconstruct(self, key: int) -> np.ndarray:
        return self._from_basis(self._trained("reconstruct").reconstruct(key)[None])[0]

    def reconstruct_n(self, i0: int, n: int) -> np.ndarray:
        return self._from_basis(self._trained("reconstruct").reconstruct_n(i0, n))

    def to_faiss(self, **_: Any) -> Any:
        raise ValueError("to_faiss() has no faiss equivalent for PCA,TQ{b} (mixed-width "
                         "TurboQuant codes)")

    def __repr__(self) -> str:
        runs = "" if self.index is None else f", groups={self.groups}"
        return (f"PCAIndex(d={self.d}, bits={self.bits}, ntotal={self.ntotal}, "
                f"code_size={self.code_size}{runs})")


# -- files: the PCA index's part of tqvec.index.state -------------------------------------------

def _wrap_from_state(meta: dict, arrays: dict, index: FlatIndex) -> PCAIndex:
    """Wrap the inner index of a ``PCAIndex`` state again, checking its fit."""
    if not index.centered:
        raise ValueError("a PCA index must hold a centred flat index")
    fit = meta["pca"]
    if not isinstance(fit, dict) or set(fit) != {"bits", "seed"}:
        raise ValueError(f"pca must be an object with bits and seed, got {fit!r:.80}")
    d = index.d
    basis = float_rows(arrays, "pca.basis", (d, d)).clone()
    var = float_rows(arrays, "pca.variances", (d,)).numpy().copy()
    # orthonormal columns, or distances in the basis are not the original ones
    err = float((basis.T.double() @ basis.double() - torch.eye(d, dtype=torch.float64)).abs().max())
    if err > 1e-3:
        raise ValueError(f"basis must be orthogonal, got max |V^T V - I| = {err:.3g}")
    pca = PCAIndex(d, fit["bits"], index.metric_type, refine=index.refine,
                   k_factor=index.k_factor, prefilter=index.prefilter, seed=fit["seed"])
    pca.install(basis, var, index)
    return pca


register_wrapper(StoredWrapper(PCAIndex, FlatIndex, "pca",
                               frozenset({"pca.basis", "pca.variances"}), _wrap_from_state,
                               "PCA basis"))
