"""Ops: one meaning (``ref.py``), several implementations (``cpu.py``, ``cuda.py``), chosen
per call by ``dispatch.pick`` from the table ``dispatch.OPS``. Inputs are made contiguous
here; kernels validate nothing. Prepared ops (``prepared.py``: ``HadamardRotate``,
``FastScan``, ``IVFFastScan``, ``IVFProbe`` and the fused searches' argument structs) settle
their checks, kernel and arrays once for many calls, through rows of the same table.
"""

from __future__ import annotations

import numpy as np
import torch

from . import cpu as _cpu
from . import ref as _ref
from .dispatch import BACKENDS, OPS, available_backends, compiled_cpu, pick
from .kvstep import KVCodeSegment, KVSide, KVStepPlan
from .prepared import (
    MAX_SCAN_TERMS,
    CodeRefinement,
    FastScan,
    FlatSearchArgs,
    FullCodes,
    GraphSearchArgs,
    HadamardRotate,
    IVFFastScan,
    IVFProbe,
    IVFSearchArgs,
    ScanTerm,
    TermsSearchArgs,
    prepare,
)
from .ref import FAST_SCAN_BITS, SignBound, check_sign_bound, fast_scan_row_bytes, row_bytes

__all__ = ["BACKENDS", "OPS", "available_backends", "pick", "pack_bits", "unpack_bits",
           "quantize_pack", "centroid_stats", "turbo_mse_encode", "turbo_mse_decode",
           "hadamard_rotate", "HadamardRotate", "lut_scan",
           "lut_rescore", "block_codes", "block_code_rows",
           "unblock_codes", "fast_scan", "fast_scan_terms",
           "fast_scan_terms_two_stage", "fast_scan_two_stage", "FastScan", "ivf_fast_scan",
           "IVFFastScan", "ivf_probe", "IVFProbe", "rescore_topk", "rescore_topk_np",
           "row_sqnorms", "row_dots", "row_project", "decode_attention", "row_bytes",
           "fast_scan_row_bytes", "FAST_SCAN_BITS", "MAX_SCAN_TERMS", "RESCORE_METRICS",
           "prepare", "ScanTerm", "FullCodes", "CodeRefinement", "FlatSearchArgs",
           "TermsSearchArgs", "IVFSearchArgs", "GraphSearchArgs", "attention_step", "KVSide",
           "KVCodeSegment", "KVStepPlan",
           "threads", "simd_path", "has_cpu_kernels", "SignBound", "check_sign_bound"]


def pack_bits(idx: torch.Tensor, b: int, backend: str = "auto") -> torch.Tensor:
    """(n, d) uint8 indices < 2^b -> (n, ceil(d*b/8)) uint8 packed codes."""
    return pick("pack_bits", idx.device, backend)(idx.contiguous(), b)


def unpack_bits(packed: torch.Tensor, d: int, b: int, backend: str = "auto") -> torch.Tensor:
    """(n, ceil(d*b/8)) uint8 -> (n, d) uint8 indices."""
    return pick("unpack_bits", packed.device, backend)(packed.contiguous(), d, b)


def quantize_pack(y: torch.Tensor, scale: torch.Tensor, thresholds: torch.Tensor, b: int,
                  backend: str = "auto") -> torch.Tensor:
    """Quantize ``y * scale[:, None]`` (float32) against ``thresholds`` and pack to b bits."""
    return pick("quantize_pack", y.device, backend)(
        y.contiguous(), scale.contiguous(), thresholds.contiguous(), b)


def centroid_stats(packed: torch.Tensor, d: int, b: int, centroids: torch.Tensor,
                   y: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                   backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(csq, dot) per row of b-bit packed codes (n, row_bytes(d, b)) with c = centroids[idx]:
    csq = sum_j c_j^2 and, given y (n, d) float32 and scale (n,), dot = sum_j (y_j scale) c_j
    (else None); summed in float64, float32 results (see ``ref.centroid_stats_ref``)."""
    if (y is None) != (scale is None):
        raise ValueError("centroid_stats: give y and scale together, or neither")
    if y is not None:
        y, scale = y.to(torch.float32).contiguous(), scale.to(torch.float32).contiguous()
    return pick("centroid_stats", packed.device, backend)(
        packed.contiguous(), d, b, centroids.to(torch.float32).contiguous(), y, scale)


def turbo_mse_encode(x: torch.Tensor, nrm: torch.Tensor, perms: torch.Tensor,
                     signs: torch.Tensor, p: int, thresholds: torch.Tensor,
                     centroids: torch.Tensor, b: int, fit: bool, backend: str = "auto"
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TurboQuant-mse codes of float32 rows x (n, d) with their norms (n,): (packed (n,
    row_bytes(d, b)) uint8, and with ``fit`` the float32 least-squares multipliers, else None)
    - ``hadamard_rotate``, ``quantize_pack`` by 1 / norm and ``centroid_stats`` in one call
    (``ref.turbo_mse_encode_ref``); the same bits as those ops one by one."""
    return pick("turbo_mse_encode", x.device, backend)(
        x.contiguous(), nrm.to(torch.float32).contiguous(), perms.contiguous(),
        signs.contiguous(), int(p), thresholds.contiguous(),
        centroids.to(torch.float32).contiguous(), b, bool(fit))


def turbo_mse_decode(packed: torch.Tensor, mult: torch.Tensor, perms: torch.Tensor,
                     signs: torch.Tensor, p: int, centroids: torch.Tensor, b: int, d: int,
                     backend: str = "auto") -> torch.Tensor:
    """The reconstruction of TurboQuant-mse codes packed (n, row_bytes(d, b)) uint8 with
    per-row float32 multipliers mult (n): Pi^T (centroids[idx] * mult), (n, d) float32 -
    ``unpack_bits``, the lookup and the inverse ``hadamard_rotate`` in one call
    (``ref.turbo_mse_decode_ref``); the same bits as those steps one by one."""
    return pick("turbo_mse_decode", packed.device, backend)(
        packed.contiguous(), mult.to(torch.float32).contiguous(), perms.contiguous(),
        signs.contiguous(), int(p), centroids.to(torch.float32).contiguous(), b, int(d))


def hadamard_rotate(x: torch.Tensor, perms: torch.Tensor, signs: torch.Tensor, p: int,
                    inverse: bool = False, backend: str = "auto") -> torch.Tensor:
    """Multi-round randomized Hadamard rotation of the rows of x (n, d) -> float32.

    x is float32; the CUDA kernel also reads float16/bfloat16 rows directly (the meaning is
    the rotation of ``x.float()``, which the other backends compute after a cast)."""
    f = pick("hadamard_rotate", x.device, backend)
    if x.dtype != torch.float32 and f is not OPS["hadamard_rotate"].cuda:
        x = x.float()
    return f(x.contiguous(), perms.contiguous(), signs.contiguous(), p, inverse)


def lut_scan(qr: torch.Tensor, packed: torch.Tensor, centroids: torch.Tensor, mult: torch.Tensor,
             add: torch.Tensor, b: int, k: int, backend: str = "auto"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k rows by mult_i * <qr, centroids[idx_i]> + add_i; see ``ref.lut_scan_ref``."""
    return pick("lut_scan", qr.device, backend)(
        qr.contiguous(), packed.contiguous(), centroids.contiguous(), mult.contiguous(),
        add.contiguous(), b, k)


def lut_rescore(qr: torch.Tensor, packed: torch.Tensor, centroids: torch.Tensor,
                mult: torch.Tensor, add: torch.Tensor, rows: torch.Tensor, b: int, k: int,
                backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``lut_scan`` over the listed rows only (rows (nq, r) int64, -1 = none): the exact second
    stage after a coarse scan; see ``ref.lut_rescore_ref``."""
    if rows.dim() != 2 or rows.shape[0] != qr.shape[0]:
        raise ValueError(f"rows must be ({qr.shape[0]}, r), got {tuple(rows.shape)}")
    return pick("lut_rescore", qr.device, backend)(
        qr.contiguous(), packed.contiguous(), centroids.contiguous(), mult.contiguous(),
        add.contiguous(), rows.to(torch.int64).contiguous(), b, k)


def block_codes(packed: torch.Tensor, d: int, b: int, backend: str = "auto") -> torch.Tensor:
    """(n, ceil(d b / 8)) packed rows -> (ceil(n/32), fast_scan_row_bytes(d, b), 32) fast-scan
    layout; see ``ref.block_codes_ref``."""
    if packed.dim() != 2 or packed.shape[1] != row_bytes(d, b):
        raise ValueError(f"packed must be (n, {row_bytes(d, b)}) for d={d}, b={b}, "
                         f"got {tuple(packed.shape)}")
    return pick("block_codes", packed.device, backend)(packed.contiguous(), int(d), int(b))


def block_code_rows(packed: torch.Tensor, rows: torch.Tensor, d: int, b: int,
                    backend: str = "auto") -> torch.Tensor:
    """``block_codes`` of the gathered rows ``packed[rows]`` (rows (n,) int32; -1: a zero
    row), without the gathered copy; see ``ref.block_code_rows_ref``."""
    if packed.dim() != 2 or packed.shape[1] != row_bytes(d, b):
        raise ValueError(f"packed must be (n, {row_bytes(d, b)}) for d={d}, b={b}, "
                         f"got {tuple(packed.shape)}")
    if rows.dim() != 1 or rows.dtype != torch.int32:
        raise ValueError(f"rows must be a 1-D int32 tensor, got {rows.dtype} of shape "
                         f"{tuple(rows.shape)}")
    if rows.numel() and (int(rows.min()) < -1 or int(rows.max()) >= packed.shape[0]):
        raise ValueError(f"rows must be -1 or rows of packed (0..{packed.shape[0] - 1})")
    return pick("block_code_rows", packed.device, backend)(packed.contiguous(),
                                                          rows.contiguous(), int(d), int(b))


def unblock_codes(blocked: torch.Tensor, n: int, d: int, b: int) -> torch.Tensor:
    """Inverse of ``block_codes``: the first n rows of a fast-scan layout as packed rows (n,
    ceil(d b / 8)) (torch on the layout's device; a memory-bound transpose for b != 3)."""
    return _ref.unblock_codes(blocked, int(n), int(d), int(b))


def fast_scan(qr: torch.Tensor, blocked: torch.Tensor, n: int, centroids: torch.Tensor,
              mult: torch.Tensor, add: torch.Tensor, b: int, k: int, backend: str = "auto"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``lut_scan`` over the fast-scan layout (b in 1, 2, 3, 4): the CPU kernel sums 8-bit tables
    with SIMD shuffles and re-scores a provably sufficient shortlist exactly, so results agree
    with ``lut_scan`` within float rounding."""
    if b not in FAST_SCAN_BITS:
        raise ValueError(f"b must be one of {list(FAST_SCAN_BITS)} for fast_scan, got {b}")
    return pick("fast_scan", qr.device, backend)(
        qr.contiguous(), blocked.contiguous(), int(n), centroids.contiguous(),
        mult.contiguous(), add.contiguous(), b, k)


def _check_terms(nt: int, blocked: list, centroids: list, mults: list, bits: list[int]) -> None:
    if not 1 <= nt <= MAX_SCAN_TERMS or not (len(blocked) == len(centroids) == len(mults)
                                             == len(bits) == nt):
        raise ValueError(f"fast_scan_terms needs 1 to {MAX_SCAN_TERMS} terms with blocked, "
                         f"centroids, mults and bits each; got {nt}, {len(blocked)}, "
                         f"{len(centroids)}, {len(mults)}, {len(bits)}")
    for b in bits:
        if b not in FAST_SCAN_BITS:
            raise ValueError(f"bits must be in {list(FAST_SCAN_BITS)} for fast_scan_terms, got {b}")


def fast_scan_two_stage(qr: torch.Tensor, signs: torch.Tensor, n: int, c1: torch.Tensor,
                        packed: torch.Tensor, b: int, centroids: torch.Tensor, mult: torch.Tensor,
                        add: torch.Tensor, add1: torch.Tensor, k1: int, k: int,
                        backend: str = "auto", mult1: torch.Tensor | None = None,
                        bound: SignBound | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k by the full b-bit codes ``packed`` among the k1 best rows of a first pass over
    their sign plane ``signs`` (1-bit codes, fast-scan layout, centroids c1, row offsets add1;
    add is the full codes'; the first pass's per-row multipliers mult1, default mult): a
    two-stage scan
    that reads b times fewer bytes per row in its first pass. Heuristic: a row outside the
    sign pass's k1 best is never scored; see ``ref.fast_scan_two_stage_ref``. ``bound`` (a
    ``SignBound``) selects stage 1's rows by their error bounds instead (k1 unused; see there)."""
    bound = check_sign_bound(bound)
    return pick("fast_scan_two_stage", qr.device, backend)(
        qr.contiguous(), signs.contiguous(), int(n), c1.contiguous(), packed.contiguous(),
        int(b), centroids.contiguous(), mult.contiguous(), add.contiguous(), add1.contiguous(),
        int(k1), int(k), None if mult1 is None else mult1.contiguous(), bound)


def fast_scan_terms(qrs: list[torch.Tensor], blocked: list[torch.Tensor], n: int,
                    centroids: list[torch.Tensor], mults: list[torch.Tensor], add: torch.Tensor,
                    bits: list[int], k: int, backend: str = "auto"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``fast_scan`` with several codes per row (1 to 8 terms): score_i = add_i +
    sum_t mults[t]_i <qrs[t], centroids[t][idx_t,i]>; a row's error bound is the sum of its
    terms' bounds, the shortlist is re-scored exactly. One term is ``fast_scan`` (which also
    batches several queries per pass). See ``ref.fast_scan_terms_ref``; ``FastScan`` prepares
    the codes once for many searches."""
    _check_terms(len(qrs), blocked, centroids, mults, bits)
    terms = [ScanTerm(t, c, m, int(b)) for t, c, m, b in zip(blocked, centroids, mults, bits,
                                                               strict=True)]
    return FastScan(terms, n, add, backend).search(qrs, k)


def fast_scan_terms_two_stage(qrs: list[torch.Tensor], blocked: list[torch.Tensor],
                              packed: list[torch.Tensor], n: int, centroids: list[torch.Tensor],
                              mults: list[torch.Tensor], add: torch.Tensor, bits: list[int],
                              first: int, k1: int, k: int, backend: str = "auto"
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``fast_scan_terms`` in two stages: the k1 best rows by add_i plus the first ``first``
    terms (their 8-bit table scores in the CPU kernel), then the top k of those by every term,
    scored exactly from the terms' ``packed`` (n, ceil(d_t b_t / 8)) rows. A heuristic like
    ``fast_scan_two_stage``: a row outside the first pass's k1 best is never scored. For
    mixed-width codes whose leading runs hold most of the variance (``PCAIndex``). See
    ``ref.fast_scan_terms_two_stage_ref``."""
    _check_terms(len(qrs), blocked, centroids, mults, bits)
    if not 1 <= first <= len(qrs) or len(packed) != len(qrs) or k1 < 1:
        raise ValueError(f"first must be 1 to {len(qrs)} with packed codes for every term and "
                         f"k1 >= 1, got first={first}, {len(packed)} packed, k1={k1}")
    return pick("fast_scan_terms_two_stage", qrs[0].device, backend)(
        [t.contiguous() for t in qrs], [t.contiguous() for t in blocked],
        [t.contiguous() for t in packed], int(n), [t.contiguous() for t in centroids],
        [t.contiguous() for t in mults], add.contiguous(), [int(b) for b in bits], int(first),
        int(k1), int(k))


def ivf_fast_scan(qr: torch.Tensor, blocked: torch.Tensor, centroids: torch.Tensor,
                  mult: torch.Tensor, add: torch.Tensor, list_blocks: torch.Tensor,
                  probes: torch.Tensor, offsets: torch.Tensor, b: int, k: int,
                  backend: str = "auto", approx: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``fast_scan`` over inverted lists (consecutive block ranges) with a score offset per
    (query, probed list); see ``ref.ivf_fast_scan_ref``. ``approx=True``: the CPU kernel ranks
    by its 8-bit tables and returns those scores, re-scoring nothing exactly (for a first
    stage that a refinement re-ranks; the scores are within the tables' error of the exact)."""
    if b not in FAST_SCAN_BITS:
        raise ValueError(f"b must be one of {list(FAST_SCAN_BITS)} for ivf_fast_scan, got {b}")
    return pick("ivf_fast_scan", qr.device, backend)(
        qr.contiguous(), blocked.contiguous(), centroids.contiguous(), mult.contiguous(),
        add.contiguous(), list_blocks.to(torch.int64).contiguous(),
        probes.to(torch.int64).contiguous(), offsets.to(torch.float32).contiguous(), b, k,
        approx)


def ivf_probe(q: torch.Tensor, centroids: torch.Tensor, csq: torch.Tensor, l2: bool,
              nprobe: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(probes (nq, nprobe) int64, scores float32): each query's nprobe best lists, best first;
    see ``ref.ivf_probe_ref``. On the CPU one kernel call (for a few queries: a big batch is
    a GEMM's job)."""
    nlist = centroids.shape[0]
    if not 1 <= nprobe <= nlist:
        raise ValueError(f"nprobe must be in 1..{nlist}, got {nprobe}")
    return pick("ivf_probe", q.device, backend)(
        q.to(torch.float32).contiguous(), centroids.to(torch.float32).contiguous(),
        csq.to(torch.float32).contiguous(), bool(l2), int(nprobe))


RESCORE_METRICS = ("ip", "l2", "cosine")


def has_cpu_kernels() -> bool:
    """Whether the compiled CPU kernels (``tqvec._C``) are loaded."""
    return _cpu.available()


def threads() -> int:
    """Threads the compiled kernels run on (torch's setting)."""
    return _cpu.threads()


def simd_path() -> str:
    """The compiled fast scans' vector path on this CPU: "avx2" (the default where the CPU has
    it), "avx2+vbmi" (the default where the CPU also has AVX-512 F, BW and VBMI: the 3-bit
    scans look up a pair's 64-entry table in one ``vpermb``), "avx2+vbmi+vnni" (and VNNI: the
    1, 2 and 4-bit scans look up four code bytes' tables in one ``vpermb`` and add a row's
    four lookups in one ``vpdpbusd``; batched exact 4-bit scans by int8 dot products),
    "avx512" (opt-in with ``TQVEC_SIMD=avx512`` on a CPU with AVX-512 F and BW: the 1, 2 and
    4-bit flat and IVF scans by 512-bit ``vpshufb``, the rest on AVX2), "neon" (aarch64),
    "scalar" (``TQVEC_SIMD=scalar``, or no AVX2), or "none" (kernels not built).
    ``TQVEC_SIMD=avx2`` keeps every scan on AVX2. The variable is read once per process; every
    path gives the same bits."""
    return _cpu.simd_path()


def row_sqnorms(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """||x_i||^2 of each row of x (n, d): (n,) float32. An L2 search subtracts ||q||^2 with this
    one function in every path, the one-call search (``FlatSearch``) included, so that they agree
    bit for bit (a torch sum reduces in another order)."""
    if x.dim() != 2:
        raise ValueError(f"x must be (n, d), got shape {tuple(x.shape)}")
    return pick("row_sqnorms", x.device, backend)(x.to(torch.float32).contiguous())


def row_dots(x: torch.Tensor, v: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """<x_i, v> of each row of x (n, d) with v (d,): (n,) float32. A centred inner-product
    index adds <q, mu> with this one function in every path, ``FlatSearch`` included (same
    bits)."""
    if x.dim() != 2 or v.shape != (x.shape[1],):
        raise ValueError(f"x must be (n, d) and v (d,), got shapes {tuple(x.shape)} and "
                         f"{tuple(v.shape)}")
    return pick("row_dots", x.device, backend)(x.to(torch.float32).contiguous(),
                                                 v.to(x.device, torch.float32).contiguous())


def row_project(x: torch.Tensor, W: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """x (n, d) W (d, m): (n, m) float32 - a PCA index's query map. Its composed search and its
    one-call search (``TermsSearch``) both use this one function (the compiled kernel sums
    each entry in order by fused multiply-adds), so that they agree bit for bit."""
    if x.dim() != 2 or W.dim() != 2 or W.shape[0] != x.shape[1]:
        raise ValueError(f"x must be (n, d) and W (d, m), got shapes {tuple(x.shape)} and "
                         f"{tuple(W.shape)}")
    return pick("row_project", x.device, backend)(x.to(torch.float32).contiguous(),
                                                    W.to(x.device, torch.float32).contiguous())


def rescore_topk(q: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, metric: str, k: int,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The best k of the candidate rows (nq, kk) int64 (-1 = none) of the exact vectors x (n, d)
    by the metric's similarity to q (nq, d) ("ip", "l2": -||q - x||^2, "cosine"): (vals, rows),
    best first; see ``ref.rescore_topk_ref``. Refine(Flat)'s second stage."""
    if metric not in RESCORE_METRICS:
        raise ValueError(f"metric must be one of {list(RESCORE_METRICS)}, got {metric!r}")
    if rows.dim() != 2 or rows.shape[0] != q.shape[0]:
        raise ValueError(f"rows must be ({q.shape[0]}, kk), got {tuple(rows.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return pick("rescore_topk", q.device, backend)(
        q.to(torch.float32).contiguous(), x.to(torch.float32).contiguous(),
        rows.to(torch.int64).contiguous(), metric, k)


def rescore_topk_np(q: np.ndarray, x: np.ndarray, rows: np.ndarray, metric: str, k: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """``rescore_topk`` on host numpy arrays (float32 q, x, int64 rows), for the indexes'
    refinement: one kernel call, no conversions (at one query the torch wrapper cost as much as
    the kernel)."""
    if compiled_cpu("rescore_topk", torch.device("cpu"), "auto"):
        return _cpu.rescore_topk_np(q, x, rows, metric, k)
    vals, idx = rescore_topk(torch.from_numpy(q), torch.from_numpy(x), torch.from_numpy(rows),
                             metric, k)
    return vals.numpy(), idx.numpy()


def decode_attention(qr: torch.Tensor, qbias: torch.Tensor, kpacked: torch.Tensor,
                     knorm: torch.Tensor, kcent: torch.Tensor, kb: int, vpacked: torch.Tensor,
                     vnorm: torch.Tensor, vcent: torch.Tensor, vb: int, lo: torch.Tensor,
                     hi: torch.Tensor, scale: float, backend: str = "auto"
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, l, acc) softmax state of decode attention over key/value codes; see
    ``ref.decode_attention_ref``: the CUDA kernel on GPUs, the compiled kernel on the CPU."""
    f = pick("decode_attention", qr.device, backend)
    return f(qr.contiguous(), qbias.contiguous(), kpacked.contiguous(), knorm.contiguous(),
             kcent.contiguous(), kb, vpacked.contiguous(), vnorm.contiguous(),
             vcent.contiguous(), vb, lo.to(torch.int32).contiguous(),
             hi.to(torch.int32).contiguous(), scale)


def attention_step(q: torch.Tensor, scale: float, plan: KVStepPlan, ranges: list[int],
                   exact: list[tuple[torch.Tensor, torch.Tensor]],
                   bias: list[torch.Tensor | None] | None = None, backend: str = "auto"
                   ) -> torch.Tensor:
    """Attention of a KV-cache layer's rows q (bh, R, d) float32 over its stored tokens: the
    plan's code segments (``KVStepPlan``; segment i's live tokens [ranges[2i],
    ranges[2i+1])), its sink and this step's other full-precision (keys, values) pairs, in
    one softmax; ``bias`` one additive (bh, R, n) mask or None per full-precision pair (sink
    first), or None when every row sees every token. Meaning: ``kvstep.compose_attention_step``;
    on the CPU one compiled call where nothing is masked (csrc/cpu/attention.cpp), on a GPU the
    composition over the CUDA decode-attention kernel. Returns (bh, R, d) float32."""
    return pick("attention_step", q.device, backend)(q.contiguous(), scale, plan, ranges,
                                                     exact, bias)
