"""Flat (exhaustive) search over tqvec codes, with faiss's interface and semantics.

``search(x, k) -> (D, I)``: D float32 (nq, k), I int64 (nq, k), best first; missing results are
I = -1 with D = -FLT_MAX (inner product, cosine) or +FLT_MAX (L2), exactly as faiss pads.
Distances by metric (the estimator matters more than the code, see issue #6 lesson (a)):

* ``ip``: the codec's asymmetric estimate of <q, x> (query exact, never quantized), for the
  biased mse codes that store ||x|| (TurboQuant-mse) rescaled to the true norm:
  ||x|| <q, x_hat> / ||x_hat||, the inner product with the reconstruction stretched back to
  ||x||. The paper's <q, x_hat> shrinks each row by its own factor <u, c[idx]> ~ 1 - D, and when
  neighbours' scores are close that per-row noise reorders them: recall@10 at 2 / 4 bits on
  Fashion-MNIST (unit vectors) 0.450 / 0.675 with <q, x_hat>, 0.766 / 0.919 rescaled; on raw
  digits 0.556 / 0.788 vs 0.754 / 0.920; never lower on the sets we tried (Gaussian: +0.01).
  At 1 bit ||c[idx]|| is the same for every row and the two agree. Unbiased estimators
  (TurboQuant-prod, QJL, the unbiased scale) are used as they are.
* ``l2``: ||q||^2 - 2 est<q, x> + N(x), where N must match the estimator: for the biased MSE
  estimators (TurboQuant-mse, PolarQuant) N = ||x_hat||^2, i.e. the distance to the
  reconstruction (pairing the shrunk inner product with the true ||x||^2 collapses recall);
  for unbiased estimators (TurboQuant-prod, QJL, the unbiased scale) N = the true ||x||^2,
  which makes the distance estimate unbiased (||x_hat||^2 would add the estimator's noise).
* ``cosine``: est<q, x> / (||q|| sqrt(N(x))), the same pairing.

So ip and cosine both score est<q, x> / sqrt(N(x)), with N = ||x_hat||^2 / ||x||^2 (ip, biased
codes), ||x_hat||^2 or ||x||^2 (cosine); ip without such an N uses est<q, x> unchanged.

A centred index (``center``) codes y = x - mu. For L2 it ranks by the distance between q - mu and
y's estimate (translation-invariant). For inner products (and centred cosine, the inner product of
unit vectors) <q, x> = <q, mu> + <q, y> = <q, mu> + <mu, y> + <q - mu, y>: <q, mu> is exact per
query, <mu, y> is exact per row, known when the row is added, and only <q - mu, y> is left to the
codes (RaBitQ's estimator, Gao & Long 2024). Estimating all of <q, y> from the codes instead adds
the code's error on <mu, y>, a per-row noise that no query removes. As the estimators are linear
in the query, est<q - mu, y> + a <mu, y> = est<q, y> + (a <mu, y> - est<mu, y>): the index stores
that per-row correction (``_ipcorr``, float32, 4 bytes per vector) and adds it to every row's
score. a = 1 for the unbiased estimators; a biased one scales <q - mu, y> by about
a = est<y, y> / ||y||^2 (cos(y, y_hat) with the norm-rescaled mse codes, ~0.8 at 1 bit), and the
exact term gets the same factor so that the two parts keep their weights (IVF over MiniLM, inner
product, 1 bit: recall@10 0.693 without the correction, 0.666 with a = 1, 0.722 with a).
MiniLM-384 at 1 bit (``Center,TQ1u``, seeds 0-3): recall@10 0.727 -> 0.735.

Search scores blocks of codes against blocks of queries (the codec's ``score``) and keeps a
running top-k, so memory stays bounded for any n and nq. TurboQuant-mse codes are scanned with
per-query lookup tables instead (no decoding); at 1-4 bits on CPU by the SIMD fast-scan
kernel over a blocked copy of the codes (``ops.block_codes``; it doubles the code bytes held in
memory, not those stored in files). Searches only refresh that cache, under the index's lock, so
concurrent ``search`` calls are safe; ``add``/``remove_ids`` must not run concurrently with them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .. import _validate as V
from .. import ops
from ..codecs.base import Codec, Codes, concat_codes
from ..codecs.turbo import TurboQuant
from .fused import FlatSearch

__all__ = ["FlatIndex", "METRIC_INNER_PRODUCT", "METRIC_L2", "METRIC_COSINE", "metric_code"]

# faiss's integer codes for its metrics (faiss.METRIC_INNER_PRODUCT = 0, faiss.METRIC_L2 = 1);
# cosine has no faiss code: it is faiss's inner product on normalized vectors.
METRIC_INNER_PRODUCT = 0
METRIC_L2 = 1
METRIC_COSINE = 100
_METRICS = {"ip": METRIC_INNER_PRODUCT, "inner_product": METRIC_INNER_PRODUCT,
            "l2": METRIC_L2, "euclidean": METRIC_L2, "cosine": METRIC_COSINE,
            "angular": METRIC_COSINE}
_FLT_MAX = float(np.finfo(np.float32).max)
_QUERY_BLOCK = 1024
_CODE_BLOCK = 16384
# Up to this many queries, TurboQuant-mse codes are scanned with per-query lookup tables (reads
# only the packed codes); above it, decoding blocks to floats and one GEMM per block is faster.
# At 1-4 bits the CPU fast-scan kernel (7-bit tables in SIMD registers) beats the GEMM at
# any number of queries, so it is used for all of them.
_LUT_MAX_QUERIES = 32
# The fast-scan kernel re-scores every row whose error bound reaches the k-th best: with few
# rows per result (digits, n = 1,597, k = 100) that is most rows and the float paths are faster.
_FAST_SCAN_ROWS_PER_RESULT = 64


def _unit_rows(q: np.ndarray) -> np.ndarray:
    """Rows scaled to unit norm (cosine queries on the CPU; zero rows stay zero): q / max(sqrt(
    row_sqnorms(q)), 1e-30), the float operations of the one-call search's ``normalize``."""
    nrm = np.sqrt(ops.row_sqnorms(torch.from_numpy(q)).numpy())[:, None]
    return q / np.maximum(nrm, np.float32(1e-30))


def _normalized(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit norm (torch, any device; zero rows stay zero)."""
    return x / torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min(1e-30)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """(d,) float64 mean of the rows of x: numpy sums float32 CPU rows into float64 without a
    float64 copy (60,000 x 784: 34 ms against torch's 180-220 ms)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.numpy().sum(0, dtype=np.float64) / x.shape[0])
    return x.to(torch.float64).mean(0)


def _append_rows(old: Codes | torch.Tensor | None, new: Codes | torch.Tensor
                 ) -> Codes | torch.Tensor:
    if old is None:
        return new
    return concat_codes([old, new]) if isinstance(new, Codes) else torch.cat([old, new])


def _device(device: Any) -> torch.device:
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


def ip_row_correction(codec: Codec, codes: Codes, y: torch.Tensor, v: torch.Tensor,
                      est_v: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """a_i <v_i, y_i> - est<v_i, y_i> per row (module docstring): y (n, d) the rows the codes
    hold, v (d,) or (n, d) the vector whose product with them is known exactly (the center, an
    IVF row's centroid), est_v (n,) the index's estimate of <v_i, y_i> (``weight`` times the
    codec's score; None: 1). a = 1 for unbiased estimators, else est<y_i, y_i> / ||y_i||^2."""
    exact = (y * v).sum(1) if v.dim() == 2 else y @ v
    if codec.unbiased_ip:
        return (exact - est_v).to(torch.float32)
    est_y = torch.empty_like(exact)  # <y_i, decode_i> (a codec's score is <q, decode>), by blocks
    for s in range(0, len(codes), _CODE_BLOCK):
        e = min(len(codes), s + _CODE_BLOCK)
        est_y[s:e] = (y[s:e] * codec.decode(codes[s:e]).to(y.device, torch.float32)).sum(1)
    if weight is not None:
        est_y = est_y * weight
    sq = (y * y).sum(1)
    a = torch.where(sq > 0, est_y / sq.clamp_min(1e-30), torch.zeros_like(sq))
    return (a * exact - est_v).to(torch.float32)


def check_refine(refine: Codec | str | None, d: int) -> Codec | str | None:
    """A refinement argument: None, ``"flat"`` or a codec of dimension d."""
    if refine is not None and not (refine == "flat" or isinstance(refine, Codec)):
        raise ValueError(f"refine must be None, 'flat' or a tqvec codec, got {refine!r}")
    if isinstance(refine, Codec) and refine.dim != d:
        raise ValueError(f"refine codec must have dim {d}, got {refine.dim}")
    return refine


class FlatIndex:
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
        codes. That first pass reads b times fewer bytes; on MiniLM-384 (60k, 1,000 queries)
        prefilter 10 kept 99.6-99.9 % of the exact 4/3/2-bit top-10 and recall@10 within
        0.001. 1-bit codes have no coarser bit: their first pass is the codes of the first half
        of the (rotated) coordinates, half the bytes (``TurboQuant.sign_term``). Mixed-width
        codes (``MixedTurboQuant``, ``PCAIndex``) have a first pass over their leading runs
        instead (``Codec.first_pass_terms``). An attribute, like faiss's ``nprobe``: may change
        between searches.
    center: ``None`` (default), ``"fit"`` or a (d,) vector mu: codes of x - mu instead of x (for
        cosine: of x / ||x|| - mu). A fit of one vector, so the index then needs ``train`` when
        ``"fit"`` (mu = the training rows' mean). The codec's error scales with the norm it
        codes, so on data far from the origin (pixels: Fashion-MNIST recall@10 at 1 / 2 / 4
        bits 0.677 / 0.798 / 0.928 -> 0.734 / 0.841 / 0.945) it buys recall for no bytes per
        vector; on embeddings near the origin (MiniLM, ||mu|| = 0.23) nothing. L2 distances are
        translation-invariant; inner products add <q, mu> exactly; cosine becomes the inner
        product of unit vectors (the reconstruction's norm is then not divided out).
    device: where the codes live and are scanned (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
        On a GPU, adds encode with the CUDA kernels and searches run the CUDA LUT scan
        (TurboQuant-mse) or the codec's blocked GEMM; results come back as numpy, as in faiss.
        Ids, and exact vectors for ``Refine(Flat)``, stay in host memory.
    """

    def __init__(self, codec: Codec, metric: Any = "ip", *, refine: Codec | str | None = None,
                 k_factor: int = 4, prefilter: int = 0, center: Any = None,
                 device: str | torch.device | None = None):
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a tqvec codec, got {type(codec).__name__}")
        self.codec = codec
        self.d = codec.dim
        self.metric_type = metric_code(metric)
        self.refine = check_refine(refine, self.d)
        self.k_factor = k_factor
        self.device = _device(device)
        self.is_trained = True  # data-oblivious: nothing to train (unless center="fit")
        self._center: torch.Tensor | None = None
        self.centered = center is not None
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
        self._lock = threading.Lock()
        self._prefilter = 0
        self.reset()
        self.prefilter = prefilter

    @property
    def k_factor(self) -> int:
        """Candidates per result taken from the codes for the refinement to re-rank."""
        return self._k_factor

    @k_factor.setter
    def k_factor(self, value: int) -> None:
        self._k_factor = V.positive_int(value, "k_factor", 1, V.MAX_CANDIDATE_FACTOR)

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
        with self._lock:
            self._prefilter = v
            self._scan = None  # the scan state holds the sign plane or the full blocked codes

    # -- faiss surface ------------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        return self._n

    @property
    def code_size(self) -> int:
        """Bytes stored per vector (codes + side information + refinement)."""
        extra = 0
        if self.refine == "flat":
            extra = 4 * self.d
        elif isinstance(self.refine, Codec):
            extra = self.refine.code_size
        if self._corrects_ip:
            extra += 4  # _ipcorr
        return self.codec.code_size + extra

    @property
    def _corrects_ip(self) -> bool:
        """A centred index scored by inner products stores ``_ipcorr`` (module docstring)."""
        return self.centered and self._scoring == METRIC_INNER_PRODUCT

    def train(self, x: Any) -> None:
        """No-op (data-oblivious; kept for faiss compatibility), except with ``center="fit"``:
        mu = the mean of x's rows (of x / ||x|| for cosine), on an empty index (it may be
        refitted while it is empty; ``reset`` keeps it, as faiss keeps training)."""
        t, _ = V.float_matrix(x, "x", self.d, allow_empty=not (self.centered and
                                                               self._center is None))
        if not self._fit_center:
            return
        if self._n:
            raise ValueError(f"index must be empty to fit its center, got ntotal={self._n} "
                             "(call reset() first)")
        # cosine: the mean of the unit rows (float32 rows, float64 sum, like the codes' input)
        mean = row_mean(_normalized(t.to(torch.float32)) if self.metric_type == METRIC_COSINE
                        else t)
        self._center = mean.to(device=self.device, dtype=torch.float32).contiguous()
        self._scan = None  # the one-call search holds the center it subtracts
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
            t = _normalized(t)
        return t - self._center

    def check_mapped(self) -> None:
        """Raise ``FormatError`` if the file this index memory-maps (``read_index(...,
        mmap=True)``) changed since it was read; every search, range search and reconstruction
        checks it first."""
        if self._mapped is not None:
            self._mapped.check()

    def reset(self) -> None:
        # the file that memory-mapped rows read, checked at each use (read_index sets it)
        self._mapped: Any = None
        self._n = 0
        self._next_id = 0
        self._codes: Codes | None = None
        self._ref: Codes | torch.Tensor | None = None
        # N(x) (l2 / cosine), on self.device like the codes
        self._sqnorms = torch.empty(0, dtype=torch.float32, device=self.device)
        # a <mu, y> - est<mu, y> per row of a centred inner-product index (module docstring)
        self._ipcorr = torch.empty(0, dtype=torch.float32, device=self.device)
        self._ids = torch.empty(0, dtype=torch.int64)
        self._pos: dict[int, int] | None = None
        # What a LUT scan needs beyond the codes, built at the first search after a change:
        # per-row multipliers and offsets of the metric, and on CPU the codes of each term in
        # the fast-scan layout (a search-time copy, extended incrementally on add).
        self._scan: dict[str, Any] | None = None
        self._blocked: list[torch.Tensor] | None = None
        self._blocked_n = 0
        self._signs: torch.Tensor | None = None  # the sign plane in the fast-scan layout
        self._signs_n = 0
        self._refine_lut: dict[str, Any] | None = None  # _refine_lut_state's, likewise

    def _lut_ok(self) -> bool:
        """TurboQuant-mse codes: scanned with per-query tables on any device (``ops.lut_scan``)."""
        return isinstance(self.codec, TurboQuant) and self.codec.variant == "mse"

    def _fast_scan_ok(self) -> bool:
        """Codes whose estimator is a sum of 1-4-bit scalar-code terms (TurboQuant mse and prod,
        QJL), or with a prefilter any TurboQuant-mse codes (their sign plane is 1-bit), on CPU:
        the SIMD fast-scan kernel (``ops.fast_scan_terms``)."""
        if not (self.device.type == "cpu" and self.codec.backend in ("auto", "cpu")
                and ops.has_cpu_kernels()):
            return False
        if self._prefilter:
            return True  # the setter checked has_sign_term()
        bits = self.codec.lut_term_bits()
        return bool(bits) and all(b in ops.FAST_SCAN_BITS for b in bits)

    def _scan_state(self) -> dict[str, Any] | None:
        """What the LUT scan reads, brought up to date (call with the lock held):
        score_i = sum_t mults[t]_i <query_terms(q)[t], c_t[idx_t,i]> + add_i is the metric's
        similarity (without the query's own ||q||^2 for L2); ``blocked`` (one array per term,
        fast-scan layout) or None for ``ops.lut_scan`` over the packed mse codes; with a
        prefilter, ``signs`` (a ``FastScan`` over the sign plane) instead of ``blocked``.
        ``fast``: the CPU fast-scan kernels apply (one of ``scanner`` / ``signs`` is set)."""
        if self._scan is not None:
            return self._scan
        fast = self._fast_scan_ok()
        if self._codes is None or not (fast or self._lut_ok()):
            return None
        n, dev = self._n, self.device
        add = torch.zeros(n, dtype=torch.float32, device=dev)
        if self._scoring == METRIC_L2:
            weight = torch.full((n,), 2.0, device=dev)
            add = -self._sqnorms
        elif self._scoring == METRIC_COSINE or self._sqnorms.numel():
            weight = 1.0 / torch.sqrt(self._sqnorms.clamp_min(1e-30))
        else:
            weight = torch.ones(n, device=dev)
        if self._ipcorr.numel():
            add = add + self._ipcorr
        terms = self.codec.lut_terms(self._codes)
        state: dict[str, Any] = {
            "packed": [t[0] for t in terms],
            "mults": [(weight * t[4]).to(torch.float32).contiguous() for t in terms],
            "cents": [t[3].to(torch.float32).contiguous() for t in terms],
            "bits": [t[2] for t in terms], "add": add.to(torch.float32).contiguous(),
            "blocked": None, "scanner": None, "signs": None, "fast": fast}
        first = self.codec.first_pass_terms() if self._prefilter else 0
        if fast and self._prefilter and not first:
            # the sign plane of the rows not yet laid out (from the last whole block on); its
            # multiplier is the full code's (the same scale of the same coordinates)
            start = (self._signs_n // 32) * 32 if self._signs is not None else 0
            packed1, d1, _, c1, _ = self.codec.sign_term(self._codes[start:])
            new = ops.block_codes(packed1, d1, 1)
            old = self._signs[: start // 32] if self._signs is not None else None
            self._signs, self._signs_n = (new if old is None else torch.cat([old, new])), n
            self._blocked, self._blocked_n = None, 0  # RAM holds one search-time copy
            add1 = state["add"]
            if d1 < self.d:  # a prefix of the coordinates (1-bit codes) scores ~d1/d of <q, x>
                add1 = (add1 * (d1 / self.d)).contiguous()
            if self._scoring == METRIC_L2:
                # Rank the first pass by the distance to the 1-bit reconstruction, m c1[sign]
                # (norm^2 = m^2 d c1^2), not with the full code's ||x_hat||^2: its inner
                # products are ~2/pi smaller, and mixing the two scales ranks short vectors
                # first (Fashion-MNIST, 4 bits, prefilter 10: recall@10 0.17 instead of 0.92;
                # issue #6 lesson (a) again).
                add1 = -(terms[0][4].float() ** 2 * (float(c1[1]) ** 2 * d1)).contiguous()
            state["signs"] = ops.FastScan([self._signs], n, [c1.float().contiguous()],
                                          state["mults"][:1], state["add"], [1],
                                          self.codec.backend,
                                          full=(state["packed"][0], state["bits"][0],
                                                state["cents"][0]), add1=add1)
        elif fast:
            start = (self._blocked_n // 32) * 32 if self._blocked is not None else 0
            blocked = []
            for ti, (packed, d, b, _, _) in enumerate(terms):
                new = ops.block_codes(packed[start:], d, b)
                old = self._blocked[ti][: start // 32] if self._blocked is not None else None
                blocked.append(new if old is None else torch.cat([old, new]))
            self._blocked, self._blocked_n = blocked, n
            self._signs, self._signs_n = None, 0
            state["blocked"] = blocked
            # a prefilter over several terms: the leading ones first, then every term of
            # the shortlist from the packed codes
            state["scanner"] = ops.FastScan(blocked, n, state["cents"], state["mults"],
                                            state["add"], state["bits"], self.codec.backend,
                                            packed=state["packed"] if first else None,
                                            first=first)
        # float32 numpy queries: the whole search in one compiled call (TurboQuant-mse codes,
        # Hadamard rotation)
        rotate = (self.codec.query_rotation() if isinstance(self.codec, TurboQuant)
                  and self.codec.variant == "mse" else None)
        if fast and rotate is not None and dev.type == "cpu":
            # the call prepares the query itself: a cosine index's unit rows, an L2 index's
            # centring (q - mu), a centred inner-product index's offset <q, mu> (_centre)
            mu = (self._center.numpy() if self.centered and self._center is not None
                  else None)
            l2 = self._scoring == METRIC_L2
            # a refinement in the call too: exact vectors, or TurboQuant-mse codes re-scored
            # in their rotated domain (not with a prefilter; other codecs: the general path)
            ref_x = ref_codes = None
            lut = self._refine_lut_state()
            if self.refine == "flat" and self._ref is not None:
                ref_x = self._ref.numpy()
            elif lut is not None:
                ref_codes = (self.refine.query_rotation(), lut["packed"], lut["bits"],
                             lut["cents"], lut["mult"], lut["add"])
            if self.refine is None or (not self._prefilter
                                       and (ref_x is not None or ref_codes is not None)):
                state["one_call"] = FlatSearch.prepare(
                    rotate, state["signs"] or state["scanner"], self._ids.numpy(),
                    metric_name(self._scoring), self._prefilter, center=mu if l2 else None,
                    normalize=self.metric_type == METRIC_COSINE,
                    ip_center=None if l2 else mu, ref_x=ref_x, ref_codes=ref_codes)
        self._scan = state
        return self._scan

    def add(self, x: Any) -> None:
        """Add vectors with ids ntotal, ntotal+1, ... (faiss's flat-index convention)."""
        t, _ = V.float_matrix(x, "x", self.d)
        start = self._next_id
        if start + t.shape[0] - 1 > V.INT64_MAX:
            raise ValueError(f"add() numbers the rows from next id {start}: {t.shape[0]} more do "
                             "not fit in int64; use add_with_ids")
        self._append(t, torch.arange(start, start + t.shape[0], dtype=torch.int64))

    def add_with_ids(self, x: Any, ids: Any) -> None:
        """Add vectors with the given ids (integers in 0..2**63-1; -1 stands for "no result")."""
        t, _ = V.float_matrix(x, "x", self.d)
        a = V.id_array(ids)
        if a.shape != (t.shape[0],):
            raise ValueError(f"ids must be an int64 array of shape ({t.shape[0]},), got shape "
                             f"{np.shape(ids)}")
        if a.size and int(a.min()) < 0:
            raise ValueError(f"ids must be in 0..2**63-1, got {int(a.min())}")
        self._append(t, torch.from_numpy(a.copy()))

    def _encode(self, t: torch.Tensor) -> tuple[Codes, Any, dict[str, torch.Tensor]]:
        """(codes, refinement rows or None, {attribute: per-row values}) of new rows t."""
        td = t.to(self.device)
        codes = self.codec.encode(td)
        ref = None
        if self.refine == "flat":
            ref = t.to(torch.float32).cpu().clone()
        elif isinstance(self.refine, Codec):
            ref = self.refine.encode(td)
        per_row = {"_sqnorms": self._sqnorms_of(self.codec, codes)}
        if self._corrects_ip:  # a <mu, y> minus the codes' estimate of <mu, y>
            mu, sqn = self._center.to(td.device), per_row["_sqnorms"]
            est = self._scores(mu[None, :], codes, sqn)[0]
            weight = 1.0 / torch.sqrt(sqn.clamp_min(1e-30)) if sqn.numel() else None
            per_row["_ipcorr"] = ip_row_correction(self.codec, codes, td.to(torch.float32), mu,
                                                   est, weight)
        return codes, ref, per_row

    def _invalidate(self) -> None:
        """Drop the search-time state derived from the rows (lock held)."""
        self._pos = None
        self._scan = None
        self._refine_lut = None

    def _append(self, t: torch.Tensor, ids: torch.Tensor) -> None:
        if t.shape[0] == 0:
            return
        codes, ref, per_row = self._encode(self._to_stored(t))
        with self._lock:
            self._codes = _append_rows(self._codes, codes)
            if ref is not None:
                self._ref = _append_rows(self._ref, ref)
            for name, values in per_row.items():
                setattr(self, name, torch.cat([getattr(self, name), values]))
            self._ids = torch.cat([self._ids, ids])
            self._n += t.shape[0]
            self._next_id = max(self._next_id, int(ids.max()) + 1)
            self._invalidate()

    def _sqnorms_of(self, codec: Codec, codes: Codes) -> torch.Tensor:
        """N(x) of the module docstring, cached at add time; empty for an inner product that
        is used unscaled (unbiased codecs, codecs that store no norm)."""
        if self._scoring == METRIC_INNER_PRODUCT:
            if codec.unbiased_ip:
                return torch.empty(0, dtype=torch.float32, device=self.device)
            try:
                true = codec.true_sqnorms(codes).to(self.device)
            except NotImplementedError:  # e.g. PolarQuant: ||x_hat|| is its stored radius
                return torch.empty(0, dtype=torch.float32, device=self.device)
            rec = codec.reconstruction_sqnorms(codes).to(self.device)
            # A zero vector (true = rec = 0) keeps the scale 1.
            return torch.where(true > 0, rec / true.clamp_min(1e-30), torch.ones_like(rec))
        if codec.unbiased_ip:
            return codec.true_sqnorms(codes).to(self.device)
        return codec.reconstruction_sqnorms(codes).to(self.device)

    def remove_ids(self, ids: Any) -> int:
        """Remove the given ids; returns how many were removed (faiss semantics)."""
        sel = torch.from_numpy(V.id_array(ids))
        with self._lock:
            if self._n == 0 or sel.numel() == 0:
                return 0
            keep = ~torch.isin(self._ids, sel)
            removed = int((~keep).sum())
            if removed:
                keep_d = keep.to(self.device)
                self._codes = self._codes[keep_d]
                if self._ref is not None:  # Codes or an exact-vector tensor: both index by rows
                    self._ref = self._ref[keep_d if isinstance(self._ref, Codes) else keep]
                if self._sqnorms.numel():
                    self._sqnorms = self._sqnorms[keep_d]
                if self._ipcorr.numel():
                    self._ipcorr = self._ipcorr[keep_d]
                self._ids = self._ids[keep]
                self._keep_rows(keep)
                self._n -= removed
                self._invalidate()
                self._blocked, self._blocked_n = None, 0
                self._signs, self._signs_n = None, 0
            return removed

    def _keep_rows(self, keep: torch.Tensor) -> None:
        """Filter per-row state a subclass keeps beyond the codes (lock held)."""

    def _position(self, key: int) -> int:
        key = V.id_scalar(key)
        self.check_mapped()
        if self._pos is None:
            self._pos = {int(i): p for p, i in enumerate(self._ids.tolist())}
        if key not in self._pos:
            raise KeyError(f"id {key} is not in the index")
        return self._pos[key]

    def reconstruct(self, key: int) -> np.ndarray:
        """Decode the vector with id ``key`` -> (d,) float32."""
        p = self._position(key)
        return self._from_stored(self.codec.decode(self._codes[p], like=np.empty(0)))[0]

    def _positions(self, i0: Any, n: Any) -> tuple[int, int]:
        """Checked (i0, n) of ``reconstruct_n``."""
        i0 = V.positive_int(i0, "i0", 0)
        n = V.positive_int(n, "n", 0)
        if i0 + n > self._n:
            raise ValueError(f"i0, n must select positions within 0..{self._n}, got {i0}, {n}")
        self.check_mapped()
        return i0, n

    def reconstruct_n(self, i0: int, n: int) -> np.ndarray:
        """Decode the vectors at positions i0 .. i0+n-1 -> (n, d) float32."""
        i0, n = self._positions(i0, n)
        return self._from_stored(self.codec.decode(self._codes[i0:i0 + n], like=np.empty(0)))

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

    # -- search -------------------------------------------------------------------------------
    def _scores(self, q: torch.Tensor, codes: Codes, sqn: torch.Tensor,
                corr: torch.Tensor | None = None) -> torch.Tensor:
        """(nq, B) similarities (larger is better; for L2 the negated squared distance).
        ``sqn`` is the N(x) slice of these codes (empty for inner product), ``corr`` the
        ``_ipcorr`` slice of a centred inner-product index (None or empty: none)."""
        s = self.codec.score(q, codes)
        if self._scoring == METRIC_L2:
            return 2 * s - sqn[None, :] - (q * q).sum(1, keepdim=True)
        if self._scoring == METRIC_COSINE or sqn.numel():
            s = s / torch.sqrt(sqn.clamp_min(1e-30))[None, :]
        if corr is not None and corr.numel():
            s = s + corr[None, :]
        return s

    def _prepare(self, x: Any) -> tuple[torch.Tensor, bool]:
        q, was_numpy = V.float_matrix(x, "x", self.d)
        q = q.to(device=self.device, dtype=torch.float32)
        if self.metric_type == METRIC_COSINE:
            if q.device.type == "cpu":  # numpy: ~3 us against torch's ~7 for one query
                q = torch.from_numpy(_unit_rows(q.numpy()))
            else:
                q = _normalized(q)
        return q, was_numpy

    def _centre(self, q: torch.Tensor) -> tuple[torch.Tensor, np.ndarray | None]:
        """Prepared queries against centred codes: (q - mu, None) for L2, since
        ||q - x|| = ||(q - mu) - (x - mu)||; else (q, <q, mu> per query), the offset added to
        the inner-product scores. (q, None) without centering."""
        if not self.centered or self._center is None:
            return q, None
        if self._scoring == METRIC_L2:
            return q - self._center, None
        # ops.row_dots: the one-call search's <q, mu> (same bits)
        return q, ops.row_dots(q, self._center).cpu().numpy()

    def _empty_results(self, nq: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """faiss's padding: D = -FLT_MAX (similarities) or +FLT_MAX (L2), I = -1."""
        fill = _FLT_MAX if self.metric_type == METRIC_L2 else -_FLT_MAX
        return (np.full((nq, k), fill, dtype=np.float32), np.full((nq, k), -1, dtype=np.int64))

    def _results(self, vals: np.ndarray, pos: np.ndarray, ids: np.ndarray, k: int
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(D, I) of one block of queries from best-first (vals, pos): ``_put_results`` into the
        padding, or, in the common case of k finite results per query, the arrays themselves
        (the short paths' last steps run cache-cold after a scan: fewer is faster)."""
        if vals.shape[1] == k and np.isfinite(vals).all():
            return np.ascontiguousarray(vals, np.float32), ids[pos]
        D, I = self._empty_results(vals.shape[0], k)
        self._put_results(D, I, vals, pos, ids)
        return D, I

    @staticmethod
    def _put_results(D: np.ndarray, I: np.ndarray, vals: np.ndarray, pos: np.ndarray,
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

    def _allowed_mask(self, allowed_ids: Any, ids: torch.Tensor) -> torch.Tensor | None:
        if allowed_ids is None:
            return None
        sel = torch.from_numpy(V.id_array(allowed_ids, "allowed_ids"))
        return torch.isin(ids, sel).to(self.device)

    def search(self, x: Any, k: int, *, allowed_ids: Sequence[int] | np.ndarray | None = None,
               params: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """k nearest neighbours of each row of x: ``(D, I)`` as faiss returns them.

        ``allowed_ids`` restricts the search to those ids and still returns k results when k of
        them exist (faiss's ``SearchParameters(sel=...)`` idea). ``params`` may be a faiss
        ``SearchParameters`` whose ``sel`` is an ``IDSelectorBatch``/``IDSelectorArray``-like
        object with ``is_member``; prefer ``allowed_ids``.
        """
        k = V.search_k(k, self._n)
        if not self.is_trained:
            raise ValueError("index must be trained before search: center='fit' needs "
                             "train(x) to fit its center")
        self.check_mapped()
        if allowed_ids is None and params is None:
            out = self._search_fast_numpy(x, k)
            if out is not None:
                return out
        q, _ = self._prepare(x)
        q, offsets = self._centre(q)
        if params is not None and getattr(params, "sel", None) is not None and allowed_ids is None:
            sel = params.sel
            allowed_ids = [int(i) for i in self._ids.tolist() if sel.is_member(int(i))]
        nq = q.shape[0]
        D, I = self._empty_results(nq, k)
        with self._lock:  # a consistent snapshot; searching itself needs no lock
            snap = self._snapshot()
        n, ref = snap["n"], snap["ref"]
        if n == 0 or nq == 0:
            return D, I
        mask = self._allowed_mask(allowed_ids, snap["ids"])
        ids_np = snap["ids"].numpy()
        kk = min(n, k * self.k_factor if ref is not None else k)
        for qs in range(0, nq, _QUERY_BLOCK):
            qe = min(nq, qs + _QUERY_BLOCK)
            qb = q if nq <= _QUERY_BLOCK else q[qs:qe]
            best_s, best_p = self._search_block(qb, snap, mask, kk, nq)
            if ref is not None:
                best_s, best_p = self._rerank(qb, best_s, best_p, snap, k)
            vals, pos = best_s.cpu().numpy(), best_p.cpu().numpy()
            if self.metric_type == METRIC_L2:
                vals = -vals
            if offsets is not None:
                vals = vals + offsets[qs:qe, None]
            self._put_results(D[qs:qe], I[qs:qe], vals, pos, ids_np)
        return D, I

    def _search_fast_numpy(self, x: Any, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``search``'s result, bit for bit, for float32 numpy queries on the CPU fast scan
        without a filter or refinement, in as few Python steps as possible; None where that
        does not apply (the general path then also reports bad input). The kernel streams the
        codes through the caches, so every step after it runs cold: at one query (60k x 384,
        1 bit) the general path's ~40 tensor/numpy steps cost as much as the scan itself."""
        if not (type(x) is np.ndarray and x.dtype == np.float32 and x.ndim == 2
                and 0 < x.shape[0] <= _QUERY_BLOCK and x.shape[1] == self.d):
            return None
        with self._lock:
            scan, n, ids, kf = self._scan_state(), self._n, self._ids, self.k_factor
        kk = min(n, k * kf if self.refine is not None else k)  # as search() takes them
        if scan is None or not scan["fast"] or not self._fast_rows_ok(n, kk):
            return None
        one = scan.get("one_call")
        if self.refine is not None and one is None:
            return None
        q = np.ascontiguousarray(x)
        if one is not None:
            # the query's preparation (unit rows, q - mu and ||q - mu||^2, <q, mu>), the check
            # for NaN/Inf and a refinement in the call, with the general path's float
            # operations (those numpy and torch steps cost ~20-60 us per query, cache-cold
            # after the previous scan; a refinement's ~200 more); None: the general path
            # reports the bad input
            return one.search(q, k, kf)
        if not np.isfinite(x).all():
            return None
        if self.metric_type == METRIC_COSINE:
            q = _unit_rows(q)
        qt, offsets = self._centre(torch.from_numpy(q))
        return self._scan_results(self.codec.query_terms(qt), qt, offsets, scan, ids, kk, k)

    def _scan_results(self, qts: list[torch.Tensor], qt: torch.Tensor,
                      offsets: np.ndarray | None, scan: dict[str, Any], ids: torch.Tensor,
                      kk: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(D, I) from the fast scan of prepared query terms: L2 distances with ||qt||^2 (the
        same float operations as _lut_search and search), inner products plus ``offsets``."""
        vals, pos = self._fast_scan(qts, scan, kk)
        if self.metric_type == METRIC_L2:
            vals = -(vals - ops.row_sqnorms(qt)[:, None])
        vals, pos = vals.numpy(), pos.numpy()
        if offsets is not None:
            vals = vals + offsets[:, None]
        return self._results(vals, pos, ids.numpy(), k)

    def _fast_rows_ok(self, n: int, kk: int) -> bool:
        """Enough rows per result for the fast scan's shortlist to pay (digits, n = 1,597,
        k = 100: most rows reach it, and the float paths are faster)."""
        return n > 0 and n >= _FAST_SCAN_ROWS_PER_RESULT * kk

    def _fast_scan(self, qts: list[torch.Tensor], scan: dict[str, Any], kk: int,
                   add: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top kk (similarities, positions) by the CPU fast-scan kernels: all terms of every
        row, or with a prefilter a first pass - the sign plane, or a mixed-width code's leading
        terms (``Codec.first_pass_terms``) - and the full codes of its best ``prefilter * kk``
        rows. ``add`` overrides the row offsets."""
        if scan["signs"] is None:  # with a refinement, which re-ranks them: table scores only
            if scan["scanner"].first:  # the leading terms first (first_pass_terms)
                return scan["scanner"].search(qts, kk, add, k1=self._prefilter * kk)
            return scan["scanner"].search(qts, kk, add, approx=self.refine is not None)
        return scan["signs"].search(qts[:1], kk, add, k1=self._prefilter * kk)

    def _snapshot(self) -> dict[str, Any]:
        """What a search reads, taken together under the lock (call with it held)."""
        return {"codes": self._codes, "ids": self._ids, "sqn": self._sqnorms,
                "corr": self._ipcorr, "ref": self._ref,
                "n": self._n, "scan": self._scan_state(), "ref_lut": self._refine_lut_state()}

    def _refine_lut_state(self) -> dict[str, Any] | None:
        """A TurboQuant-mse refinement on the CPU re-scores its candidates in the rotated
        domain, ``ops.lut_rescore``: score = mult_j <Pi q, c[idx_j]> + add_j is the metric's
        similarity to the reconstruction (l2 without ||q||^2). Decoding them instead (an inverse
        rotation per candidate) was 2/3 of a TQ1,Refine(TQ8) search. None where it does not
        apply (call with the lock held; built once per change of the rows)."""
        if not (isinstance(self.refine, TurboQuant) and self.refine.variant == "mse"
                and self.device.type == "cpu" and self._ref is not None):
            return None
        if self._refine_lut is None:
            packed, _, bits, cents, nrm = self.refine.lut_terms(self._ref)[0]
            rec = self.refine.reconstruction_sqnorms(self._ref).float()
            add = torch.zeros_like(rec)
            if self._scoring == METRIC_L2:  # 2 <q, x_hat> - ||x_hat||^2
                mult, add = 2 * nrm, -rec
            elif self._scoring == METRIC_COSINE:  # <q, x_hat> / ||x_hat||
                mult = nrm / torch.sqrt(rec).clamp_min(1e-30)
            else:
                mult = nrm
            self._refine_lut = {"packed": packed.contiguous(), "cents": cents.float().contiguous(),
                                "mult": mult.float().contiguous(), "add": add.contiguous(),
                                "bits": bits}
        return self._refine_lut

    def _search_block(self, q: torch.Tensor, snap: dict[str, Any], mask: torch.Tensor | None,
                      kk: int, nq_total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Best kk similarities (larger is better; for L2 the negated squared distance) and
        their row positions for the queries q, from the codes."""
        scan, n = snap["scan"], snap["n"]
        if scan is not None and scan["fast"] and self._fast_rows_ok(n, kk):
            return self._lut_search(q, scan, mask, kk, blocked=True)
        # On a GPU the LUT kernel handles query groups itself (fused top-k, no score matrix).
        if scan is not None and self._lut_ok() and (nq_total <= _LUT_MAX_QUERIES
                                                    or self.device.type == "cuda"):
            return self._lut_search(q, scan, mask, kk, blocked=False)
        return self._gemm_search(q, snap["codes"], snap["sqn"], mask, kk, snap["corr"])

    def _gemm_search(self, q: torch.Tensor, codes: Codes, sqn: torch.Tensor,
                     mask: torch.Tensor | None, kk: int, corr: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Running top-kk over blocks of codes scored with the codec (decode block + GEMM)."""
        n = len(codes)
        dev = q.device
        best_s = torch.empty((q.shape[0], 0), device=dev)
        best_p = torch.empty((q.shape[0], 0), dtype=torch.int64, device=dev)
        for cs in range(0, n, _CODE_BLOCK):
            ce = min(n, cs + _CODE_BLOCK)
            s = self._scores(q, codes[cs:ce], sqn[cs:ce],
                             None if corr is None else corr[cs:ce])
            if mask is not None:
                s = s.masked_fill(~mask[cs:ce][None, :], -float("inf"))
            s = torch.cat([best_s, s], dim=1)
            p = torch.cat([best_p, torch.arange(cs, ce, device=dev).expand(q.shape[0], -1)],
                          dim=1)
            top = torch.topk(s, min(kk, s.shape[1]), dim=1)
            best_s, best_p = top.values, torch.gather(p, 1, top.indices)
        return best_s, best_p

    def _lut_search(self, q: torch.Tensor, scan: dict[str, Any], mask: torch.Tensor | None,
                    kk: int, *, blocked: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same similarities as ``_scores`` from lookup tables (fused top-k): the fast-scan
        kernel over the blocked terms, or ``ops.lut_scan`` over the packed mse codes."""
        add = scan["add"]
        if mask is not None:
            add = add.masked_fill(~mask, -float("inf"))
        qts, backend = self.codec.query_terms(q), self.codec.backend
        if blocked:
            vals, pos = self._fast_scan(qts, scan, kk, None if mask is None else add)
        else:  # one mse term (_lut_ok)
            vals, pos = ops.lut_scan(qts[0], scan["packed"][0], scan["cents"][0],
                                     scan["mults"][0], add, scan["bits"][0], kk, backend)
        if self.metric_type == METRIC_L2:  # one ||q||^2 function for all paths (same bits)
            vals = vals - ops.row_sqnorms(q)[:, None]
        return vals, pos

    def _rerank(self, q: torch.Tensor, s: torch.Tensor, p: torch.Tensor, snap: dict[str, Any],
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Re-score the candidates p (nq, kk) with the refinement and keep the best k."""
        vals, pos = self._rerank_np(q, s.cpu().numpy(), p.cpu().numpy(), snap, k)
        return torch.from_numpy(vals).to(q.device), torch.from_numpy(pos).to(q.device)

    def _rerank_np(self, q: torch.Tensor, s: np.ndarray, p: np.ndarray, snap: dict[str, Any],
                   k: int) -> tuple[np.ndarray, np.ndarray]:
        """``_rerank`` on the host, every path's one re-rank: a TurboQuant-mse refinement by
        ``ops.lut_rescore``, exact vectors by ``ops.rescore_topk`` (the metric and the top-k in
        its kernel), other codecs by decoding and the (nq, kk) steps in numpy."""
        nq, kk = p.shape
        ref, lut = snap["ref"], snap["ref_lut"]
        if lut is not None:  # TurboQuant-mse refinement: rotated-domain tables, fused top-k
            qc = q.cpu()
            rows = torch.from_numpy(np.where(np.isfinite(s), p, -1))
            vals, pos = ops.lut_rescore(self.refine.query_terms(qc)[0], lut["packed"],
                                        lut["cents"], lut["mult"], lut["add"], rows,
                                        lut["bits"], min(k, kk))
            vals, pos = vals.numpy(), pos.numpy()
            if self._scoring == METRIC_L2:  # ops.row_sqnorms: the one-call search's (same bits)
                vals = vals - ops.row_sqnorms(qc).numpy()[:, None]
            return vals, pos
        if isinstance(ref, Codes):
            flat = torch.from_numpy(p.reshape(-1)).clamp_min(0).to(ref.device)
            cand = self.refine.decode(ref[flat]).reshape(nq, kk, self.d)  # -1 rows masked below
            qd = q.to(cand.device)
            ip = torch.einsum("qd,qkd->qk", qd, cand).cpu().numpy()
            sqn = (cand * cand).sum(-1).cpu().numpy()
            qn = q.cpu().numpy()
        else:  # exact vectors: ops.rescore_topk, the metric and the top-k in one kernel call
            rows = np.where(np.isfinite(s), p, -1)
            return ops.rescore_topk_np(q.cpu().numpy(), ref.numpy(), rows,
                                       metric_name(self._scoring), min(k, kk))
        if self._scoring == METRIC_L2:
            new = 2 * ip - sqn - (qn * qn).sum(1, keepdims=True)
        elif self._scoring == METRIC_COSINE:
            new = ip / np.maximum(np.sqrt(sqn), np.float32(1e-30))
        else:
            new = ip
        new[~np.isfinite(s)] = -np.inf
        # a full stable sort of kk (= k_factor * k) values is cheaper here than numpy's
        # partition-then-gather steps (~10 us each at one query)
        order = np.argsort(-new, axis=1, kind="stable")[:, :k]
        rows = np.arange(nq)[:, None]
        return new[rows, order], p[rows, order]

    def range_search(self, x: Any, radius: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All results within ``radius``: L2 distance < radius, or similarity > radius.

        Returns faiss's ``(lims, D, I)``: results of query i are D[lims[i]:lims[i+1]].
        """
        if not self.is_trained:
            raise ValueError("index must be trained before range_search: center='fit' needs "
                             "train(x) to fit its center")
        radius = V.finite_float(radius, "radius")
        self.check_mapped()
        q, _ = self._prepare(x)
        q, off = self._centre(q)
        off_t = None if off is None else torch.from_numpy(off).to(q.device)[:, None]
        with self._lock:
            codes, ids, sqn, n = self._codes, self._ids, self._sqnorms, self._n
            corr = self._ipcorr
        lims = np.zeros(q.shape[0] + 1, dtype=np.int64)
        Ds: list[np.ndarray] = []
        Is: list[np.ndarray] = []
        per_query: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(q.shape[0])]
        for cs in range(0, n, _CODE_BLOCK):
            ce = min(n, cs + _CODE_BLOCK)
            s = self._scores(q, codes[cs:ce], sqn[cs:ce], corr[cs:ce])
            if off_t is not None:
                s = s + off_t
            if self.metric_type == METRIC_L2:
                s = -s
                hit = s < radius
            else:
                hit = s > radius
            for i in range(q.shape[0]):
                sel = hit[i].nonzero()[:, 0]
                if sel.numel():
                    sel = sel.cpu()
                    per_query[i].append((s[i].cpu()[sel].numpy(), ids[cs:ce][sel].numpy()))
        for i, parts in enumerate(per_query):
            for dd, ii in parts:
                Ds.append(dd.astype(np.float32))
                Is.append(ii)
            lims[i + 1] = lims[i] + sum(len(dd) for dd, _ in parts)
        D = np.concatenate(Ds) if Ds else np.zeros(0, np.float32)
        I = np.concatenate(Is) if Is else np.zeros(0, np.int64)
        return lims, D, I

    def __repr__(self) -> str:
        ref = f", refine={self.refine!r}" if self.refine is not None else ""
        dev = f", device='{self.device}'" if self.device.type != "cpu" else ""
        return (f"FlatIndex({self.codec!r}, metric={metric_name(self.metric_type)!r}{ref}"
                f"{dev}, ntotal={self._n})")
