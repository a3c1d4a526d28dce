"""Inverted-file search over tqvec codes of residuals (IVF-ADC), with faiss's interface.

``IVFIndex`` is the one index here that trains: ``train(x)`` runs k-means (``faiss.Kmeans``) to
get ``nlist`` centroids. ``add`` assigns each vector to its nearest centroid c and encodes the
residual r = x - c with the (still data-oblivious) codec; ``search`` scores only the ``nprobe``
lists whose centroids are closest to the query (faiss's ``nprobe``, default 1).

Because r is smaller than x, the codec's error, proportional to the norm it encodes, shrinks with
it: on Fashion-MNIST at 4 bits recall@10 rises above the flat index's (see README). Scores are the
flat index's estimators with the centroid part computed exactly (Jegou et al. 2011, IVF-ADC):

* ``ip``: <q, c> + a <c, r> + est<q - c, r> (RaBitQ's estimator, as the flat index's centred
  inner product: only <q - c, r> comes from the codes; <c, r> is exact, stored per row, with the
  estimator's scale a; see ``flat``'s module docstring);
* ``l2``: ||q - c||^2 - 2 est<q, r> + 2 est<c, r> + N(r), i.e. the distance to the reconstruction
  c + r_hat for the biased mse codes (N = ||r_hat||^2) and an unbiased estimate for the unbiased
  ones (N = ||r||^2), the same pairing as the flat index (issue #6, lesson (a));
* ``cosine``: vectors and queries are normalized, ranked by the ``l2`` estimate and reported as
  cosine = 1 - d^2 / 2 (on the unit sphere the two orders agree).

The row term -2 est<c, r> - N(r) (l2; the codes hold it) or a <c, r> - est<c, r> (ip; 4 bytes per
vector, as the estimators are linear in the query) is computed once at add time, so a query's
score of row j in list l is ``w est<q, r_j> + row_j + offset(q, l)`` with offset = -||q - c_l||^2
(l2) or <q, c_l> (ip): TurboQuant-mse codes at 1, 2, 3 and 4 bits on CPU are scanned by
``ops.IVFFastScan`` over a list-major blocked copy (built at the first search after a change,
like the flat index's), every other codec by the codec's own scorer list by list. Float32 numpy
queries without a filter take a short path (``_search_fast_numpy``) with the same results bit for
bit. Filtered search (``allowed_ids``) only sees the probed lists, as in faiss.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import _validate as V
from .. import ops
from ..codecs.base import Codec, Codes
from .flat import (
    _QUERY_BLOCK,
    METRIC_COSINE,
    METRIC_INNER_PRODUCT,
    METRIC_L2,
    FlatIndex,
    _normalized,
    _unit_rows,
    ip_row_correction,
    metric_name,
)
from .fused import IVFSearch

__all__ = ["IVFIndex"]

_ROWS = 32  # rows per fast-scan block: every list starts on a block boundary
_MAX_NLIST = 1 << 24
_MAX_NITER = 1 << 20
_ASSIGN_BLOCK = 16384


class IVFIndex(FlatIndex):
    """Codes of residuals to ``nlist`` k-means centroids, searched in the ``nprobe`` nearest lists.

    Parameters
    ----------
    codec: any tqvec codec; it encodes the residuals x - c (no training of its own).
    nlist: number of inverted lists (k-means centroids); ``train`` needs at least that many rows.
    metric, refine, k_factor: as in ``FlatIndex``.
    nprobe: lists searched per query (attribute, may be changed between searches).
    seed, niter: of the k-means training.
    """

    def __init__(self, codec: Codec, nlist: int, metric: Any = "ip", *,
                 refine: Codec | str | None = None, k_factor: int = 4, nprobe: int = 1,
                 seed: int = 0, niter: int = 20, device: Any = None):
        self.nlist = V.positive_int(nlist, "nlist", 1, _MAX_NLIST)
        self.seed = V.seed(seed)
        self.niter = V.positive_int(niter, "niter", 1, _MAX_NITER)
        super().__init__(codec, metric, refine=refine, k_factor=k_factor, device=device)
        if self.device.type != "cpu":
            raise ValueError(f"device must be 'cpu' for an IVF index (the GPU IVF scan is not "
                             f"built yet), got {device!r}")
        self.nprobe = nprobe
        self.centroids = None
        self.is_trained = False

    @property
    def nprobe(self) -> int:
        return self._nprobe

    @nprobe.setter
    def nprobe(self, value: int) -> None:
        self._nprobe = V.positive_int(value, "nprobe", 1, _MAX_NLIST)

    def reset(self) -> None:
        """Remove every vector; the trained centroids stay (as in faiss)."""
        super().reset()
        self._lists = torch.empty(0, dtype=torch.int64)   # list of each row, add order
        # -2 est<c, r> - N(r) (l2, cosine); <c, r> - est<c, r> (ip)
        self._rowterm = torch.empty(0, dtype=torch.float32)
        self._ivf: dict[str, Any] | None = None

    @property
    def centroids(self) -> torch.Tensor | None:
        """(nlist, d) float32 k-means centroids (None before ``train``)."""
        return self._centroids

    @centroids.setter
    def centroids(self, c: torch.Tensor | None) -> None:
        self._centroids = c
        # ||c||^2, needed by every L2/cosine probe (recomputing it cost ~100 us per query at
        # nlist 256, d 784: a third of a one-query search)
        self._centroid_sqn = None if c is None else (c * c).sum(1)
        self._prober = None if c is None else ops.IVFProbe(
            c, self._centroid_sqn, self.metric_type != METRIC_INNER_PRODUCT)

    # -- training and adding --------------------------------------------------------------------
    def train(self, x: Any) -> None:
        """k-means on x (n >= nlist rows; normalized first for cosine) -> ``centroids``."""
        t, _ = V.float_matrix(x, "x", self.d, allow_empty=False)
        if self._n:
            raise ValueError(f"index must be empty to be trained again, got ntotal={self._n} "
                             "(call reset() first)")
        if t.shape[0] < self.nlist:
            raise ValueError(f"x must have at least nlist={self.nlist} rows to train, got "
                             f"{t.shape[0]}")
        try:
            import faiss
        except ImportError as e:  # pragma: no cover - faiss is a core dependency
            raise ImportError("IVFIndex.train needs faiss: pip install faiss-cpu") from e
        xt = t.to(torch.float32)
        if self.metric_type == METRIC_COSINE:
            xt = _normalized(xt)
        km = faiss.Kmeans(self.d, self.nlist, niter=self.niter, seed=self.seed % (1 << 31),
                          verbose=False)
        km.train(np.ascontiguousarray(xt.numpy()))
        self.centroids = torch.from_numpy(np.array(km.centroids, dtype=np.float32))
        self.is_trained = True

    def _assign(self, x: torch.Tensor) -> torch.Tensor:
        """Nearest centroid (L2) of each row: the residual it leaves is the smallest."""
        c, cn = self.centroids, self._centroid_sqn
        out = torch.empty(x.shape[0], dtype=torch.int64)
        for s in range(0, x.shape[0], _ASSIGN_BLOCK):
            xb = x[s:s + _ASSIGN_BLOCK]
            out[s:s + xb.shape[0]] = torch.argmin(cn[None, :] - 2 * xb @ c.T, dim=1)
        return out

    @property
    def _corrects_ip(self) -> bool:
        """An inner-product IVF index stores a <c, r> - est<c, r> per row (module docstring)."""
        return self.metric_type == METRIC_INNER_PRODUCT

    def _row_terms(self, lists: torch.Tensor, codes: Codes,
                   resid: torch.Tensor | None = None) -> torch.Tensor:
        """-2 est<c_l, r> - N(r) per row (l2, cosine); for inner product a <c_l, r> -
        est<c_l, r> from the residuals ``resid`` (None: zeros, est<q, r> alone)."""
        out = torch.zeros(len(codes), dtype=torch.float32)
        ip = self.metric_type == METRIC_INNER_PRODUCT
        if len(codes) == 0 or (ip and resid is None):
            return out
        est = torch.zeros(len(codes), dtype=torch.float32)  # est<c_l, r> per row
        order = torch.argsort(lists, stable=True)
        bounds = torch.searchsorted(lists[order], torch.arange(self.nlist + 1))
        for li in torch.nonzero(bounds[1:] > bounds[:-1])[:, 0].tolist():
            rows = order[bounds[li]:bounds[li + 1]]
            est[rows] = self.codec.score(self.centroids[li:li + 1], codes[rows])[0].cpu()
        if ip:
            return ip_row_correction(self.codec, codes, resid.to(torch.float32).cpu(),
                                     self.centroids[lists], est, None)
        return -self._sqnorms_of(self.codec, codes).cpu() - 2 * est

    def _append(self, t: torch.Tensor, ids: torch.Tensor) -> None:
        if not self.is_trained:
            raise ValueError("the IVF index must be trained before add: call "
                             "index.train(x) first (is_trained is False)")
        super()._append(t, ids)

    def _encode(self, t: torch.Tensor) -> tuple[Codes, Any, dict[str, torch.Tensor]]:
        x = t.to(torch.float32)
        if self.metric_type == METRIC_COSINE:
            x = _normalized(x)
        lists = self._assign(x)
        c = self.centroids[lists]
        codes = self.codec.encode(x - c)
        ref = None
        if self.refine == "flat":
            ref = t.to(torch.float32).clone()
        elif isinstance(self.refine, Codec):
            ref = self.refine.encode(x)
        resid = x - c if self._corrects_ip else None
        return codes, ref, {"_lists": lists, "_rowterm": self._row_terms(lists, codes, resid)}

    def _invalidate(self) -> None:
        super()._invalidate()
        self._ivf = None

    def _keep_rows(self, keep: torch.Tensor) -> None:
        self._lists = self._lists[keep]
        self._rowterm = self._rowterm[keep]

    def reconstruct(self, key: int) -> np.ndarray:
        """Centroid + decoded residual of the vector with id ``key`` (normalized for cosine)."""
        p = self._position(key)
        return self.reconstruct_n(p, 1)[0]

    def reconstruct_n(self, i0: int, n: int) -> np.ndarray:
        i0, n = self._positions(i0, n)
        r = self.codec.decode(self._codes[i0:i0 + n])
        return (self.centroids[self._lists[i0:i0 + n]] + r.cpu()).numpy()

    @property
    def imbalance_factor(self) -> float:
        """nlist * sum(size^2) / n^2 (faiss's measure; 1 = perfectly balanced lists)."""
        if self._n == 0:
            return 1.0
        sizes = torch.bincount(self._lists, minlength=self.nlist).double()
        return float(self.nlist * (sizes * sizes).sum() / self._n ** 2)

    def _set_prefilter(self, value: int) -> None:
        if value:
            raise ValueError(f"prefilter must be 0 for an IVF index (its probed lists are "
                             f"scanned in full), got {value!r}")
        FlatIndex.prefilter.fset(self, value)

    prefilter = property(FlatIndex.prefilter.fget, _set_prefilter)

    # -- search -------------------------------------------------------------------------------
    def _fast_ok(self) -> bool:  # residual TurboQuant-mse codes only (ops.ivf_fast_scan)
        return self._lut_ok() and self._fast_scan_ok()

    def _ivf_state(self) -> dict[str, Any]:
        """List-major layout of the rows (call with the lock held), built once per change."""
        if self._ivf is not None:
            return self._ivf
        n = self._n
        order = torch.argsort(self._lists, stable=True)
        sizes = torch.bincount(self._lists, minlength=self.nlist)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
        st: dict[str, Any] = {"order": order, "starts": starts}
        if self._fast_ok() and n:
            w = 1.0 if self.metric_type == METRIC_INNER_PRODUCT else 2.0
            packed, _, bits, cents, nrm = self.codec.lut_terms(self._codes)[0]
            mult = w * nrm.cpu()
            blocks = (sizes + _ROWS - 1) // _ROWS
            list_blocks = torch.cat([torch.zeros(1, dtype=torch.int64), blocks.cumsum(0)])
            # padded row p holds add-order position pos[p] (-1: padding)
            rank = torch.arange(n) - starts[self._lists[order]]
            padded = list_blocks[self._lists[order]] * _ROWS + rank
            pos = torch.full((int(list_blocks[-1]) * _ROWS,), -1, dtype=torch.int64)
            pos[padded] = order
            valid = pos >= 0
            src = pos.clamp_min(0)
            payload = packed[src]
            payload[~valid] = 0
            add = torch.where(valid, self._rowterm[src], torch.full((), -float("inf")))
            st.update(pos=pos, pos_np=pos.numpy(), add=add, scanner=ops.IVFFastScan(
                ops.block_codes(payload, self.d, bits), cents,
                torch.where(valid, mult[src], torch.zeros(())), add, list_blocks, bits,
                self.codec.backend))
            rotate = self.codec.query_rotation()
            lut = self._refine_lut_state()  # a TurboQuant-mse refinement's tables, or None
            ref_codes = None if lut is None else (
                self.refine.query_rotation(), lut["packed"], lut["bits"], lut["cents"],
                lut["mult"], lut["add"])
            if rotate is not None and (self.refine in (None, "flat") or ref_codes is not None):
                st["one_call"] = IVFSearch.prepare(
                    self._prober, rotate, st["scanner"], st["pos_np"], self._ids.numpy(),
                    self._ref if self.refine == "flat" else None, metric_name(self.metric_type),
                    ref_codes=ref_codes)
        self._ivf = st
        return st

    def _snapshot(self) -> dict[str, Any]:
        snap = super()._snapshot()
        snap["scan"] = None  # the flat LUT state is not used here
        snap.update(lists=self._lists, rowterm=self._rowterm, ivf=self._ivf_state(),
                    prober=self._prober, nprobe=self._nprobe)
        return snap

    def _scan_state(self):  # the flat index's per-row state does not apply to residual codes
        return None

    def _probe(self, q: np.ndarray, snap: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """(probes (nq, P) int64, offsets (nq, P) float32), best first: the nearest lists and the
        exact centroid part of each score (-||q - c||^2 for l2/cosine, <q, c> for ip), by
        ``ops.IVFProbe`` — the one probe of every search path, so that they agree bit for bit.
        Its kernel runs on the threads the scan uses next: torch's GEMM (3 ms for 1,000 queries
        against 5.5 for the kernel) left its OpenMP threads spinning through the scan that
        followed, and batch search was 10 % slower with it; numpy's BLAS threads did the same."""
        return snap["prober"].probe(q, min(snap["nprobe"], self.nlist))

    def _to_metric(self, s):  # torch or float32 numpy
        # cosine is ranked by the l2 estimate on unit vectors; report 1 - d^2 / 2
        return 1.0 + 0.5 * s if self.metric_type == METRIC_COSINE else s

    def _search_block(self, q: torch.Tensor, snap: dict[str, Any], mask: torch.Tensor | None,
                      kk: int, nq_total: int) -> tuple[torch.Tensor, torch.Tensor]:
        qn = q.numpy()
        probes, offsets = self._probe(qn, snap)
        st = snap["ivf"]
        if "scanner" in st:
            add = None
            if mask is not None:
                add = st["add"].masked_fill(~mask[st["pos"].clamp_min(0)], -float("inf"))
            vals, pos = self._scan_lists(qn, st, probes, offsets, kk, add)
            return torch.from_numpy(vals), torch.from_numpy(pos)
        return self._list_search(q, snap, torch.from_numpy(probes), torch.from_numpy(offsets),
                                 mask, kk)

    def _scan_lists(self, q: np.ndarray, st: dict[str, Any], probes: np.ndarray,
                    offsets: np.ndarray, kk: int, add: torch.Tensor | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """The fast scan of the probed lists: best kk (similarities in the metric's sense, add
        positions; -1 / -inf where a query has fewer). With a refinement, which re-ranks them
        anyway, by the kernel's 8-bit tables alone (faiss's IVF fast-scan does the same): the
        exact re-score of 1-bit candidates cost 2.4x the scan at kk = 40."""
        qr = self.codec.query_terms(torch.from_numpy(q))[0].numpy()
        vals, padded = st["scanner"].search(qr, probes, offsets, kk, add,
                                            approx=self.refine is not None)
        pos = np.where(padded >= 0, st["pos_np"][np.maximum(padded, 0)], padded)
        return self._to_metric(vals), pos

    def _search_fast_numpy(self, x: Any, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``search``'s result, bit for bit, for float32 numpy queries on the CPU fast scan
        without a filter, in few Python steps (the flat index's idea: at one query, Fashion-MNIST
        nprobe 4, the general path's tensor steps cost ten times the 20 us kernel); None where
        it does not apply."""
        if not (type(x) is np.ndarray and x.dtype == np.float32 and x.ndim == 2
                and 0 < x.shape[0] <= _QUERY_BLOCK and x.shape[1] == self.d
                and self.is_trained):
            return None
        with self._lock:  # the one-call search reads four fields, not the whole snapshot
            n, st, nprobe, has_ref = self._n, self._ivf_state(), self._nprobe, self._ref is not None
            one = st.get("one_call")
            snap = self._snapshot() if one is None else None
        if n == 0 or "scanner" not in st:
            return None
        # the compiled search checks its queries itself (None: the general path reports them)
        if (one is None or self.metric_type == METRIC_COSINE) and not np.isfinite(x).all():
            return None
        q = np.ascontiguousarray(x)
        if self.metric_type == METRIC_COSINE:
            q = _unit_rows(q)
        kk = min(n, k * self.k_factor if has_ref else k)
        if one is not None:
            return one.search(q, min(nprobe, self.nlist), kk, k)
        probes, offsets = self._probe(q, snap)
        vals, pos = self._scan_lists(q, st, probes, offsets, kk)
        if snap["ref"] is not None:
            vals, pos = self._rerank_np(torch.from_numpy(q), vals, pos, snap, k)
        if self.metric_type == METRIC_L2:
            vals = -vals
        return self._results(vals, pos, snap["ids"].numpy(), k)

    def _per_list_scores(self, q: torch.Tensor, snap: dict[str, Any], probes: torch.Tensor,
                         offsets: torch.Tensor):
        """For each probed, non-empty list: (its rows, the queries probing it, their (nq_l,
        n_l) similarities before ``_to_metric``), scored by the codec."""
        order, starts = snap["ivf"]["order"], snap["ivf"]["starts"]
        w = 1.0 if self.metric_type == METRIC_INNER_PRODUCT else 2.0
        for li in torch.unique(probes).tolist():
            rows = order[starts[li]:starts[li + 1]]
            if rows.numel() == 0:
                continue
            hit = probes == li
            qsel = hit.any(1).nonzero()[:, 0]
            s = (w * self.codec.score(q[qsel], snap["codes"][rows])
                 + snap["rowterm"][rows][None, :] + (offsets * hit).sum(1)[qsel, None])
            yield rows, qsel, s

    def _list_search(self, q: torch.Tensor, snap: dict[str, Any], probes: torch.Tensor,
                     offsets: torch.Tensor, mask: torch.Tensor | None, kk: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Any codec: each probed list scored with the codec for the queries that probe it."""
        nq = q.shape[0]
        best_s = torch.full((nq, kk), -float("inf"))
        best_p = torch.full((nq, kk), -1, dtype=torch.int64)
        for rows, qsel, s in self._per_list_scores(q, snap, probes, offsets):
            if mask is not None:
                s = s.masked_fill(~mask[rows][None, :], -float("inf"))
            s = torch.cat([best_s[qsel], s], dim=1)
            p = torch.cat([best_p[qsel], rows.expand(qsel.numel(), -1)], dim=1)
            top = torch.topk(s, kk, dim=1)
            best_s[qsel], best_p[qsel] = top.values, torch.gather(p, 1, top.indices)
        best_p = torch.where(torch.isfinite(best_s), best_p, torch.full_like(best_p, -1))
        return self._to_metric(best_s), best_p

    def range_search(self, x: Any, radius: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Results within ``radius`` among the ``nprobe`` probed lists (faiss's IVF semantics):
        L2 distance < radius, or similarity > radius."""
        if not self.is_trained:
            raise ValueError("index must be trained before range_search: call index.train(x) "
                             "first (is_trained is False)")
        radius = V.finite_float(radius, "radius")
        self.check_mapped()
        q, _ = self._prepare(x)
        with self._lock:
            snap = self._snapshot()
        nq = q.shape[0]
        per_query: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(nq)]
        if snap["n"] and nq:
            probes, offsets = map(torch.from_numpy, self._probe(q.numpy(), snap))
            ids = snap["ids"]
            for rows, qsel, s in self._per_list_scores(q, snap, probes, offsets):
                s = self._to_metric(s)
                if self.metric_type == METRIC_L2:
                    s = -s
                    inside = s < radius
                else:
                    inside = s > radius
                for a, qi in enumerate(qsel.tolist()):
                    sel = inside[a].nonzero()[:, 0]
                    if sel.numel():
                        per_query[qi].append((s[a, sel].numpy(), ids[rows[sel]].numpy()))
        lims = np.zeros(nq + 1, dtype=np.int64)
        for i, parts in enumerate(per_query):
            lims[i + 1] = lims[i] + sum(len(dd) for dd, _ in parts)
        D = np.concatenate([dd for parts in per_query for dd, _ in parts]).astype(np.float32) \
            if lims[-1] else np.zeros(0, np.float32)
        I = np.concatenate([ii for parts in per_query for _, ii in parts]) \
            if lims[-1] else np.zeros(0, np.int64)
        return lims, D, I

    def __repr__(self) -> str:
        ref = f", refine={self.refine!r}" if self.refine is not None else ""
        return (f"IVFIndex({self.codec!r}, nlist={self.nlist}, "
                f"metric={metric_name(self.metric_type)!r}{ref}, nprobe={self._nprobe}, "
                f"ntotal={self._n})")
