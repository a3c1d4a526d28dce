"""Inverted-file search over tqvec codes of residuals (IVF-ADC), with faiss's interface.

``IVFIndex`` trains: ``train(x)`` runs k-means (``faiss.Kmeans``) to get ``nlist`` centroids.
``add`` assigns each vector to its nearest centroid c and encodes the residual r = x - c with
the (still data-oblivious) codec; ``search`` scores only the ``nprobe`` lists whose centroids are
closest to the query (faiss's ``nprobe``, default 1).

Because r is smaller than x, the codec's error, proportional to the norm it encodes, shrinks with
it. Scores are the flat index's estimators with the centroid part computed exactly (Jegou et al.
2011, IVF-ADC):

* ``ip``: <q, c> + a <c, r> + est<q - c, r> (RaBitQ's estimator, as the flat index's centred
  inner product: only <q - c, r> comes from the codes; <c, r> is exact, stored per row, with the
  estimator's scale a; see ``flat``'s module docstring);
* ``l2``: ||q - c||^2 - 2 est<q, r> + 2 est<c, r> + N(r), i.e. the distance to the reconstruction
  c + r_hat for the biased mse codes (N = ||r_hat||^2) and an unbiased estimate for the unbiased
  ones (N = ||r||^2), the same pairing as the flat index;
* ``cosine``: vectors and queries are normalized, ranked by the ``l2`` estimate and reported as
  cosine = 1 - d^2 / 2 (on the unit sphere the two orders agree).

The row term -2 est<c, r> - N(r) (l2; the codes hold it) or a <c, r> - est<c, r> (ip; 4 bytes per
vector, as the estimators are linear in the query) is computed once at add time, so a query's
score of row j in list l is ``w est<q, r_j> + row_j + offset(q, l)`` with offset = -||q - c_l||^2
(l2) or <q, c_l> (ip). The index is rows (``rows.Rows``, add order, each with its list number
and row term), the trained centroids with their probe (``ops.IVFProbe``) and a scan of the
probed lists: TurboQuant-mse codes at 1-4 bits on the CPU by ``ops.IVFFastScan`` over a
list-major blocked copy (built at the first search after a change), every other codec by the
codec's own scorer list by list. Float32 numpy queries without a filter may run the whole search
as one compiled call (``fused.IVFSearch``; same results). Filtered search (``allowed_ids``) only
sees the probed lists, as in faiss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import _validate as V
from .. import ops
from ..codecs.base import Codec, Codes
from .base import CodesIndex
from .fused import IVFSearch
from .metrics import (
    METRIC_COSINE,
    METRIC_INNER_PRODUCT,
    device_of,
    metric_name,
    normalized,
    one_call_queries,
    unit_rows,
)
from .rerank import RefineLut
from .rows import Rows
from .rowterms import ip_row_correction, sqnorms_of
from .scan import rows_from_blocked
from .state import (
    StoredKind,
    float_rows,
    no_center_or_prefilter,
    register_kind,
    row_correction,
    rows_state,
)

__all__ = ["IVFIndex"]

_ROWS = 32  # rows per fast-scan block: every list starts on a block boundary
_ASSIGN_BLOCK = 16384
_MAX_NLIST = 1 << 24
_MAX_NITER = 1 << 20


@dataclass
class IVFScan:
    """The lists' layout for one state of the rows: ``order`` (rows by list, add order within a
    list) and ``starts`` (nlist + 1 offsets into it); on the CPU fast-scan kernels also the
    list-major blocked codes in ``scanner``, ``pos`` (padded row -> add-order position, -1 for
    padding) and the row offsets ``add``, and where it applies the one compiled call."""

    order: torch.Tensor
    starts: torch.Tensor
    scanner: ops.IVFFastScan | None = None
    pos: np.ndarray | None = None
    add: torch.Tensor | None = None
    fused: IVFSearch | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ListPayload:
    """The row-major payload of rows held in the list-major fast-scan layout (``Rows.release``):
    row i (add order) is padded row ``slots[i]`` of ``blocked``."""

    blocked: torch.Tensor
    slots: torch.Tensor
    d: int
    b: int

    def payload(self, i0: int, i1: int) -> torch.Tensor:
        return rows_from_blocked(self.blocked, self.slots[i0:i1], self.d, self.b)


@dataclass(frozen=True)
class IVFSnapshot:
    """What an IVF search reads, taken together under the lock."""

    rows: Rows
    scan: IVFScan
    ref_lut: RefineLut | None
    probe: ops.IVFProbe | None
    nprobe: int

    @property
    def n(self) -> int:
        return self.rows.n


class IVFIndex(CodesIndex):
    """Codes of residuals to ``nlist`` k-means centroids, searched in the ``nprobe`` nearest lists.

    Parameters
    ----------
    codec: any tqvec codec; it encodes the residuals x - c (no training of its own).
    nlist: number of inverted lists (k-means centroids); ``train`` needs at least that many rows.
    metric, refine, k_factor: as in ``FlatIndex``.
    nprobe: lists searched per query (attribute, may be changed between searches).
    seed, niter: of the k-means training.
    """

    def __init__(self, codec: Codec, nlist: int, metric: Any = "l2", *,
                 refine: Codec | str | None = None, k_factor: int = 4, nprobe: int = 1,
                 seed: int = 0, niter: int = 20, device: Any = None):
        self._init_rows(codec, metric, refine, k_factor)
        self.nlist = V.positive_int(nlist, "nlist", 1, _MAX_NLIST)
        self.seed = V.seed(seed)
        self.niter = V.positive_int(niter, "niter", 1, _MAX_NITER)
        self.device = device_of(device)
        if self.device.type != "cpu":
            raise ValueError(f"device must be 'cpu' for an IVF index (the GPU IVF scan is not "
                             f"built yet), got {device!r}")
        self._scoring = self.metric_type
        self.nprobe = nprobe
        self.centroids = None
        self.is_trained = False
        self._invalidate()

    @property
    def nprobe(self) -> int:
        return self._nprobe

    @nprobe.setter
    def nprobe(self, value: int) -> None:
        value = V.positive_int(value, "nprobe", 1, _MAX_NLIST)
        with self._lock:  # not between a snapshot's making and its storing (``_current``)
            self._nprobe = value
            self._snap = None  # the snapshot holds nprobe

    @property
    def prefilter(self) -> int:
        """0: the probed lists are scanned in full (an IVF index has no first pass)."""
        return 0

    @prefilter.setter
    def prefilter(self, value: int) -> None:
        if V.positive_int(value, "prefilter", 0, V.MAX_CANDIDATE_FACTOR):
            raise ValueError(f"prefilter must be 0 for an IVF index (its probed lists are "
                             f"scanned in full), got {value!r}")

    @property
    def code_size(self) -> int:
        """Bytes stored per vector (codes + the inner product's row term + refinement)."""
        extra = 4 if self._corrects_ip else 0
        if self.refine == "flat":
            extra += 4 * self.d
        elif isinstance(self.refine, Codec):
            extra += self.refine.code_size
        return self.codec.code_size + extra

    @property
    def _corrects_ip(self) -> bool:
        """An inner-product IVF index stores a <c, r> - est<c, r> per row (module docstring)."""
        return self.metric_type == METRIC_INNER_PRODUCT

    @property
    def centroids(self) -> torch.Tensor | None:
        """(nlist, d) float32 k-means centroids (None before ``train``)."""
        return self._centroids

    @centroids.setter
    def centroids(self, c: torch.Tensor | None) -> None:
        self._centroids = c
        # ||c||^2, needed by every L2/cosine probe (recomputed per query it was a third of a
        # one-query search)
        self._centroid_sqn = None if c is None else (c * c).sum(1)
        self._probe = None if c is None else ops.IVFProbe(
            c, self._centroid_sqn, self.metric_type != METRIC_INNER_PRODUCT)
        with self._lock:
            self._invalidate()

    @property
    def assignments(self) -> np.ndarray:
        """(ntotal,) int64: the list of each stored vector, in add order."""
        return self._rows.term("lists").numpy().astype(np.int64, copy=True)

    @property
    def imbalance_factor(self) -> float:
        """nlist * sum(size^2) / n^2 (faiss's measure; 1 = perfectly balanced lists)."""
        if self._rows.n == 0:
            return 1.0
        sizes = torch.bincount(self._rows.term("lists"), minlength=self.nlist).double()
        return float(self.nlist * (sizes * sizes).sum() / self._rows.n ** 2)

    # -- training and adding --------------------------------------------------------------------
    def train(self, x: Any) -> None:
        """k-means on x (n >= nlist rows; normalized first for cosine) -> ``centroids``."""
        t, _ = V.float_matrix(x, "x", self.d, allow_empty=False)
        if self._rows.n:
            raise ValueError(f"index must be empty to be trained again, got ntotal="
                             f"{self._rows.n} (call reset() first)")
        if t.shape[0] < self.nlist:
            raise ValueError(f"x must have at least nlist={self.nlist} rows to train, got "
                             f"{t.shape[0]}")
        try:
            import faiss
        except ImportError as e:  # pragma: no cover - faiss is a core dependency
            raise ImportError("IVFIndex.train needs faiss: pip install faiss-cpu") from e
        xt = t.to(torch.float32)
        if self.metric_type == METRIC_COSINE:
            xt = normalized(xt)
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

    def row_terms(self, lists: torch.Tensor, codes: Codes,
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
        return -sqnorms_of(self.codec, codes, self._scoring, self.device).cpu() - 2 * est

    def _encode(self, t: torch.Tensor) -> tuple[Codes, Any, dict[str, torch.Tensor]]:
        x = t.to(torch.float32)
        if self.metric_type == METRIC_COSINE:
            x = normalized(x)
        lists = self._assign(x)
        c = self.centroids[lists]
        codes = self.codec.encode(x - c)
        ref = None
        if self.refine == "flat":
            ref = t.to(torch.float32).clone()
        elif isinstance(self.refine, Codec):
            ref = self.refine.encode(x)
        resid = x - c if self._corrects_ip else None
        return codes, ref, {"lists": lists, "rowterm": self.row_terms(lists, codes, resid)}

    def to_faiss(self, **_: Any) -> Any:
        raise ValueError("to_faiss() exports flat indexes only: an IVF index holds codes of "
                         "residuals x - c, which are not unit vectors, and faiss's SQtqmse "
                         "stores no norm")

    def reconstruct_n(self, i0: int, n: int) -> np.ndarray:
        """Centroid + decoded residual of the vectors at positions i0 .. i0+n-1 (normalized
        for cosine) -> (n, d) float32."""
        i0, n = self._positions(i0, n)
        r = self.codec.decode(self._rows.codes_rows(i0, i0 + n))
        return (self.centroids[self._rows.term("lists")[i0:i0 + n]] + r.cpu()).numpy()

    # -- state (files) -----------------------------------------------------------------------
    @property
    def scoring(self) -> int:
        return self._scoring

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(meta, arrays): everything the index holds, as ``tqvec.index.io`` writes it."""
        with self._lock:
            rows = self._rows.snapshot()
        # an IVF index has no first pass or centre: its files say so as flat ones do
        meta, arrays = rows_state(self, rows, "ivf", prefilter=0, centered=False,
                                  nlist=self.nlist, nprobe=self.nprobe, seed=self.seed,
                                  niter=self.niter, trained=self.is_trained)
        if self.is_trained:
            arrays["ivf.centroids"] = self.centroids.numpy()
            arrays["ivf.lists"] = rows.term("lists").numpy().astype(np.int64)
            if self.metric_type == METRIC_INNER_PRODUCT:  # a <c, r> - est<c, r>: from x
                arrays["ivf.rowterm"] = rows.term("rowterm").numpy()
        return meta, arrays

    def install_rows(self, rows: Rows, mapped: Any = None) -> None:
        """Take over stored rows (``index_from_state``; ``mapped``: the file they read)."""
        with self._lock:
            self._rows = rows
            self._mapped = mapped
            self._invalidate()

    # -- search -------------------------------------------------------------------------------
    def _invalidate(self) -> None:
        super()._invalidate()
        self._scan: IVFScan | None = None

    def _fast_ok(self) -> bool:
        """Residual codes of one rotated-domain term (``Codec.kernel_form``: TurboQuant-mse)
        at 1-4 bits on the CPU kernels (ops.IVFFastScan)."""
        form = self.codec.kernel_form()
        return (form is not None and form.bits in ops.FAST_SCAN_BITS
                and self.codec.backend in ("auto", "cpu") and ops.has_cpu_kernels())

    def _scan_state(self) -> IVFScan:
        """List-major layout of the rows (call with the lock held), built once per change."""
        if self._scan is not None:
            return self._scan
        rows, n = self._rows, self._rows.n
        lists = rows.term("lists").to(torch.int64)
        order = torch.argsort(lists, stable=True)
        sizes = torch.bincount(lists, minlength=self.nlist)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
        st = IVFScan(order, starts)
        if self._fast_ok() and n:
            w = 1.0 if self.metric_type == METRIC_INNER_PRODUCT else 2.0
            term = self.codec.lut_terms(rows.codes)[0]  # (rebuilt from the old layout if held)
            mult = w * term.scale.cpu()
            blocks = (sizes + _ROWS - 1) // _ROWS
            list_blocks = torch.cat([torch.zeros(1, dtype=torch.int64), blocks.cumsum(0)])
            # padded row p holds add-order position pos[p] (-1: padding)
            rank = torch.arange(n) - starts[lists[order]]
            padded_rows = list_blocks[lists[order]] * _ROWS + rank
            pos = torch.full((int(list_blocks[-1]) * _ROWS,), -1, dtype=torch.int64)
            pos[padded_rows] = order
            valid = pos >= 0
            src = pos.clamp_min(0)
            payload = term.packed[src]
            payload[~valid] = 0
            add = torch.where(valid, rows.term("rowterm")[src], torch.full((), -float("inf")))
            st.pos, st.add = pos.numpy(), add
            blocked = ops.block_codes(payload, self.d, term.bits)
            st.scanner = ops.IVFFastScan(
                blocked, term.centroids, torch.where(valid, mult[src], torch.zeros(())), add,
                list_blocks, term.bits, self.codec.backend)
            st.fused = self._fused(st)
            # the codes are held once: the list-major layout serves them (one term: the payload)
            slots = torch.empty(n, dtype=torch.int64)
            slots[order] = padded_rows
            rows.release(ListPayload(blocked, slots, self.d, term.bits))
        self._scan = st
        return st

    def _fused(self, st: IVFScan) -> IVFSearch | None:
        """The whole search as one compiled call (Hadamard-rotated codes; no refinement, exact
        vectors or TurboQuant-mse refinement codes)."""
        rotate = self.codec.query_rotation()
        lut = self._refine_lut()
        ref_codes = None if lut is None else (self.refine.query_rotation(), lut.packed, lut.bits,
                                              lut.cents, lut.mult, lut.add)
        if rotate is None or not (self.refine in (None, "flat") or ref_codes is not None):
            return None
        return IVFSearch.prepare(self._probe, rotate, st.scanner, st.pos, self._rows.ids.numpy(),
                                 self._rows.ref if self.refine == "flat" else None,
                                 metric_name(self.metric_type), ref_codes=ref_codes)

    def _snapshot(self) -> IVFSnapshot:
        scan = self._scan_state()  # first: it may release the row-major codes (flat's reason)
        return IVFSnapshot(self._rows.snapshot(), scan, self._refine_lut(), self._probe,
                           self._nprobe)

    def _route(self, snap: IVFSnapshot) -> str:
        """The scan a search runs, chosen here only: ``"fast"`` (the CPU kernel over the
        blocked lists) or ``"lists"`` (the codec's scorer, list by list)."""
        return "fast" if snap.scan.scanner is not None else "lists"

    def _queries(self, x: Any) -> tuple[torch.Tensor, None]:
        q = V.query_rows(x, "x", self.d, self.device)
        if self.metric_type == METRIC_COSINE:
            q = torch.from_numpy(unit_rows(q.numpy()))
        return q, None

    def _fused_search(self, x: Any, snap: IVFSnapshot, k: int
                      ) -> tuple[np.ndarray, np.ndarray] | None:
        """float32 numpy queries (one block) on a trained, non-empty index with the compiled
        call; the call checks its queries for NaN and Inf itself (cosine: normalized here)."""
        if not (one_call_queries(x, self.d) and snap.n and snap.scan.fused is not None):
            return None
        q = np.ascontiguousarray(x)
        if self.metric_type == METRIC_COSINE:
            if not V.norms_fit(x):
                return None
            q = unit_rows(q)
        return snap.scan.fused.search(q, min(snap.nprobe, self.nlist),
                                      self._candidates(snap.n, k), k)

    def _fused_candidates(self, q: torch.Tensor, snap: IVFSnapshot, kk: int, probes: Any
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        if not (snap.n and snap.scan.fused is not None and q.device.type == "cpu"):
            return None
        return snap.scan.fused.candidates(np.ascontiguousarray(q.numpy(), np.float32),
                                          min(snap.nprobe, self.nlist), kk, probes)

    def probe(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """The lists a search of the queries x probes, best first, (nq, min(nprobe, nlist))
        int64, and the exact centroid part of each score (float32): what
        ``search_candidates(..., probes=)`` takes, so that the shards of one IVF index (same
        centroids) probe once, at their coordinator (faiss's ``IndexShardsIVF``)."""
        self._check_ready("probe")
        q, _ = self._queries(x)
        return self._probes(q.numpy(), self._current())

    def _checked_probes(self, probes: Any, nq: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``probes`` as ``probe`` returns them, checked for nq queries: (lists, offsets), both
        (nq, P) with P >= 1, lists int64 in 0..nlist-1 with no list twice in a row, offsets
        finite float32 (a list out of range was skipped by one route and wrapped to another
        list by the other)."""
        if probes is None:
            return None
        if not (isinstance(probes, tuple) and len(probes) == 2):
            raise ValueError(f"probes must be the (lists, offsets) pair probe(x) returns, got "
                             f"{type(probes).__name__}")
        lists, offsets = (np.asarray(p) for p in probes)
        if lists.dtype != np.int64 or lists.ndim != 2 or lists.shape[0] != nq or (
                lists.shape[1] == 0):
            raise ValueError(f"probes[0] (lists) must be int64 of shape ({nq}, P), P >= 1, got "
                             f"{lists.dtype} of shape {lists.shape}")
        if offsets.dtype != np.float32 or offsets.shape != lists.shape:
            raise ValueError(f"probes[1] (offsets) must be float32 of shape {lists.shape}, got "
                             f"{offsets.dtype} of shape {offsets.shape}")
        if lists.size and (int(lists.min()) < 0 or int(lists.max()) >= self.nlist):
            raise ValueError(f"probes[0] must hold list numbers in 0..{self.nlist - 1}, got "
                             f"{int(lists.min())}..{int(lists.max())}")
        srt = np.sort(lists, axis=1)
        if (srt[:, 1:] == srt[:, :-1]).any():
            raise ValueError("probes[0] must name each list at most once per query")
        if not np.isfinite(offsets).all():
            raise ValueError("probes[1] must be finite")
        return np.ascontiguousarray(lists), np.ascontiguousarray(offsets)

    def _probes(self, q: np.ndarray, snap: IVFSnapshot) -> tuple[np.ndarray, np.ndarray]:
        """(probes (nq, P) int64, offsets (nq, P) float32), best first: the nearest lists and the
        exact centroid part of each score (-||q - c||^2 for l2/cosine, <q, c> for ip), by
        ``ops.IVFProbe`` — the one probe of every search route, so that they agree bit for bit."""
        return snap.probe.probe(q, min(snap.nprobe, self.nlist))

    def _to_metric(self, s):  # torch or float32 numpy
        # cosine is ranked by the l2 estimate on unit vectors; report 1 - d^2 / 2
        return 1.0 + 0.5 * s if self.metric_type == METRIC_COSINE else s

    def _scan_block(self, q: torch.Tensor, snap: IVFSnapshot, mask: torch.Tensor | None,
                    kk: int, nq_total: int,
                    route: tuple[int, int] | None = None, probes: Any = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        qn = q.numpy()
        probes, offsets = self._probes(qn, snap) if probes is None else probes
        if self._route(snap) == "fast":
            st = snap.scan
            add = None
            if mask is not None:
                add = st.add.masked_fill(~mask[torch.from_numpy(st.pos).clamp_min(0)],
                                         -float("inf"))
            qr = self.codec.query_terms(q)[0].numpy()
            # with a refinement, which re-ranks them, by the kernel's 8-bit tables alone (faiss's
            # IVF fast-scan does the same)
            vals, padded_pos = st.scanner.search(qr, probes, offsets, kk, add,
                                                 approx=self.refine is not None)
            pos = np.where(padded_pos >= 0, st.pos[np.maximum(padded_pos, 0)], padded_pos)
            return self._to_metric(vals), pos
        vals, pos = self._list_scan(q, snap, torch.from_numpy(probes),
                                    torch.from_numpy(offsets), mask, kk)
        return vals.numpy(), pos.numpy()

    def _per_list_scores(self, q: torch.Tensor, snap: IVFSnapshot, probes: torch.Tensor,
                         offsets: torch.Tensor):
        """For each probed, non-empty list: (its rows, the queries probing it, their (nq_l,
        n_l) similarities before ``_to_metric``), scored by the codec."""
        order, starts, rows = snap.scan.order, snap.scan.starts, snap.rows
        w = 1.0 if self.metric_type == METRIC_INNER_PRODUCT else 2.0
        rowterm, codes = rows.term("rowterm"), rows.codes
        for li in torch.unique(probes).tolist():
            members = order[starts[li]:starts[li + 1]]
            if members.numel() == 0:
                continue
            hit = probes == li
            qsel = hit.any(1).nonzero()[:, 0]
            s = (w * self.codec.score(q[qsel], codes[members])
                 + rowterm[members][None, :] + (offsets * hit).sum(1)[qsel, None])
            yield members, qsel, s

    def _list_scan(self, q: torch.Tensor, snap: IVFSnapshot, probes: torch.Tensor,
                   offsets: torch.Tensor, mask: torch.Tensor | None, kk: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Any codec: each probed list scored with the codec for the queries that probe it."""
        nq = q.shape[0]
        best_s = torch.full((nq, kk), -float("inf"))
        best_p = torch.full((nq, kk), -1, dtype=torch.int64)
        for members, qsel, s in self._per_list_scores(q, snap, probes, offsets):
            if mask is not None:
                s = s.masked_fill(~mask[members][None, :], -float("inf"))
            s = torch.cat([best_s[qsel], s], dim=1)
            p = torch.cat([best_p[qsel], members.expand(qsel.numel(), -1)], dim=1)
            top = torch.topk(s, kk, dim=1)
            best_s[qsel], best_p[qsel] = top.values, torch.gather(p, 1, top.indices)
        best_p = torch.where(torch.isfinite(best_s), best_p, torch.full_like(best_p, -1))
        return self._to_metric(best_s), best_p

    def _range_scores(self, q: torch.Tensor, off: np.ndarray | None):
        """``range_search``'s scores among the ``nprobe`` probed lists (faiss's IVF semantics),
        list by list."""
        snap = self._current()
        if not (snap.n and q.shape[0]):
            return
        probes, offsets = map(torch.from_numpy, self._probes(q.numpy(), snap))
        ids = snap.rows.ids
        for members, qsel, s in self._per_list_scores(q, snap, probes, offsets):
            yield qsel, self._to_metric(s), ids[members]

    def __repr__(self) -> str:
        ref = f", refine={self.refine!r}" if self.refine is not None else ""
        return (f"IVFIndex({self.codec!r}, nlist={self.nlist}, "
                f"metric={metric_name(self.metric_type)!r}{ref}, nprobe={self._nprobe}, "
                f"ntotal={self._rows.n})")


# -- files: the IVF index's part of tqvec.index.state -------------------------------------------

def _empty_from_state(meta: dict, codec: Codec, refine: Any, arrays: dict) -> IVFIndex:
    no_center_or_prefilter(meta, "an IVF index")
    if not isinstance(meta["trained"], bool):
        raise TypeError(f"trained must be a bool, got {meta['trained']!r:.40}")
    index = IVFIndex(codec, meta["nlist"], meta["metric"], refine=refine,
                     k_factor=meta["k_factor"], nprobe=meta["nprobe"], seed=meta["seed"],
                     niter=meta["niter"])
    if meta["trained"]:
        index.centroids = float_rows(arrays, "ivf.centroids", (index.nlist, codec.dim)).clone()
        index.is_trained = True
    return index


def _arrays_in_state(meta: dict, ntotal: int) -> tuple[set[str], set[str]]:
    if not meta["trained"]:
        return set(), set()
    return {"ivf.centroids", *(("ivf.lists",) if ntotal else ())}, {
        "ivf.rowterm", *(() if ntotal else ("ivf.lists",))}


def _per_row_from_state(index: IVFIndex, arrays: dict, codes: Codes, ntotal: int
                        ) -> dict[str, torch.Tensor]:
    if not index.is_trained:
        raise ValueError(f"an untrained IVF index must be empty, got ntotal={ntotal}")
    lists = arrays["ivf.lists"]
    if lists.dtype != np.int64 or lists.shape != (ntotal,) or (
            int(lists.min()) < 0 or int(lists.max()) >= index.nlist):
        raise ValueError(f"ivf.lists must be {ntotal} int64 list numbers < {index.nlist}")
    lists = torch.from_numpy(lists)
    rowterm = (row_correction(arrays, ntotal, "ivf.rowterm")
               if index.metric_type == METRIC_INNER_PRODUCT else index.row_terms(lists, codes))
    return {"lists": lists, "rowterm": rowterm}


register_kind("ivf", StoredKind(
    IVFIndex, meta=frozenset({"nlist", "nprobe", "seed", "niter", "trained"}),
    not_per_row=frozenset({"ivf.centroids"}), empty=_empty_from_state, arrays=_arrays_in_state,
    per_row=_per_row_from_state))
