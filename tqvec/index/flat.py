"""Flat (exhaustive) search over tqvec codes, with faiss's interface and semantics.

``search(x, k) -> (D, I)``: D float32 (nq, k), I int64 (nq, k), best first; missing results are
I = -1 with D = -FLT_MAX (inner product, cosine) or +FLT_MAX (L2), exactly as faiss pads.
Distances by metric: ``ip`` the codec's asymmetric estimate of <q, x> (the query exact; the
biased mse codes that store ||x|| rescaled to the true norm, ||x|| <q, x_hat> / ||x_hat||);
``l2`` ||q||^2 - 2 est<q, x> + N(x) with N matched to the estimator (||x_hat||^2 for the biased
mse codes, the true ||x||^2 for unbiased ones); ``cosine`` est<q, x> / (||q|| sqrt(N(x))). A
centred index (``center``) codes y = x - mu: L2 is translation-invariant, and an inner product
is <q, mu> (exact per query) + <mu, y> (exact per row, stored as a per-row correction,
``rowterms.ip_row_correction``) + est<q - mu, y> (RaBitQ's estimator, Gao & Long 2024);
derivations and measurements: docs/search.md.

A search is one composition - prepare the queries (validate, unit rows for cosine, centre) -> scan
the codes for each query's best candidates -> re-rank them with the refinement -> ids and the
metric's distances - and its scan is one of three, chosen in one place (``_route``): the SIMD
fast-scan kernels over the codes' blocked layout (codes whose estimator is a sum of 1-4-bit terms,
on the CPU), per-query lookup tables over the packed codes (``ops.lut_scan``: TurboQuant-mse,
few queries or a GPU) or decoded blocks and a GEMM (any codec), each keeping a running top-k so
memory stays bounded. For float32 numpy queries the whole composition may run as one compiled
call (``fused.FlatSearch``; same float operations, same results). The blocked layout is built at
the first search after a change, under the index's lock, so concurrent ``search`` calls are
safe; ``add``/``remove_ids`` must not run concurrently with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import _validate as V
from .. import ops
from ..codecs.base import Codec, Codes
from ..ops import pages
from .base import CodesIndex
from .fused import FlatSearch, TermsSearch
from .metrics import (
    METRIC_COSINE,
    METRIC_INNER_PRODUCT,
    METRIC_L2,
    device_of,
    metric_code,
    metric_name,
    normalized,
    one_call_queries,
    results,
    row_mean,
    unit_rows,
)
from .rows import Rows
from .rowterms import ROW_BLOCK, ip_row_correction, sqnorms_of
from .scan import BlockedCodes, FlatScan, FlatSnapshot, metric_terms, sign_stage
from .state import StoredKind, float_rows, register_kind, row_correction, rows_state

__all__ = ["FlatIndex", "METRIC_INNER_PRODUCT", "METRIC_L2", "METRIC_COSINE", "metric_code",
           "metric_name"]

# Without the fast scan, up to this many queries take per-query lookup tables over the packed
# codes; above it, decoding blocks to floats and one GEMM per block is faster.
_LUT_MAX_QUERIES = 32
# Fewer rows per result: a prefilter or refinement re-scores most rows; per-query tables win.
_FAST_SCAN_ROWS_PER_RESULT = 64
_MAX_SIGMAS = 10.0  # a wider bound re-scores nearly every row: the exact scan is cheaper


class FlatIndex(CodesIndex):
    """Exhaustive search over codes of one codec, optionally re-ranked by a finer refinement.

    Parameters
    ----------
    codec: any tqvec codec (``TurboQuant``, ``QJL``, ``PolarQuant``).
    metric: ``"ip"``, ``"l2"``, ``"cosine"`` or faiss's METRIC_INNER_PRODUCT / METRIC_L2.
    refine: ``None``, another codec (finer codes) or ``"flat"`` (exact float32 vectors); search
        then takes ``k_factor * k`` candidates from the codes and re-ranks them with the refinement.
    k_factor: candidates per result for refinement (default 4, faiss's default is 1).
    prefilter: 0 (default: every row's full code is scored, the exact top-k of the estimator),
        or candidates per result of a first pass over the sign bits only (TurboQuant-mse codes,
        CPU): the top ``prefilter * k`` rows by their 1-bit score are re-scored with their full
        codes. That first pass reads b times fewer bytes. 1-bit codes have no coarser bit: their
        first pass is the codes of the first half of the (rotated) coordinates, half the bytes
        (``TurboQuant.sign_term``). Mixed-width codes (``MixedTurboQuant``, ``PCAIndex``) have
        a first pass over their leading runs instead (``Codec.first_pass_terms``). An
        attribute, like faiss's ``nprobe``: may change between searches.
    prefilter_sigmas: 0 (default), or the sign-bit first pass bounded by its error instead of
        a count (TurboQuant-mse at 2-4 bits, CPU; exclusive with ``prefilter``): every row whose
        first-pass estimate, widened by this many standard deviations of its error against the
        full codes (``Codec.sign_term_error``), can reach the k-th best is re-scored. The
        shortlist adapts to each query and to the data; ~3 misses about 0.1 % of the full
        codes' top k (``factory``'s ``Prefilter`` sets 3). An attribute too.
    center: ``None`` (default), ``"fit"`` or a (d,) vector mu: codes of x - mu instead of x (for
        cosine: of x / ||x|| - mu). A fit of one vector, so the index then needs ``train`` when
        ``"fit"`` (mu = the training rows' mean). The codec's error scales with the norm it
        codes, so on data far from the origin (pixels) it buys recall for no bytes per vector;
        on embeddings near the origin nothing. L2 distances are translation-invariant; inner
        products add <q, mu> exactly; cosine becomes the inner product of unit vectors (the
        reconstruction's norm is then not divided out).
    center_term: for inner products (and cosine) of a centred index, whether each row stores
        the exact <mu, x - mu> (4 bytes; default True) or the codes estimate it too: where
        the bytes are few (a 20-d vector's 14) four more bytes of codes are worth more than
        that term (``PCAIndex`` chooses by the expected error).
    device: where the codes live and are scanned (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
        On a GPU, adds encode with the CUDA kernels and searches run the CUDA LUT scan
        (TurboQuant-mse) or the codec's blocked GEMM; results come back as numpy, as in faiss.
        Ids, and exact vectors for ``Refine(Flat)``, stay in host memory.
    """

    def __init__(self, codec: Codec, metric: Any = "l2", *, refine: Codec | str | None = None,
                 k_factor: int = 4, prefilter: int = 0, prefilter_sigmas: float = 0.0,
                 center: Any = None, center_term: bool = True,
                 device: str | torch.device | None = None):
        self._init_rows(codec, metric, refine, k_factor)
        self.device = device_of(device)
        self.is_trained = True  # data-oblivious: nothing to train (unless center="fit")
        self._center: torch.Tensor | None = None
        self.centered = center is not None
        if not isinstance(center_term, bool):
            raise TypeError(f"center_term must be a bool, got {center_term!r:.40}")
        self.center_term = center_term
        self._fit_center = isinstance(center, str)
        if isinstance(center, str):
            if center != "fit":
                raise ValueError(f"center must be None, 'fit' or a ({self.d},) vector, got "
                                 f"{center!r}")
            self.is_trained = False
        elif center is not None:
            cv = center if isinstance(center, torch.Tensor) else torch.from_numpy(
                np.array(center, dtype=np.float32))
            c, _ = V.float_matrix(cv.reshape(1, -1), "center", self.d)
            self._center = c[0].to(device=self.device, dtype=torch.float32).contiguous()
        # the metric the codes are scored with: centred cosine is the inner product of unit
        # vectors (see ``center``)
        self._scoring = (METRIC_INNER_PRODUCT if self.centered and
                         self.metric_type == METRIC_COSINE else self.metric_type)
        self._prefilter, self._sigmas = 0, 0.0
        self._query_map: tuple[torch.Tensor, list[slice], torch.Tensor] | None = None
        self._layout = BlockedCodes()  # the codes' fast-scan layout, kept across appends
        self._invalidate()
        self.prefilter = prefilter
        self.prefilter_sigmas = prefilter_sigmas

    _train_hint = "center='fit' needs train(x) to fit its center"

    # -- parameters ---------------------------------------------------------------------------
    @property
    def prefilter(self) -> int:
        """Candidates per result from the sign-bit first pass (0: exact full scan)."""
        return self._prefilter

    @prefilter.setter
    def prefilter(self, value: int) -> None:
        v = V.positive_int(value, "prefilter", 0, V.MAX_CANDIDATE_FACTOR)
        if v and not (self.codec.has_sign_term() or self.codec.first_pass_terms()):
            raise ValueError(f"prefilter must be 0 for {self.codec!r}: a first pass needs "
                             "TurboQuant-mse codes (their sign bits; 1-bit codes: d > 8) or "
                             "mixed-width codes (their leading runs)")
        if v and self._sigmas:
            raise ValueError(f"prefilter must be 0 while prefilter_sigmas is set "
                             f"({self._sigmas}): the first pass keeps a count or a bound")
        self._set_first_pass(v, 0.0)

    @property
    def prefilter_sigmas(self) -> float:
        """The sign-bit first pass's error bound in standard deviations (0: none)."""
        return self._sigmas

    @prefilter_sigmas.setter
    def prefilter_sigmas(self, value: float) -> None:
        v = V.finite_float(value, "prefilter_sigmas")
        if not 0.0 <= v <= _MAX_SIGMAS:
            raise ValueError(f"prefilter_sigmas must be in [0, {_MAX_SIGMAS}], got {v}")
        if v and self.codec.sign_term_error() is None:
            raise ValueError(f"prefilter_sigmas must be 0 for {self.codec!r}: a bounded first "
                             "pass needs TurboQuant-mse codes at 2-4 bits (their sign plane "
                             "and its error model)")
        if v and self._prefilter:
            raise ValueError(f"prefilter_sigmas must be 0 while prefilter is set "
                             f"({self._prefilter}): the first pass keeps a count or a bound")
        self._set_first_pass(self._prefilter, v)

    def _set_first_pass(self, count: int, sigmas: float) -> None:
        with self._lock:
            self._prefilter, self._sigmas = count, sigmas
            self._scan = None  # the scan state holds the sign plane or the full blocked codes
            self._snap = None

    @property
    def _first_pass(self) -> bool:
        return bool(self._prefilter or self._sigmas)

    @property
    def query_map(self) -> tuple[torch.Tensor, list[slice], torch.Tensor] | None:
        """(W, slices, mu) of an index that owns this one and maps its queries into these
        codes' terms by one product (``PCAIndex``): term t's queries are the columns
        ``slices[t]`` of (q - mu) W (L2) or of q W (inner products, plus <q, mu>; cosine on
        unit rows). With it ``search_mapped`` runs such queries in one compiled call."""
        return self._query_map

    @query_map.setter
    def query_map(self, value: tuple[torch.Tensor, list[slice], torch.Tensor] | None) -> None:
        with self._lock:
            self._query_map = value
            self._scan = None  # the scan state holds the one-call search built from it
            self._snap = None

    # -- faiss surface ------------------------------------------------------------------------
    @property
    def code_size(self) -> int:
        """Bytes stored per vector (codes + side information + refinement)."""
        extra = 0
        if self.refine == "flat":
            extra = 4 * self.d
        elif isinstance(self.refine, Codec):
            extra = self.refine.code_size
        if self._corrects_ip:
            extra += 4  # the correction term
        return self.codec.code_size + extra

    @property
    def _corrects_ip(self) -> bool:
        """A centred index scored by inner products stores a per-row correction (unless
        ``center_term`` is off)."""
        return self.centered and self._scoring == METRIC_INNER_PRODUCT and self.center_term

    def train(self, x: Any) -> None:
        """No-op (data-oblivious; kept for faiss compatibility), except with ``center="fit"``:
        mu = the mean of x's rows (of x / ||x|| for cosine), on an empty index (it may be
        refitted while it is empty; ``reset`` keeps it, as faiss keeps training)."""
        t, _ = V.float_matrix(x, "x", self.d, allow_empty=not (self.centered and
                                                               self._center is None))
        if not self._fit_center:
            return
        if self._rows.n:
            raise ValueError(f"index must be empty to fit its center, got ntotal="
                             f"{self._rows.n} (call reset() first)")
        # cosine: the mean of the unit rows (float32 rows, float64 sum, like the codes' input)
        mean = row_mean(normalized(t.to(torch.float32)) if self.metric_type == METRIC_COSINE
                        else t)
        with self._lock:
            self._center = mean.to(device=self.device, dtype=torch.float32).contiguous()
            self._scan = None  # the one-call search holds the center it subtracts
            self._snap = None
            self.is_trained = True

    @property
    def center(self) -> np.ndarray | None:
        """The (d,) vector mu subtracted before coding (None without centering)."""
        return None if self._center is None else self._center.cpu().numpy().copy()

    def _to_stored(self, t: torch.Tensor) -> torch.Tensor:
        """Rows as the codes hold them: x, or x - mu (cosine: x / ||x|| - mu)."""
        if not self.centered:
            return t
        if self._center is None:
            raise ValueError("index must be trained before add: center='fit' needs train(x) "
                             "to fit its center")
        t = t.to(device=self.device, dtype=torch.float32)
        if self.metric_type == METRIC_COSINE:
            t = normalized(t)
        return t - self._center

    def _encode(self, t: torch.Tensor) -> tuple[Codes, Any, dict[str, torch.Tensor]]:
        """(codes, refinement rows or None, per-row terms) of new rows t (stored as x - mu
        where centred)."""
        t = self._to_stored(t)
        td = t.to(self.device)
        codes = self.codec.encode(td)
        ref = None
        if self.refine == "flat":
            ref = pages.host_cat([t.to(torch.float32).cpu()])  # a copy, on huge pages
        elif isinstance(self.refine, Codec):
            ref = self.refine.encode(td)
        sqn = sqnorms_of(self.codec, codes, self._scoring, self.device)
        per_row = {"sqnorms": sqn}
        if self._corrects_ip:  # a <mu, y> minus the codes' estimate of <mu, y>
            mu = self._center.to(td.device)
            est = self._scores(mu[None, :], codes, sqn)[0]
            weight = 1.0 / torch.sqrt(sqn.clamp_min(1e-30)) if sqn.numel() else None
            per_row["ipcorr"] = ip_row_correction(self.codec, codes, td.to(torch.float32), mu,
                                                  est, weight)
        return codes, ref, per_row

    def _invalidate(self) -> None:
        super()._invalidate()
        self._scan: FlatScan | None = None

    def _removed(self) -> None:
        self._layout = BlockedCodes()

    def reconstruct_n(self, i0: int, n: int) -> np.ndarray:
        """Decode the vectors at positions i0 .. i0+n-1 -> (n, d) float32."""
        i0, n = self._positions(i0, n)
        return self._from_stored(self.codec.decode(self._rows.codes_rows(i0, i0 + n),
                                                   like=np.empty(0)))

    def _from_stored(self, rows: np.ndarray) -> np.ndarray:
        """Decoded rows back from the stored space: + mu (cosine: the unit-vector direction)."""
        return rows if self._center is None else rows + self._center.cpu().numpy()

    def to_faiss(self, *, faiss_estimator: bool = False) -> Any:
        """The same codes in a faiss index (``IndexPreTransform`` over faiss's ``SQtqmse{b}``
        with our rotation and codebook): TurboQuant-mse at 1, 2, 3, 4 or 8 bits, metric l2 over
        unit-norm vectors (same results), ip over unit-norm vectors or cosine with
        ``faiss_estimator=True`` (faiss's <q, x_hat>, lower recall); ``Refine(Flat)`` and custom
        ids carry over. See ``tqvec.index.faiss_export`` for what maps and what cannot."""
        if self.centered:
            raise ValueError("to_faiss() needs an index without center (faiss's SQtqmse codes "
                             "hold x itself)")
        from .faiss_export import to_faiss
        return to_faiss(self, faiss_estimator=faiss_estimator)

    # -- state (files) -----------------------------------------------------------------------
    @property
    def scoring(self) -> int:
        """The metric the codes are scored with (a centred cosine index: the inner product)."""
        return self._scoring

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(meta, arrays): everything the index holds, as ``tqvec.index.io`` writes it
        (``tqvec.index.state.index_from_state`` reads it back)."""
        with self._lock:
            rows, center = self._rows.snapshot(), self._center
        meta, arrays = rows_state(self, rows, "flat", **self._state_meta())
        if self.centered:
            if center is None:
                raise ValueError("index must be trained before it is written (center='fit' has "
                                 "no center yet)")
            arrays["center"] = center.cpu().numpy()
            corr = rows.term("ipcorr")
            if corr.numel():
                arrays["ipcorr"] = corr.cpu().numpy()
        return meta, arrays

    def _state_meta(self) -> dict[str, Any]:
        """The header values of the flat index's own (a graph index writes them too)."""
        meta = {"prefilter": self.prefilter, "centered": bool(self.centered)}
        if self._sigmas:
            meta["prefilter_sigmas"] = self._sigmas
        if self.centered and not self.center_term:
            meta["center_term"] = False
        return meta

    def install_rows(self, rows: Rows, mapped: Any = None) -> None:
        """Take over stored rows (``index_from_state``; ``mapped``: the file they read)."""
        with self._lock:
            self._rows = rows
            self._mapped = mapped
            self._invalidate()
            self._layout = BlockedCodes()

    # -- the scan state -----------------------------------------------------------------------
    def _lut_ok(self) -> bool:
        """Codes of one rotated-domain term (``Codec.kernel_form``: TurboQuant-mse): scanned
        with per-query tables on any device (``ops.lut_scan``)."""
        return self.codec.kernel_form() is not None

    def _fast_scan_ok(self) -> bool:
        """Codes whose estimator is a sum of 1-4-bit scalar-code terms (TurboQuant mse and prod,
        QJL), or with a prefilter any TurboQuant-mse codes (their sign plane is 1-bit), on CPU:
        the SIMD fast-scan kernel (``ops.fast_scan_terms``)."""
        if not (self.device.type == "cpu" and self.codec.backend in ("auto", "cpu")
                and ops.has_cpu_kernels()):
            return False
        if self._first_pass:
            return True  # the setters checked has_sign_term() / sign_term_error()
        bits = self.codec.lut_term_bits()
        return bool(bits) and all(b in ops.FAST_SCAN_BITS for b in bits)

    def _scan_state(self) -> FlatScan | None:
        """The LUT scan's state, brought up to date (call with the lock held); None where the
        codes have no lookup-table form (their scores come from decoded blocks)."""
        if self._scan is not None:
            return self._scan
        fast = self._fast_scan_ok()
        rows = self._rows
        if not rows.has_codes or not (fast or self._lut_ok()):
            return None
        n, dev = rows.n, self.device
        first = self.codec.first_pass_terms() if self._prefilter else 0
        # The codes are held once: a scan that reads only their blocked layout (every term, no
        # first pass re-scoring packed rows) takes them over from the row-major copy.
        held_by_layout = fast and not self._first_pass and self._layout_tiles_payload()
        if held_by_layout:
            start = self._layout.start("terms")
            tail = self.codec.lut_terms(rows.codes_rows(start, n))
            terms = self.codec.lut_terms(rows.scalar_codes())
        else:
            rows.materialize()
            terms = self.codec.lut_terms(rows.codes)
        mults, add = metric_terms(terms, n, self._scoring, rows.term("sqnorms", dev),
                                  rows.term("ipcorr", dev), dev)
        scan = FlatScan(None if held_by_layout else [t.packed for t in terms], mults,
                        [t.centroids.to(torch.float32).contiguous() for t in terms],
                        [t.bits for t in terms], add, self._prefilter)
        if held_by_layout:
            self._layout = self._layout.lay_out("terms", [(t.packed, t.d, t.bits) for t in tail],
                                                n, start)
            blocked = self._layout.blocks
            scan.scanner = ops.FastScan(scan.scan_terms(blocked), n, add,
                                        self.codec.backend)
            rows.release(self._layout)
        elif fast and self._first_pass and not first:
            self._layout, term = self._layout.sign_plane(self.codec, rows.codes)
            signs = self._layout.blocks[0]
            full = sign_stage(self.codec, self._scoring, self._sigmas, term, scan, rows,
                              self.device)
            scan.signs = ops.FastScan(
                [ops.ScanTerm(signs, term.centroids.float().contiguous(), mults[0], 1)], n, add,
                self.codec.backend, full=full)
        elif fast:
            start = self._layout.start("terms")
            self._layout = self._layout.lay_out("terms", [(t.packed[start:], t.d, t.bits)
                                                          for t in terms], n, start)
            blocked = self._layout.blocks
            # a prefilter over several terms: the leading ones first, then every term of
            # the shortlist from the packed codes
            scan.scanner = ops.FastScan(
                scan.scan_terms(blocked, scan.packed if first else None), n, add,
                self.codec.backend, first=first)
        if fast:
            scan.fused = self._fused(scan)
            scan.mapped = self._one_call_mapped(scan)
        self._scan = scan
        return scan

    def _layout_tiles_payload(self) -> bool:
        """Whether the codec's terms, side by side, are its whole payload (so that their
        fast-scan layout can serve it back)."""
        bits = self.codec.lut_term_bits() or []
        return bool(bits) and sum(ops.row_bytes(t.d, t.bits) for t in self.codec.lut_terms(
            self._rows.scalar_codes())) == self.codec.payload_bytes

    def _fused(self, scan: FlatScan) -> FlatSearch | None:
        """The whole search as one compiled call, where it implements this index's
        composition: TurboQuant-mse codes under a Hadamard rotation, no refinement or exact
        vectors or TurboQuant-mse codes (not with a prefilter). The call prepares the query
        itself: unit rows (cosine), q - mu (L2), <q, mu> (a centred inner product)."""
        rotate = self.codec.query_rotation() if self.codec.kernel_form() else None
        if rotate is None or self.device.type != "cpu":
            return None
        mu = self._center.numpy() if self.centered and self._center is not None else None
        l2 = self._scoring == METRIC_L2
        ref_x = ref_codes = None
        lut = self._refine_lut()
        if self.refine == "flat" and self._rows.ref is not None:
            ref_x = self._rows.ref.numpy()
        elif lut is not None:
            ref_codes = (self.refine.query_rotation(), lut.packed, lut.bits, lut.cents,
                         lut.mult, lut.add)
        if self.refine is not None and (self._first_pass or (ref_x is None and ref_codes is None)):
            return None
        return FlatSearch.prepare(rotate, scan.signs or scan.scanner, self._rows.ids.numpy(),
                                  metric_name(self._scoring), self._prefilter,
                                  center=mu if l2 else None,
                                  normalize=self.metric_type == METRIC_COSINE,
                                  ip_center=None if l2 else mu, ref_x=ref_x, ref_codes=ref_codes)

    def _one_call_mapped(self, scan: FlatScan) -> TermsSearch | None:
        """``search_mapped``'s one compiled call (``query_map``): several terms on the CPU
        kernels, no refinement."""
        if self._query_map is None or scan.scanner is None or self.refine is not None:
            return None
        W, slices, mu = self._query_map
        l2 = self._scoring == METRIC_L2
        return TermsSearch.prepare(W, slices, scan.scanner, self._rows.ids.numpy(),
                                   metric_name(self._scoring), self._prefilter,
                                   center=mu.numpy() if l2 else None,
                                   normalize=self.metric_type == METRIC_COSINE,
                                   ip_center=None if l2 else mu.numpy())

    def _snapshot(self) -> FlatSnapshot:
        """What a search reads, taken together (call with the lock held). The scan state first:
        building it may hand the row-major codes to the blocked layout, which the rows' copy
        must not keep alive."""
        scan = self._scan_state()
        return FlatSnapshot(self._rows.snapshot(), scan, self._refine_lut())

    # -- search ------------------------------------------------------------------------------
    def _fast_rows_ok(self, scan: FlatScan, n: int, kk: int) -> bool:
        """Whether the fast scan runs for kk results of n rows: the exact scan wherever each
        has a row (the layout holds the codes); a prefilter, or a refinement's table-ranked
        candidates (ties at the cut), only with enough rows per result."""
        few = scan.first_pass or self.refine is not None
        return n > 0 and n >= (_FAST_SCAN_ROWS_PER_RESULT if few else 1) * kk

    def _route(self, snap: FlatSnapshot, nq: int, kk: int, route: tuple[int, int] | None = None
               ) -> str:
        """The scan a search runs, chosen here only: ``"fast"`` (the CPU fast-scan kernels),
        ``"lut"`` (per-query tables over the packed codes) or ``"gemm"`` (decoded blocks)."""
        scan = snap.scan
        n, kr = (snap.n, kk) if route is None else route  # a larger collection's route
        if scan is not None and scan.fast and self._fast_rows_ok(scan, n, kr):
            return "fast"
        # On a GPU the LUT kernel handles query groups itself (fused top-k, no score matrix).
        if scan is not None and self._lut_ok() and (nq <= _LUT_MAX_QUERIES
                                                    or self.device.type == "cuda"):
            return "lut"
        return "gemm"

    def _queries(self, x: Any) -> tuple[torch.Tensor, np.ndarray | None]:
        """The queries as the codes are scored against them: validated float32 rows on the
        index's device, unit rows for cosine, q - mu for a centred L2 index; and a centred
        inner-product index's exact <q, mu> per query (None otherwise)."""
        q = V.query_rows(x, "x", self.d, self.device)
        if self.metric_type == METRIC_COSINE:
            if q.device.type == "cpu":  # numpy: fewer steps than torch's for one query
                q = torch.from_numpy(unit_rows(q.numpy()))
            else:
                q = normalized(q)
        if not self.centered or self._center is None:
            return q, None
        if self._scoring == METRIC_L2:  # ||q - x|| = ||(q - mu) - (x - mu)||
            return q - self._center, None
        # ops.row_dots: the one-call search's <q, mu> (same bits)
        return q, ops.row_dots(q, self._center).cpu().numpy()

    def _fused_search(self, x: Any, snap: FlatSnapshot, k: int
                      ) -> tuple[np.ndarray, np.ndarray] | None:
        """float32 numpy queries (one block) on an index whose scan has the one compiled call
        (``_fused``)."""
        if not (one_call_queries(x, self.d)
                and snap.scan is not None and snap.scan.fused is not None
                and self._fast_rows_ok(snap.scan, snap.n, self._candidates(snap.n, k))):
            return None
        return snap.scan.fused.search(x, k, self.k_factor)

    def _scan_block(self, q: torch.Tensor, snap: FlatSnapshot, mask: torch.Tensor | None, kk: int,
                    nq_total: int, route: tuple[int, int] | None = None, probes: Any = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Best kk similarities (larger is better; for L2 the negated squared distance) and
        their row positions for the queries q, by the route ``_route`` chooses."""
        route = self._route(snap, nq_total, kk, route)
        if route == "gemm":
            vals, pos = self._gemm_scan(q, snap, mask, kk)
            return vals.cpu().numpy(), pos.cpu().numpy()
        scan = snap.scan
        add = scan.add if mask is None else scan.add.masked_fill(~mask, -float("inf"))
        qts = self.codec.query_terms(q)
        if route == "fast":
            vals, pos = self.fast_scan(qts, scan, kk, None if mask is None else add)
        else:  # one mse term (_lut_ok); row-major codes, rebuilt if the layout holds them
            packed = (scan.packed[0] if scan.packed is not None
                      else self.codec.lut_terms(snap.rows.codes)[0].packed)
            vals, pos = ops.lut_scan(qts[0], packed, scan.cents[0], scan.mults[0], add,
                                     scan.bits[0], kk, self.codec.backend)
        if self._scoring == METRIC_L2:  # one ||q||^2 function for all paths (same bits)
            vals = vals - ops.row_sqnorms(q)[:, None]
        return vals.cpu().numpy(), pos.cpu().numpy()

    def fast_scan(self, qts: list[torch.Tensor] | list[np.ndarray], scan: FlatScan, kk: int,
                  add: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top kk (similarities, positions) by the CPU fast-scan kernels for prepared query
        terms: all terms of every row, or with a prefilter a first pass - the sign plane, or a
        mixed-width code's leading terms (``Codec.first_pass_terms``) - and the full codes of
        its best ``prefilter * kk`` rows. ``add`` overrides the row offsets. With a refinement,
        which re-ranks them, by the kernel's tables alone."""
        if scan.signs is not None:
            return scan.signs.search(qts[:1], kk, add, k1=scan.prefilter * kk)
        if scan.scanner.first:  # the leading terms first (first_pass_terms)
            return scan.scanner.search(qts, kk, add, k1=scan.prefilter * kk)
        return scan.scanner.search(qts, kk, add, approx=self.refine is not None)

    def search_mapped(self, x: np.ndarray, k: int, snap: FlatSnapshot | None = None
                      ) -> tuple[np.ndarray, np.ndarray] | None:
        """``search`` of queries in the owner's space (``query_map``) in one compiled call -
        the same bits as ``search_prepared`` with the owner's preparation -, or None where it
        does not run (no query map, not the CPU fast scan, too few rows per result, a NaN or
        an infinity in x: the caller's general path then reports it). x: (nq, d_owner)
        C-contiguous float32. ``snap``: the ``snapshot`` to answer from (default: a new one)."""
        snap = self._current() if snap is None else snap
        kk = self._candidates(snap.n, k)
        if (snap.scan is None or snap.scan.mapped is None
                or not self._fast_rows_ok(snap.scan, snap.n, kk)):
            return None
        return snap.scan.mapped.search(x, k)

    def search_prepared(self, k: int, prepare: Callable[[], tuple[list[np.ndarray],
                                                                  torch.Tensor,
                                                                  np.ndarray | None] | None],
                        snap: FlatSnapshot | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """``search`` with the queries prepared by the caller (a ``PCAIndex`` folds its basis
        into the query terms): ``prepare()`` returns (``query_terms`` of the prepared queries as
        float32 numpy arrays, those queries (for ||q||^2 in L2), offsets per query added to the
        scores), or None (bad input: the caller's general path reports it). The fast-scan route
        only: None where it does not run (a refinement, no CPU kernels, too few rows per
        result), before ``prepare`` is called. ``snap``: as ``search_mapped``."""
        snap = self._current() if snap is None else snap
        kk = self._candidates(snap.n, k)
        if (self.refine is not None or snap.scan is None or not snap.scan.fast
                or not self._fast_rows_ok(snap.scan, snap.n, kk)):
            return None
        prepared = prepare()
        if prepared is None:
            return None
        qts, q, offsets = prepared
        vals, pos = self.fast_scan(qts, snap.scan, kk)
        vals, pos = vals.numpy(), pos.numpy()
        if self._scoring == METRIC_L2:
            vals = ops.row_sqnorms(q).numpy()[:, None] - vals
        if offsets is not None:
            vals = vals + offsets[:, None]
        return results(self.metric_type, vals, pos, snap.rows.ids.numpy(), k)

    def _scores(self, q: torch.Tensor, codes: Codes, sqn: torch.Tensor,
                corr: torch.Tensor | None = None) -> torch.Tensor:
        """(nq, B) similarities by the codec's scorer (larger is better; for L2 the negated
        squared distance). ``sqn`` is the N(x) slice of these codes (empty for inner product),
        ``corr`` the correction slice of a centred inner-product index (None or empty: none)."""
        s = self.codec.score(q, codes)
        if self._scoring == METRIC_L2:
            return 2 * s - sqn[None, :] - (q * q).sum(1, keepdim=True)
        if self._scoring == METRIC_COSINE or sqn.numel():
            s = s / torch.sqrt(sqn.clamp_min(1e-30))[None, :]
        if corr is not None and corr.numel():
            s = s + corr[None, :]
        return s

    def _gemm_scan(self, q: torch.Tensor, snap: FlatSnapshot, mask: torch.Tensor | None, kk: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Running top-kk over blocks of codes scored with the codec (decode block + GEMM)."""
        rows, dev = snap.rows, q.device
        sqn, corr = rows.term("sqnorms", dev), rows.term("ipcorr", dev)
        best_s = torch.empty((q.shape[0], 0), device=dev)
        best_p = torch.empty((q.shape[0], 0), dtype=torch.int64, device=dev)
        for cs in range(0, rows.n, ROW_BLOCK):
            ce = min(rows.n, cs + ROW_BLOCK)
            s = self._scores(q, rows.codes_rows(cs, ce), sqn[cs:ce], corr[cs:ce])
            if mask is not None:
                s = s.masked_fill(~mask[cs:ce][None, :], -float("inf"))
            s = torch.cat([best_s, s], dim=1)
            p = torch.cat([best_p, torch.arange(cs, ce, device=dev).expand(q.shape[0], -1)],
                          dim=1)
            top = torch.topk(s, min(kk, s.shape[1]), dim=1)
            best_s, best_p = top.values, torch.gather(p, 1, top.indices)
        return best_s, best_p

    def _range_scores(self, q: torch.Tensor, off: np.ndarray | None):
        """``range_search``'s scores: every query against every row, a block of rows at a
        time, as (query rows, their metric scores, the rows' ids)."""
        off_t = None if off is None else torch.from_numpy(off).to(q.device)[:, None]
        with self._lock:
            rows = self._rows.snapshot()
            ids, n = rows.ids, rows.n
            sqn, corr = rows.term("sqnorms", self.device), rows.term("ipcorr", self.device)
        every = torch.arange(q.shape[0])
        for cs in range(0, n, ROW_BLOCK):
            ce = min(n, cs + ROW_BLOCK)
            s = self._scores(q, rows.codes_rows(cs, ce), sqn[cs:ce], corr[cs:ce])
            yield every, s if off_t is None else s + off_t, ids[cs:ce]

    def __repr__(self) -> str:
        ref = f", refine={self.refine!r}" if self.refine is not None else ""
        dev = f", device='{self.device}'" if self.device.type != "cpu" else ""
        return (f"FlatIndex({self.codec!r}, metric={metric_name(self.metric_type)!r}{ref}"
                f"{dev}, ntotal={self._rows.n})")


# -- files: the flat index's part of tqvec.index.state ------------------------------------------

def _empty_from_state(meta: dict, codec: Codec, refine: Any, arrays: dict) -> FlatIndex:
    centered = meta.get("centered", False)
    if not isinstance(centered, bool):
        raise TypeError(f"centered must be a bool, got {centered!r:.40}")
    center_term = meta.get("center_term", True)
    if not isinstance(center_term, bool) or not (center_term or centered):
        raise ValueError(f"center_term must be a bool, False only for a centred index, got "
                         f"{center_term!r:.40}")
    center = None
    if centered:
        if "center" not in arrays:
            raise ValueError("arrays must hold 'center' for a centred index")
        center = float_rows(arrays, "center", (codec.dim,)).numpy().copy()
    return FlatIndex(codec, meta["metric"], refine=refine, k_factor=meta["k_factor"],
                     prefilter=meta.get("prefilter", 0),
                     prefilter_sigmas=meta.get("prefilter_sigmas", 0.0), center=center,
                     center_term=center_term)


def _arrays_in_state(meta: dict, ntotal: int) -> tuple[set[str], set[str]]:
    if not meta.get("centered"):
        return set(), set()
    return {"center"}, {"ipcorr"} if meta.get("center_term", True) else set()


def stored_row_terms(index: FlatIndex, arrays: dict, codes: Codes, ntotal: int
                     ) -> dict[str, torch.Tensor]:
    """A flat (or graph) index's per-row terms of rows read from a file: the squared norms
    its metric pairs with the codes, recomputed; a centred inner product's stored correction."""
    per_row = {"sqnorms": sqnorms_of(index.codec, codes, index.scoring, index.device)}
    if index.centered and index.scoring == METRIC_INNER_PRODUCT and index.center_term:
        per_row["ipcorr"] = row_correction(arrays, ntotal, "ipcorr")
    return per_row


register_kind("flat", StoredKind(FlatIndex, not_per_row=frozenset({"center"}),
                                 empty=_empty_from_state, arrays=_arrays_in_state,
                                 per_row=stored_row_terms))

