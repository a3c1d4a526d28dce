"""What every tqvec index over stored codes shares: faiss's surface for ids and rows (add,
add_with_ids, remove_ids, reconstruct, ntotal, k_factor), a memory-mapped file's check, and the
one composition every search is - prepare the queries -> scan for candidates -> re-rank with the
refinement -> ids and the metric's distances. An index supplies how its rows are encoded, how
queries are prepared and how a block of them is scanned (``FlatIndex``: the codes themselves;
``IVFIndex``: the probed inverted lists), and may supply a fused compiled implementation of the
whole composition for float32 numpy queries.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .. import _validate as V
from ..codecs.base import Codec, Codes
from .memory import held_bytes
from .metrics import (
    METRIC_L2,
    QUERY_BLOCK,
    metric_code,
    padded,
    range_results,
    results,
    similarities,
)
from .rerank import RefineLut, check_refine, refine_lut, rerank
from .rows import Rows

__all__ = ["CodesIndex"]


def _positions_in(pos: np.ndarray, sel: np.ndarray, n: int) -> np.ndarray:
    """Per row, the column of ``pos`` (distinct values per row, -1 padding) holding each value
    of ``sel`` (values of that row of pos, or -1: column 0), without a loop over rows."""
    rows, cols = pos.shape
    order = np.argsort(pos, axis=1, kind="stable")
    base = np.arange(rows, dtype=np.int64)[:, None] * (n + 2)
    keys = (np.take_along_axis(pos, order, 1) + 1 + base).ravel()
    found = np.searchsorted(keys, (sel + 1 + base).ravel()).reshape(sel.shape)
    col = np.clip(found - np.arange(rows)[:, None] * cols, 0, cols - 1)
    return np.where(sel >= 0, np.take_along_axis(order, col, 1), 0)


#: Every live index's lock, for the fork handlers below.
_LOCKS: weakref.WeakKeyDictionary[CodesIndex, threading.Lock] = weakref.WeakKeyDictionary()


def _locks_before_fork() -> list[threading.Lock]:
    """Take every index's lock before a fork(), so that the child starts from indexes no
    thread was changing (a lock held by another thread at the fork stays held in the child,
    where that thread does not exist: its first search would wait forever)."""
    held = []
    for lock in list(_LOCKS.values()):
        lock.acquire()
        held.append(lock)
    return held


_FORK_HELD: list[threading.Lock] = []


def _fork_prepare() -> None:
    _FORK_HELD[:] = _locks_before_fork()


def _fork_release() -> None:
    while _FORK_HELD:
        _FORK_HELD.pop().release()


os.register_at_fork(before=_fork_prepare, after_in_parent=_fork_release,
                    after_in_child=_fork_release)


class CodesIndex:
    """Base of the indexes that store codes of one codec (not instantiated itself).

    Subclasses set ``codec``, ``d``, ``metric_type``, ``refine``, ``device``, ``is_trained``
    and ``_scoring`` (the metric the codes are scored with), call ``_init_rows`` and implement
    ``_encode``, ``_queries`` and ``_scan_block`` (and ``_fused_search`` /
    ``_fused_candidates`` where they have them).
    """

    codec: Codec
    d: int
    metric_type: int
    device: torch.device
    is_trained: bool
    _scoring: int

    def _init_rows(self, codec: Codec, metric: Any, refine: Any, k_factor: int) -> None:
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a tqvec codec, got {type(codec).__name__}")
        self.codec = codec
        self.d = codec.dim
        self.metric_type = metric_code(metric)
        self.refine = check_refine(refine, self.d)
        self.k_factor = k_factor
        self._lock = threading.Lock()
        _LOCKS[self] = self._lock
        self._rows = Rows()
        self._mapped: Any = None
        self._ref_lut: RefineLut | None = None
        self._ref_lut_done = False
        self._snap: Any = None  # the cached search snapshot (_current)

    # -- to implement -------------------------------------------------------------------------
    def _encode(self, t: torch.Tensor) -> tuple[Codes, Any, dict[str, torch.Tensor]]:
        """(codes, refinement rows or None, per-row terms) of new float rows t."""
        raise NotImplementedError

    def _queries(self, x: Any) -> tuple[torch.Tensor, np.ndarray | None]:
        """Validated, prepared queries, and offsets per query added to the final scores."""
        raise NotImplementedError

    def _scan_block(self, q: torch.Tensor, snap: Any, mask: torch.Tensor | None, kk: int,
                    nq_total: int, route: tuple[int, int] | None = None, probes: Any = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Best kk (similarities, row positions) of prepared queries q (l2: negated squared
        distances), padded with -inf / -1. ``route``: (rows, candidates) of a larger
        collection whose scan route to take (default: this index's own); ``probes``: an IVF
        index's probed lists and offsets for these queries (``IVFIndex.probe``)."""
        raise NotImplementedError

    def _fused_search(self, x: Any, snap: Any, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The whole search in one compiled call, where this index has one for x; None
        otherwise (and for queries holding NaN or Inf, which the composition reports)."""
        return None

    def _fused_candidates(self, q: torch.Tensor, snap: Any, kk: int, probes: Any
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``search_candidates``' (scan, final, I) of prepared queries q (one block, no
        ``allowed_ids``) in one compiled call, where this index has one; None otherwise."""
        return None

    def _snapshot(self) -> Any:
        """What a search reads, taken together (call with the lock held)."""
        raise NotImplementedError

    def _invalidate(self) -> None:
        """Drop the search-time state derived from the rows (lock held)."""
        self._ref_lut = None
        self._ref_lut_done = False
        self._snap = None

    def _current(self) -> Any:
        """The search snapshot, taken once per change of what it holds (``_invalidate``)."""
        snap = self._snap
        if snap is None:
            with self._lock:
                snap = self._snap
                if snap is None:
                    snap = self._snap = self._snapshot()
        return snap

    #: What ``train`` does for this index, for the error of a use before it.
    _train_hint = "call index.train(x) first (is_trained is False)"

    def _check_ready(self, what: str) -> None:
        if not self.is_trained:
            raise ValueError(f"index must be trained before {what}: {self._train_hint}")

    # -- parameters ----------------------------------------------------------------------------
    @property
    def k_factor(self) -> int:
        """Candidates per result taken from the codes for the refinement to re-rank."""
        return self._k_factor

    @k_factor.setter
    def k_factor(self, value: int) -> None:
        self._k_factor = V.positive_int(value, "k_factor", 1, V.MAX_CANDIDATE_FACTOR)

    @property
    def ntotal(self) -> int:
        return self._rows.n

    @property
    def next_id(self) -> int:
        """The id ``add`` gives its next row: one past the largest id added so far."""
        return self._rows.next_id

    def memory_bytes(self) -> int:
        """Bytes of memory this index holds: codes, ids, per-vector scalars and derived terms,
        the refinement's rows, the search layouts built so far, the codec's rotation, sketch
        and codebooks once drawn, and what was trained (a centre, IVF centroids); each buffer
        once (a memory-mapped file's arrays included)."""
        return held_bytes(self)

    def check_mapped(self) -> None:
        """Raise ``FormatError`` if the file this index memory-maps (``read_index(...,
        mmap=True)``) changed since it was read; every search, range search and reconstruction
        checks it first."""
        if self._mapped is not None:
            self._mapped.check()

    # -- rows ------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Remove every vector (what was trained stays, as in faiss); ``next_id`` starts at 0
        again. Searches running meanwhile answer from the rows they started with."""
        with self._lock:
            self._rows.reset()
            self._mapped = None
            self._invalidate()
            self._removed()

    def add(self, x: Any) -> None:
        """Add vectors with ids ntotal, ntotal+1, ... (faiss's convention; after custom ids,
        from one past the largest)."""
        t, _ = V.float_matrix(x, "x", self.d)
        self._next_ids(t.shape[0])  # refused before the encoding
        self._append(t, None)

    def add_with_ids(self, x: Any, ids: Any) -> None:
        """Add vectors with the given ids (integers in 0..2**63-1; -1 stands for "no result")."""
        t, _ = V.float_matrix(x, "x", self.d)
        self._append(t, torch.from_numpy(V.row_ids(ids, t.shape[0]).copy()))

    def _next_ids(self, n: int) -> torch.Tensor:
        """The ids ``add`` gives n new rows (call with the lock held to reserve them: two
        threads adding at once get distinct ids)."""
        start = self._rows.next_id
        if start + n - 1 > V.INT64_MAX:
            raise ValueError(f"add() numbers the rows from next id {start}: {n} more do not fit "
                             "in int64; use add_with_ids")
        return torch.arange(start, start + n, dtype=torch.int64)

    def _append(self, t: torch.Tensor, ids: torch.Tensor | None) -> None:
        """Encode rows t and store them with ``ids`` (None: ``add``'s numbering, taken under
        the lock together with the append)."""
        if t.shape[0] == 0:
            return
        self._check_ready("add")
        codes, ref, per_row = self._encode(t)
        with self._lock:
            self._rows.append(codes, self._next_ids(t.shape[0]) if ids is None else ids, ref,
                              per_row)
            self._invalidate()

    def remove_ids(self, ids: Any) -> int:
        """Remove the given ids; returns how many were removed (faiss semantics)."""
        sel = torch.from_numpy(V.id_array(ids))
        with self._lock:
            if self._rows.n == 0 or sel.numel() == 0:
                return 0
            removed = self._rows.keep(~torch.isin(self._rows.ids, sel))
            if removed:
                self._invalidate()
                self._removed()
            return removed

    def _removed(self) -> None:
        """After rows were removed (lock held): drop layouts that only grow by appends."""

    def _position(self, key: Any) -> int:
        self.check_mapped()
        return self._rows.position(key)

    def _positions(self, i0: Any, n: Any) -> tuple[int, int]:
        """Checked (i0, n) of ``reconstruct_n``."""
        i0 = V.positive_int(i0, "i0", 0)
        n = V.positive_int(n, "n", 0)
        if i0 + n > self._rows.n:
            raise ValueError(f"i0, n must select positions within 0..{self._rows.n}, got {i0}, "
                             f"{n}")
        self.check_mapped()
        return i0, n

    def reconstruct(self, key: int) -> np.ndarray:
        """The vector with id ``key`` as the codes hold it -> (d,) float32."""
        p = self._position(key)
        return self.reconstruct_n(p, 1)[0]

    def reconstruct_n(self, i0: int, n: int) -> np.ndarray:
        raise NotImplementedError

    # -- search ----------------------------------------------------------------------------------
    def _refine_lut(self) -> RefineLut | None:
        """The refinement's rotated-domain tables (``rerank.refine_lut``), built once per
        change of the rows (call with the lock held)."""
        if not self._ref_lut_done:
            self._ref_lut = refine_lut(self.refine, self._rows.ref, self._scoring, self.device)
            self._ref_lut_done = True
        return self._ref_lut

    def _candidates(self, n: int, k: int) -> int:
        """Candidates a scan returns per query: k, or k_factor k for a refinement."""
        return min(n, k * self._k_factor if self.refine is not None else k)

    def _allowed_mask(self, allowed_ids: Any, ids: torch.Tensor) -> torch.Tensor | None:
        if allowed_ids is None:
            return None
        sel = torch.from_numpy(V.id_array(allowed_ids, "allowed_ids"))
        return torch.isin(ids, sel).to(self.device)

    def range_search(self, x: Any, radius: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All results within ``radius``: L2 distance < radius, or similarity > radius, among
        the rows the index scans (an IVF index: the probed lists, as faiss's).

        Returns faiss's ``(lims, D, I)``: results of query i are D[lims[i]:lims[i+1]].
        """
        self._check_ready("range_search")
        radius = V.finite_float(radius, "radius")
        self.check_mapped()
        q, off = self._queries(x)
        per_query: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(q.shape[0])]
        l2 = self.metric_type == METRIC_L2
        for qsel, s, ids in self._range_scores(q, off):  # l2 scores are -||q - x||^2
            s = -s if l2 else s
            inside = s < radius if l2 else s > radius
            for a, qi in enumerate(qsel.tolist()):
                sel = inside[a].nonzero()[:, 0]
                if sel.numel():
                    sel = sel.cpu()
                    per_query[qi].append((s[a].cpu()[sel].numpy(), ids[sel].numpy()))
        return range_results(per_query)

    def _range_scores(self, q: torch.Tensor, off: np.ndarray | None):
        """Yield (query rows (m,), their (m, n) metric scores, the n rows' ids) over every row
        ``range_search`` considers (``off``: the queries' offsets from ``_queries``)."""
        raise NotImplementedError

    def search(self, x: Any, k: int, *, allowed_ids: Sequence[int] | np.ndarray | None = None,
               params: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """k nearest neighbours of each row of x: ``(D, I)`` as faiss returns them.

        ``allowed_ids`` restricts the search to those ids and still returns k results when k of
        them exist (faiss's ``SearchParameters(sel=...)`` idea). ``params`` may be a faiss
        ``SearchParameters`` whose ``sel`` is an ``IDSelectorBatch``/``IDSelectorArray``-like
        object with ``is_member``; prefer ``allowed_ids``.
        """
        self._check_ready("search")
        self.check_mapped()
        return self.search_in(self._current(), x, k, allowed_ids=allowed_ids, params=params)

    def snapshot(self) -> Any:
        """The state a search reads, taken at once under the lock (its rows, their scan layout
        and the parameters it was built with); later changes leave it as it is. An index that
        owns this one (``PCAIndex``) takes one and answers a whole search from it
        (``search_in``, ``FlatIndex.search_mapped`` / ``search_prepared``)."""
        self._check_ready("search")
        self.check_mapped()
        return self._current()

    def search_in(self, snap: Any, x: Any, k: int, *,
                  allowed_ids: Sequence[int] | np.ndarray | None = None,
                  params: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """``search`` answered from a ``snapshot`` of this index."""
        k = V.search_k(k, snap.rows.n)
        if params is not None and getattr(params, "sel", None) is not None and allowed_ids is None:
            sel = params.sel
            allowed_ids = [int(i) for i in snap.rows.ids.tolist() if sel.is_member(int(i))]
        mask = None
        if allowed_ids is None:
            out = self._fused_search(x, snap, k)
            if out is not None:
                return out
        else:
            mask = self._allowed_mask(allowed_ids, snap.rows.ids)
        q, offsets = self._queries(x)
        return self._search_queries(q, offsets, snap, k, mask)

    def _check_probes(self, probes: Any) -> None:
        if probes is not None and not hasattr(self, "probe"):
            raise ValueError(f"probes apply to an IVF index, not a {type(self).__name__}")

    def _checked_probes(self, probes: Any, nq: int) -> Any:
        """User-supplied ``probes`` for nq queries, checked (an IVF index's lists)."""
        return probes

    def _part_search(self, x: Any, k: int, allowed_ids: Any, rows: int | None) -> tuple:
        """What a search over one part of a collection starts from (``search_candidates``,
        ``scan_candidates``): (snapshot, scan route, filter mask, prepared queries, their
        offsets, candidates per query)."""
        self._check_ready("search")
        self.check_mapped()
        snap = self._current()
        route = None if rows is None else (rows, self._candidates(rows, k))
        mask = None if allowed_ids is None else self._allowed_mask(allowed_ids, snap.rows.ids)
        q, offsets = self._queries(x)
        return snap, route, mask, q, offsets, self._candidates(snap.rows.n, k)

    def search_candidates(self, x: Any, k: int, *,
                          allowed_ids: Sequence[int] | np.ndarray | None = None,
                          rows: int | None = None, probes: Any = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What a search of k results chooses from, so that the searches of several indexes
        over parts of one collection merge into exactly the one index's result
        (``tqvec.distributed.merge_candidates``): ``(scan, final, I)``, each (nq, kk). Without
        a refinement kk = k, ``scan`` = ``final`` = the search's similarities. With one, the
        scan's kk = min(ntotal, k_factor k) best rows (the rows the refinement re-ranks) with
        their scan similarities, their refined similarities ``final``, and their ids. Similarities
        are larger-is-better (l2: minus the squared distance); -inf with id -1 past the rows
        there are. ``rows``: the rows of the whole collection (default: ntotal), whose search
        this one's scan then runs as: a scan's first-stage scores are a function of the query
        and the row only within one scan route (the fast scan's 8-bit tables under a
        refinement), and the route depends on the rows per result. ``probes``: an IVF index's
        ``probe(x)`` of the same queries, computed once for all the parts."""
        self._check_probes(probes)
        k, k_here, rows = V.part_k(k, self._rows.n, rows)
        if self.refine is None and probes is None:
            D, I = self.search(x, k_here, allowed_ids=allowed_ids)
            s = similarities(self.metric_type, D, I)
            return s, s, I
        snap, route, mask, q, offsets, kk = self._part_search(x, k, allowed_ids, rows)
        nq, n = q.shape[0], snap.rows.n
        probes = self._checked_probes(probes, nq)
        scan = np.full((nq, kk), -np.inf, np.float32)
        final = np.full((nq, kk), -np.inf, np.float32)
        I = np.full((nq, kk), -1, np.int64)
        if n == 0 or nq == 0:
            return scan, final, I
        ids = snap.rows.ids.numpy()
        for qs in range(0, nq, QUERY_BLOCK):
            qe = min(nq, qs + QUERY_BLOCK)
            qb = q[qs:qe]
            pb = None if probes is None else (probes[0][qs:qe], probes[1][qs:qe])
            off = 0.0 if offsets is None else offsets[qs:qe, None]
            fused = None if mask is not None else self._fused_candidates(qb, snap, kk, pb)
            if fused is not None:
                scan[qs:qe], final[qs:qe], I[qs:qe] = fused[0] + off, fused[1] + off, fused[2]
                continue
            vals, pos = self._scan_block(qb, snap, mask, kk, nq, route, pb)
            if self.refine is None:  # the scan's rows are the result (IVF with probes)
                rv, rp, sv = vals, pos, vals
            else:
                rv, rp = rerank(qb, vals, pos, self.refine, snap.rows.ref, snap.ref_lut,
                                self._scoring, kk)
                at = _positions_in(pos, np.where(np.isfinite(rv), rp, -1), n)
                sv = np.take_along_axis(vals, at, 1)  # the scan's score of each re-ranked row
            m = rv.shape[1]
            ok = np.isfinite(rv)
            scan[qs:qe, :m] = np.where(ok, sv + off, -np.inf)
            final[qs:qe, :m] = np.where(ok, rv + off, -np.inf)
            I[qs:qe, :m] = np.where(ok, ids[np.maximum(rp, 0)], -1)
        return scan, final, I

    def scan_candidates(self, x: Any, k: int, *,
                        allowed_ids: Sequence[int] | np.ndarray | None = None,
                        rows: int | None = None, probes: Any = None
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The scan half of ``search_candidates``, for a merge that re-ranks after it
        (``tqvec.index.merge_scans``: the parts scan, the merge picks the best candidates over
        all of them, each part re-ranks only its own with ``refine_candidates``): ``(scan,
        positions, I)``, each (nq, kk), best scan first: kk = min(ntotal, k_factor k) under a
        refinement (k without one), the scan's similarities (larger is better, -inf past the
        rows there are), each candidate's row position in this index (-1: none; valid while
        the index is unchanged) and its id. ``rows``, ``probes``: as ``search_candidates``."""
        self._check_probes(probes)
        k, _, rows = V.part_k(k, self._rows.n, rows)
        snap, route, mask, q, offsets, kk = self._part_search(x, k, allowed_ids, rows)
        nq, n = q.shape[0], snap.rows.n
        probes = self._checked_probes(probes, nq)
        scan = np.full((nq, kk), -np.inf, np.float32)
        pos = np.full((nq, kk), -1, np.int64)
        I = np.full((nq, kk), -1, np.int64)
        if n == 0 or nq == 0:
            return scan, pos, I
        ids = snap.rows.ids.numpy()
        for qs in range(0, nq, QUERY_BLOCK):
            qe = min(nq, qs + QUERY_BLOCK)
            pb = None if probes is None else (probes[0][qs:qe], probes[1][qs:qe])
            off = 0.0 if offsets is None else offsets[qs:qe, None]
            vals, p = self._scan_block(q[qs:qe], snap, mask, kk, nq, route, pb)
            m = vals.shape[1]
            ok = np.isfinite(vals) & (p >= 0)
            scan[qs:qe, :m] = np.where(ok, vals + off, -np.inf)
            pos[qs:qe, :m] = np.where(ok, p, -1)
            I[qs:qe, :m] = np.where(ok, ids[np.maximum(p, 0)], -1)
        return scan, pos, I

    def refine_candidates(self, x: Any, positions: Any) -> np.ndarray:
        """The refined similarities ``search_candidates`` reports as ``final`` of the rows at
        ``positions`` (nq, m) int64 (from ``scan_candidates`` of the same queries, this index
        unchanged since; -1: none, -inf there), (nq, m) float32 in the same order."""
        if self.refine is None:
            raise ValueError("refine_candidates needs an index with a refinement (Refine(...) "
                             "in its factory string); without one the scan is the result")
        self._check_ready("search")
        self.check_mapped()
        snap = self._current()
        q, offsets = self._queries(x)
        nq, n = q.shape[0], snap.rows.n
        pos = np.asarray(positions)
        if pos.dtype != np.int64 or pos.ndim != 2 or pos.shape[0] != nq:
            raise ValueError(f"positions must be an int64 array of shape ({nq}, m), got "
                             f"{pos.dtype} of shape {pos.shape}")
        if pos.size and (int(pos.min()) < -1 or int(pos.max()) >= n):
            raise ValueError(f"positions must be row positions in -1..{n - 1} (this index's "
                             f"rows; -1: none), got {int(pos.min())}..{int(pos.max())}")
        m = pos.shape[1]
        final = np.full((nq, m), -np.inf, np.float32)
        if m == 0 or nq == 0:
            return final
        for qs in range(0, nq, QUERY_BLOCK):
            qe = min(nq, qs + QUERY_BLOCK)
            p = pos[qs:qe]
            none = np.where(p >= 0, np.float32(0), np.float32(-np.inf))  # rows to re-rank
            rv, rp = rerank(q[qs:qe], none, p, self.refine, snap.rows.ref, snap.ref_lut,
                            self._scoring, m)
            ok = np.isfinite(rv)
            at = _positions_in(p, np.where(ok, rp, -1), n)  # each re-ranked row's column
            r, c = np.nonzero(ok)
            off = 0.0 if offsets is None else offsets[qs:qe][r]
            final[qs + r, at[r, c]] = rv[r, c] + off
        return final

    def _search_queries(self, q: torch.Tensor, offsets: np.ndarray | None, snap: Any, k: int,
                        mask: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray]:
        """The composition for prepared queries: scan, re-rank, ids and distances."""
        nq, n = q.shape[0], snap.rows.n
        if n == 0 or nq == 0:
            return padded(self.metric_type, nq, k)
        ids = snap.rows.ids.numpy()
        kk = self._candidates(n, k)
        blocks = []
        for qs in range(0, nq, QUERY_BLOCK):
            qe = min(nq, qs + QUERY_BLOCK)
            qb = q if nq <= QUERY_BLOCK else q[qs:qe]
            vals, pos = self._scan_block(qb, snap, mask, kk, nq)
            if snap.rows.ref is not None:
                vals, pos = rerank(qb, vals, pos, self.refine, snap.rows.ref, snap.ref_lut,
                                   self._scoring, k)
            blocks.append(self._results(vals, pos, ids, k,
                                        None if offsets is None else offsets[qs:qe]))
        if len(blocks) == 1:
            return blocks[0]
        return np.concatenate([b[0] for b in blocks]), np.concatenate([b[1] for b in blocks])

    def _results(self, vals: np.ndarray, pos: np.ndarray, ids: np.ndarray, k: int,
                 offsets: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(D, I) from best-first similarities: L2 distances, plus per-query offsets."""
        if self.metric_type == METRIC_L2:
            vals = -vals
        if offsets is not None:
            vals = vals + offsets[:, None]
        return results(self.metric_type, vals, pos, ids, k)
