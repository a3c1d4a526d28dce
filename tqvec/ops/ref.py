"""Plain-torch reference ops: each defines the meaning of the op of the same name.

Layouts: ``idx`` (n, d) uint8; ``packed`` (n, ceil(d*b/8)) uint8, row-major, LSB-first bit
stream (index j occupies stream bits [j*b, (j+1)*b); stream bit t is bit t % 8 of byte t // 8;
trailing pad bits are 0). Float inputs are float32 and contiguous (the dispatcher ensures it).
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import torch

__all__ = ["pack_bits_ref", "unpack_bits_ref", "quantize_pack_ref", "hadamard_rotate_ref",
           "lut_scan_ref", "lut_rescore_ref", "fast_scan_two_stage_ref", "block_codes_ref",
           "block_code_rows_ref",
           "fast_scan_ref", "fast_scan_terms_ref", "fast_scan_terms_two_stage_ref",
           "decode_attention_ref", "row_bytes", "SignBound", "check_sign_bound"]

FAST_SCAN_BITS = (1, 2, 3, 4)  # widths with a fast-scan layout (3 bits: pairs, see block_codes_ref)
BLOCK_ROWS = 32


class SignBound(NamedTuple):
    """A sign-plane first pass bounded by its error (``fast_scan_two_stage_ref``): sigma (0:
    no bound; the error's standard deviations times the codec's noise), the codec's gain and
    cnorm (``SignTermError``), and min_sin, the floor of the row angle's sine."""

    sigma: float
    gain: float
    cnorm: float
    min_sin: float = 0.0


def check_sign_bound(bound: SignBound | None) -> SignBound | None:
    """``bound`` checked (a ``SignBound`` of finite values: sigma >= 0, gain and cnorm > 0,
    min_sin in [0, 1]) and as floats, or None for none (sigma 0 counts as none)."""
    if bound is None:
        return None
    if not isinstance(bound, SignBound):
        raise TypeError(f"bound must be an ops.SignBound or None, got {type(bound).__name__}")
    b = SignBound(*(float(v) for v in bound))
    ok = all(v == v and abs(v) < float("inf") for v in b)
    if not (ok and b.sigma >= 0 and b.gain > 0 and b.cnorm > 0 and 0 <= b.min_sin <= 1):
        raise ValueError(f"bound must hold finite sigma >= 0, gain > 0, cnorm > 0 and min_sin "
                         f"in [0, 1], got {bound}")
    return b if b.sigma > 0 else None


def row_bytes(d: int, b: int) -> int:
    return (d * b + 7) // 8


def fast_scan_row_bytes(d: int, b: int) -> int:
    """Bytes per row of the fast-scan layout: the packed row, or 3 per 8 coordinates at b = 3."""
    return 3 * -(-d // 8) if b == 3 else row_bytes(d, b)


def pack_bits_ref(idx: torch.Tensor, b: int) -> torch.Tensor:
    n, d = idx.shape
    rb = row_bytes(d, b)
    shifts = torch.arange(b, device=idx.device, dtype=torch.int32)
    bits = (idx.to(torch.int32)[..., None] >> shifts) & 1  # (n, d, b), LSB of each index first
    stream = bits.reshape(n, d * b)
    stream = torch.nn.functional.pad(stream, (0, rb * 8 - d * b))
    weights = (1 << torch.arange(8, device=idx.device, dtype=torch.int32))
    return (stream.view(n, rb, 8) * weights).sum(-1).to(torch.uint8)


def unpack_bits_ref(packed: torch.Tensor, d: int, b: int) -> torch.Tensor:
    n, rb = packed.shape
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32)[..., None] >> shifts) & 1).reshape(n, rb * 8)[:, : d * b]
    weights = (1 << torch.arange(b, device=packed.device, dtype=torch.int32))
    return (stream.reshape(n, d, b) * weights).sum(-1).to(torch.uint8)


def quantize_pack_ref(y: torch.Tensor, scale: torch.Tensor, thresholds: torch.Tensor, b: int
                      ) -> torch.Tensor:
    """Scalar-quantize ``y * scale[:, None]`` against ascending ``thresholds`` (K-1 values) and
    pack: index = #{t : thresholds[t] <= v} (TurboQuant Algorithm 1, nearest centroid, since
    the thresholds are the midpoints between centroids)."""
    v = y * scale[:, None]
    idx = torch.searchsorted(thresholds, v, right=True).to(torch.uint8)
    return pack_bits_ref(idx, b)


def centroid_stats_ref(packed: torch.Tensor, d: int, b: int, centroids: torch.Tensor,
                       y: torch.Tensor | None = None, scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row of b-bit packed codes, with c = centroids[idx]: (sum_j c_j^2, sum_j v_j c_j or
    None), v = y * scale[:, None] (float32, the product ``quantize_pack`` compared); both summed
    in float64 and rounded to float32 once. What the fitted and the unbiased scales and an L2
    index's ||x_hat||^2 need, without a (n, d) float tensor of centroids."""
    c = centroids.to(torch.float64)[unpack_bits_ref(packed, d, b).long()]
    csq = (c * c).sum(1).float()
    if y is None:
        return csq, None
    return csq, ((y * scale[:, None]).to(torch.float64) * c).sum(1).float()


def turbo_mse_encode_ref(x: torch.Tensor, nrm: torch.Tensor, perms: torch.Tensor,
                         signs: torch.Tensor, p: int, thresholds: torch.Tensor,
                         centroids: torch.Tensor, b: int, fit: bool
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TurboQuant-mse codes of float32 rows x (n, d) with their norms nrm (n): the rotated rows
    scaled by 1 / norm (0 for a zero row) quantized and packed, and with ``fit`` each row's
    least-squares multiplier nrm <u, c> / ||c||^2 (u the scaled row, c its centroids), else
    None - the codec's steps (``TurboQuant.encode_block``) in one op."""
    inv = torch.where(nrm > 0, nrm.reciprocal(), 0.0)
    y = hadamard_rotate_ref(x, perms, signs, p)
    packed = quantize_pack_ref(y, inv, thresholds, b)
    if not fit:
        return packed, None
    csq, dot = centroid_stats_ref(packed, x.shape[1], b, centroids, y, inv)
    return packed, nrm * dot / csq


def turbo_mse_decode_ref(packed: torch.Tensor, mult: torch.Tensor, perms: torch.Tensor,
                         signs: torch.Tensor, p: int, centroids: torch.Tensor, b: int, d: int
                         ) -> torch.Tensor:
    """The reconstruction of TurboQuant-mse codes packed (n, row_bytes(d, b)) with per-row
    multipliers mult (n): Pi^T (centroids[idx] * mult) as float32 (n, d) - the codec's steps
    (``TurboQuant.decode_block``) in one op."""
    y = centroids[unpack_bits_ref(packed, d, b).long()] * mult[:, None]
    return hadamard_rotate_ref(y, perms, signs, p, inverse=True)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of the rows of x (n, p), butterfly order
    h = 1, 2, 4, ...; pairs (j, j + h) within blocks of 2h."""
    n, p = x.shape
    h = 1
    while h < p:
        v = x.reshape(n, p // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        x = torch.stack((a + b, a - b), dim=2).reshape(n, p)
        h *= 2
    return x


def hadamard_rotate_ref(x: torch.Tensor, perms: torch.Tensor, signs: torch.Tensor, p: int,
                        inverse: bool = False) -> torch.Tensor:
    """Multi-round randomized Hadamard rotation (see tqvec.random.HadamardRotation).

    Forward round r: z = x[:, perms[r]] * signs[r]; z[:, :p] = H z[:, :p] / sqrt(p); if p < d,
    z[:, d-p:] = H z[:, d-p:] / sqrt(p). The inverse runs the rounds backwards.
    """
    n, d = x.shape
    s = torch.tensor(1.0 / (p ** 0.5), dtype=torch.float32, device=x.device)
    z = x
    rounds = perms.shape[0]
    order = range(rounds - 1, -1, -1) if inverse else range(rounds)
    for r in order:
        if not inverse:
            z = z[:, perms[r]] * signs[r]
            z[:, :p] = _fwht(z[:, :p]) * s
            if p < d:
                z[:, d - p:] = _fwht(z[:, d - p:]) * s
        else:
            z = z.clone()
            if p < d:
                z[:, d - p:] = _fwht(z[:, d - p:]) * s
            z[:, :p] = _fwht(z[:, :p]) * s
            out = torch.empty_like(z)
            out[:, perms[r]] = z * signs[r]
            z = out
    return z


def lut_scan_ref(qr: torch.Tensor, packed: torch.Tensor, centroids: torch.Tensor,
                 mult: torch.Tensor, add: torch.Tensor, b: int, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of score_i = mult_i * <qr, centroids[idx_i]> + add_i over packed scalar codes.

    qr (nq, d) float32; packed (n, ceil(d*b/8)) uint8; centroids (2^b,); mult, add (n,)
    float32 (add = -inf excludes a row). Returns (values (nq, k) float32 best first, positions
    (nq, k) int64), padded with -inf / -1 when fewer than k rows have a finite score.
    (The TurboQuant estimator of Algorithm 1 with a per-row affine map, which covers inner
    product, L2 to the reconstruction and cosine.)
    """
    yhat = centroids[unpack_bits_ref(packed, qr.shape[1], b).long()]  # (n, d)
    return _topk_padded((qr @ yhat.T) * mult[None, :] + add[None, :], k)


def lut_rescore_ref(qr: torch.Tensor, packed: torch.Tensor, centroids: torch.Tensor,
                    mult: torch.Tensor, add: torch.Tensor, rows: torch.Tensor, b: int, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``lut_scan_ref`` restricted to listed rows: query i scores only rows[i, :] ((nq, r)
    int64, -1 = no row) and returns the top k of them as row positions (the second stage of a
    coarse-then-exact scan)."""
    nq, r = rows.shape
    ok = rows >= 0
    safe = torch.where(ok, rows, torch.zeros_like(rows))
    yhat = centroids[unpack_bits_ref(packed[safe.reshape(-1)], qr.shape[1], b).long()]
    s = (yhat.reshape(nq, r, -1) * qr[:, None, :]).sum(-1) * mult[safe] + add[safe]
    s = torch.where(ok, s, torch.full_like(s, -float("inf")))
    vals, j = _topk_padded(s, k)
    pos = torch.where(j >= 0, torch.gather(safe, 1, j.clamp_min(0)), j)
    return vals, pos


def fast_scan_two_stage_ref(qr: torch.Tensor, signs: torch.Tensor, n: int, c1: torch.Tensor,
                            packed: torch.Tensor, b: int, centroids: torch.Tensor,
                            mult: torch.Tensor, add: torch.Tensor, add1: torch.Tensor, k1: int,
                            k: int, mult1: torch.Tensor | None = None,
                            bound: SignBound | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k by the full b-bit codes among the top k1 by the sign plane: stage 1 is
    ``fast_scan_ref`` over ``signs`` (1-bit codes in the fast-scan layout, centroids c1, row
    offsets add1: e.g. -||x_1bit||^2 for L2, the distance to the 1-bit reconstruction), stage
    2 ``lut_rescore_ref`` over ``packed`` with the offsets add; stage 1 scales a row by mult1
    where given (its own per-row scale), else by mult. The CPU kernel ranks stage 1
    by its 7-bit tables (no exact re-score), so its candidate set may differ at the k1-th
    place: a heuristic first pass, which is what it is for (the exact scan is ``fast_scan``).
    ``signs`` may cover only the first d1 = 8 * signs.shape[1] < d coordinates (1-bit codes:
    a prefix of the coordinates is their coarse pass); stage 1 then scores qr[:, :d1].

    ``bound`` (a ``SignBound`` with sigma > 0) bounds stage 1 by its error instead of a count
    (k1 unused): mult1 and add1 must then make stage 1 the full codes' estimate (the rows' gains
    times their full multipliers, the full offsets; ``Codec.sign_term_error``). Row i's stage-1
    score s_i = mult1_i T_i + add1_i (T_i = <qr, c1[sign_i]>) is within
    e_i = |mult1_i| sigma ||qr|| sin_i / gain of its full score, where
    cos_i = gain T_i / (cnorm ||qr||) and sin_i = sqrt(max(min_sin^2, 1 - cos_i^2)). The rows
    with s_i + e_i at least the k-th largest s_i - e_i are the candidates. The k of them with
    the best s_i are re-scored first, then the rest by their upper bounds s_i + e_i, largest
    first (ties by the lower row), until the next one's is below the k-th best full score so
    far: a row that cannot reach the results is not scored (RaBitQ's pattern: the bound
    against the exact k-th, not against other bounds). The CPU kernel's stage 1 uses its
    tables' scores and widens each bound by their error, so its rows nearly always include
    these."""
    d1 = sign_plane_dims(signs.shape[1], qr.shape[1])
    if bound is not None and bound.sigma > 0:
        q1 = qr[:, :d1].contiguous()
        m1 = mult if mult1 is None else mult1
        T = q1 @ c1[unpack_bits_ref(unblock_codes(signs, n, d1, 1), d1, 1).long()].T
        s = T * m1[None, :] + add1[None, :]
        qn = q1.norm(dim=1, keepdim=True)
        cos = bound.gain * T / (bound.cnorm * qn).clamp_min(1e-30)
        sin = torch.sqrt(torch.clamp(1 - cos * cos, min=bound.min_sin ** 2))
        e = (bound.sigma / bound.gain) * qn * sin * m1.abs()[None, :]
        lb = torch.where(torch.isfinite(s), s - e, torch.full_like(s, -float("inf")))
        if n == 0:
            return _topk_padded(s, k)
        th = torch.topk(lb, min(k, n), dim=1).values[:, -1:]
        keep = (s + e >= th) & torch.isfinite(s)
        scored = [_scored_by_bound(s[i], s[i] + e[i], keep[i], qr[i], packed, centroids, mult,
                                   add, b, k) for i in range(qr.shape[0])]
        cand = torch.full((qr.shape[0], max(1, max(len(r) for r in scored))), -1)
        for i, r in enumerate(scored):
            cand[i, :len(r)] = r
        return lut_rescore_ref(qr, packed, centroids, mult, add, cand, b, k)
    _, cand = fast_scan_ref(qr[:, :d1].contiguous(), signs, n, c1,
                            mult if mult1 is None else mult1, add1, 1, min(k1, n) if n else k1)
    return lut_rescore_ref(qr, packed, centroids, mult, add, cand, b, k)


def _scored_by_bound(est: torch.Tensor, ub: torch.Tensor, keep: torch.Tensor, q: torch.Tensor,
                     packed: torch.Tensor, centroids: torch.Tensor, mult: torch.Tensor,
                     add: torch.Tensor, b: int, k: int) -> torch.Tensor:
    """The candidate rows (``keep``) a bounded stage 1 re-scores for one query q: the k with
    the best estimates ``est`` (ties by the lower row), then the rest by their upper bounds
    ``ub``, largest first (ties by the lower row), up to the first whose bound is below the
    k-th best full score of the rows before it."""
    rows = torch.nonzero(keep).flatten()
    if len(rows) <= k:
        return rows
    seeds = rows[torch.argsort(-est[rows], stable=True)[:k]]
    rest = rows[~torch.isin(rows, seeds)]
    rows = torch.cat([seeds, rest[torch.argsort(-ub[rest], stable=True)]])
    yhat = centroids[unpack_bits_ref(packed[rows], q.shape[0], b).long()]
    f = ((yhat @ q) * mult[rows] + add[rows]).tolist()
    best = f[:k]  # a min-heap of the k best full scores so far
    heapq.heapify(best)
    for r in range(k, len(rows)):
        if float(ub[rows[r]]) < best[0]:
            return rows[:r]
        if f[r] > best[0]:
            heapq.heapreplace(best, f[r])
    return rows


def sign_plane_dims(row_bytes: int, d: int) -> int:
    """The coordinates a two-stage scan's sign plane of ``row_bytes`` bytes per row covers: all
    d where row_bytes = ceil(d / 8), else the first 8 * row_bytes (a prefix)."""
    if row_bytes == -(-d // 8):
        return d
    if not 1 <= row_bytes or 8 * row_bytes >= d:
        raise ValueError(f"signs must have ceil(d1 / 8) bytes per row for d1 <= d = {d}, got "
                         f"{row_bytes}")
    return 8 * row_bytes


def _topk_padded(s: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k of each row of the score matrix s (nq, n), best first, -inf / -1 past the finite
    scores (ties by the lower position, as torch.topk on CPU)."""
    nq, n = s.shape
    vals = torch.full((nq, k), -float("inf"), dtype=torch.float32, device=s.device)
    pos = torch.full((nq, k), -1, dtype=torch.int64, device=s.device)
    if n == 0:
        return vals, pos
    top = torch.topk(s, min(k, n), dim=1)
    ok = torch.isfinite(top.values)
    m = top.values.shape[1]
    vals[:, :m] = torch.where(ok, top.values, vals[:, :m])
    pos[:, :m] = torch.where(ok, top.indices, pos[:, :m])
    return vals, pos


def _pairs3(idx: torch.Tensor) -> torch.Tensor:
    """3-bit indices (n, d) -> rows of the b = 3 fast-scan layout (n, 3 ceil(d/8)): per group of
    8 coordinates (4 pairs, pair p = coordinates 2p, 2p+1) byte 0 = hi(p0) | hi(p1) << 4,
    byte 1 = hi(p2) | hi(p3) << 4, byte 2 = lo(p0) | lo(p1) << 2 | lo(p2) << 4 | lo(p3) << 6,
    with hi = (i0 >> 1) | (i1 >> 1) << 2 and lo = (i0 & 1) | (i1 & 1) << 1. A pair's 6 bits index
    one 64-entry table (four 16-entry SIMD shuffles); 3 bits per coordinate, as packed."""
    n, d = idx.shape
    g = -(-d // 8)
    x = torch.zeros((n, 8 * g), dtype=torch.int32, device=idx.device)
    x[:, :d] = idx.to(torch.int32)
    x = x.view(n, g, 4, 2)
    hi = (x[..., 0] >> 1) | ((x[..., 1] >> 1) << 2)  # (n, g, 4)
    lo = (x[..., 0] & 1) | ((x[..., 1] & 1) << 1)
    out = torch.stack([hi[..., 0] | (hi[..., 1] << 4), hi[..., 2] | (hi[..., 3] << 4),
                       lo[..., 0] | (lo[..., 1] << 2) | (lo[..., 2] << 4) | (lo[..., 3] << 6)],
                      dim=-1)
    return out.reshape(n, 3 * g).to(torch.uint8)


def _unpairs3(rows: torch.Tensor, d: int) -> torch.Tensor:
    """Inverse of ``_pairs3``: (n, 3 ceil(d/8)) -> (n, d) uint8 indices."""
    n = rows.shape[0]
    r = rows.to(torch.int32).view(n, rows.shape[1] // 3, 3)
    hi = torch.stack([r[..., 0] & 15, r[..., 0] >> 4, r[..., 1] & 15, r[..., 1] >> 4], dim=-1)
    lo = torch.stack([(r[..., 2] >> (2 * p)) & 3 for p in range(4)], dim=-1)
    i0 = ((hi & 3) << 1) | (lo & 1)
    i1 = ((hi >> 2) << 1) | (lo >> 1)
    return torch.stack([i0, i1], dim=-1).reshape(n, 8 * (rows.shape[1] // 3))[:, :d].to(torch.uint8)


def block_codes_ref(packed: torch.Tensor, d: int, b: int) -> torch.Tensor:
    """Fast-scan layout: packed rows (n, ceil(d b / 8)) -> (ceil(n/32), fb, 32) uint8 with
    ``blocked[j, p, t] = row[32 j + t, p]`` and zero rows past n (one 32-byte load then holds
    byte p of 32 rows). ``row`` is the packed row (fb = its bytes) for every b but 3, where it is
    the pair layout of ``_pairs3`` (fb = 3 ceil(d/8))."""
    if packed.shape[1] != row_bytes(d, b):
        raise ValueError(f"packed must have {row_bytes(d, b)} bytes per row for d={d}, b={b}, "
                         f"got {packed.shape[1]}")
    rows = _pairs3(unpack_bits_ref(packed, d, 3)) if b == 3 else packed
    n, rb = rows.shape
    nb = -(-n // BLOCK_ROWS)
    out = torch.zeros((nb * BLOCK_ROWS, rb), dtype=torch.uint8, device=packed.device)
    out[:n] = rows
    return out.reshape(nb, BLOCK_ROWS, rb).transpose(1, 2).contiguous()


def block_code_rows_ref(packed: torch.Tensor, rows: torch.Tensor, d: int, b: int
                        ) -> torch.Tensor:
    """``block_codes_ref`` of the gathered rows ``packed[rows]`` (rows (n,) int32; -1: a zero
    row)."""
    r = rows.to(torch.int64)
    gathered = packed[r.clamp_min(0)]
    gathered[r < 0] = 0
    return block_codes_ref(gathered, d, b)


def unblock_codes(blocked: torch.Tensor, n: int, d: int, b: int) -> torch.Tensor:
    """Inverse of ``block_codes_ref``: (nb, fb, 32) -> packed (n, ceil(d b / 8))."""
    nb, rb, _ = blocked.shape
    rows = blocked.transpose(1, 2).reshape(nb * BLOCK_ROWS, rb)[:n]
    return pack_bits_ref(_unpairs3(rows, d), 3) if b == 3 else rows


def fast_scan_ref(qr: torch.Tensor, blocked: torch.Tensor, n: int, centroids: torch.Tensor,
                  mult: torch.Tensor, add: torch.Tensor, b: int, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``lut_scan_ref`` over codes in the fast-scan layout (``block_codes_ref``), b in 1-4."""
    return lut_scan_ref(qr, unblock_codes(blocked, n, qr.shape[1], b), centroids, mult, add, b, k)


def fast_scan_terms_ref(qrs: list[torch.Tensor], blocked: list[torch.Tensor], n: int,
                        centroids: list[torch.Tensor], mults: list[torch.Tensor],
                        add: torch.Tensor, bits: list[int], k: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of score_i = add_i + sum_t mults[t]_i <qrs[t], centroids[t][idx_t,i]> over several
    codes per row, each in the fast-scan layout (``block_codes_ref``) with its own width, query
    vectors (nq, d_t), centroids and per-row multiplier — e.g. TurboQuant-prod: the mse codes
    plus the QJL sign bits with centroids (-1, +1). Padded as ``lut_scan_ref``."""
    s = add[None, :].expand(qrs[0].shape[0], -1)
    for qr, bl, c, m, b in zip(qrs, blocked, centroids, mults, bits, strict=True):
        d = qr.shape[1]
        yhat = c[unpack_bits_ref(unblock_codes(bl, n, d, b), d, b).long()]
        s = s + (qr @ yhat.T) * m[None, :]
    return _topk_padded(s, k)


def fast_scan_terms_two_stage_ref(qrs: list[torch.Tensor], blocked: list[torch.Tensor],
                                  packed: list[torch.Tensor], n: int,
                                  centroids: list[torch.Tensor], mults: list[torch.Tensor],
                                  add: torch.Tensor, bits: list[int], first: int, k1: int, k: int
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two stages over several codes per row: the k1 best rows by add_i plus the first
    ``first`` terms of ``fast_scan_terms_ref``'s score (the leading runs of a mixed-width code),
    then the top k of those by the full score (every term), from the terms' packed (n,
    ceil(d_t b_t / 8)) rows; ``blocked`` is not read here (the kernel's first pass reads it).
    A kernel ranks its first pass by quantized tables, so rows near its k1-th score may differ
    from this one's; what it returns is scored exactly."""
    nq = qrs[0].shape[0]
    parts = []
    for qr, pk, c, m, b in zip(qrs, packed, centroids, mults, bits, strict=True):
        d = qr.shape[1]
        parts.append((qr @ c[unpack_bits_ref(pk, d, b).long()].T) * m[None, :])
    s1 = add[None, :].expand(nq, -1) + sum(parts[:first], torch.zeros_like(parts[0]))
    full = add[None, :].expand(nq, -1) + sum(parts, torch.zeros_like(parts[0]))
    _, cand = _topk_padded(s1, min(k1, n))
    keep = torch.full_like(full, -float("inf"))
    ok = cand >= 0
    rows = torch.arange(nq, device=full.device)[:, None].expand_as(cand)
    keep[rows[ok], cand[ok]] = full[rows[ok], cand[ok]]
    return _topk_padded(keep, k)


def ivf_fast_scan_ref(qr: torch.Tensor, blocked: torch.Tensor, centroids: torch.Tensor,
                      mult: torch.Tensor, add: torch.Tensor, list_blocks: torch.Tensor,
                      probes: torch.Tensor, offsets: torch.Tensor, b: int, k: int,
                      approx: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``fast_scan_ref`` restricted to inverted lists, with a score offset per (query, list).

    blocked (nb, fb, 32) holds the lists one after another, list l in blocks
    ``list_blocks[l] .. list_blocks[l+1]`` (int64, nlist + 1 entries, rows past a list's end
    carry add = -inf); mult, add (32 nb,) float32. Query i scores only the rows of the lists
    ``probes[i, r]`` (int64 (nq, P), distinct per row, -1 = none) as
    ``mult_j <qr_i, centroids[idx_j]> + add_j + offsets[i, r]``. Returns the top k as
    ``lut_scan_ref`` does, positions into the 32 nb rows. (With a residual code the offset is
    the query's exact score against the list's centroid: IVF-ADC, Jegou et al. 2011.)

    ``approx=True`` lets a kernel rank by its quantized tables and return those scores (a first
    stage before a refinement re-ranks the list): what it approximates is this exact result,
    which the reference returns either way.
    """
    nb = blocked.shape[0]
    n = nb * BLOCK_ROWS
    sizes = (list_blocks[1:] - list_blocks[:-1]) * BLOCK_ROWS
    row_list = torch.full((n,), -1, dtype=torch.int64, device=qr.device)
    used = int(list_blocks[-1]) * BLOCK_ROWS if list_blocks.numel() else 0
    row_list[:used] = torch.repeat_interleave(
        torch.arange(sizes.numel(), device=qr.device), sizes)
    off = torch.full((qr.shape[0], n), -float("inf"), device=qr.device)
    for r in range(probes.shape[1]):
        hit = (row_list[None, :] == probes[:, r:r + 1]) & (probes[:, r:r + 1] >= 0)
        off = torch.where(hit, offsets[:, r:r + 1], off)
    d = qr.shape[1]
    yhat = centroids[unpack_bits_ref(unblock_codes(blocked, n, d, b), d, b).long()]
    return _topk_padded((qr @ yhat.T) * mult[None, :] + add[None, :] + off, k)


def ivf_probe_ref(q: torch.Tensor, centroids: torch.Tensor, csq: torch.Tensor, l2: bool,
                  nprobe: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``nprobe`` best lists of each query, best first (ties: the lower list): q (nq, d),
    centroids (nlist, d), csq (nlist,) their squared norms, float32. Scores <q, c_l>, or for l2
    2 <q, c_l> - csq_l - ||q||^2 = -||q - c_l||^2. Returns (probes int64, scores float32),
    both (nq, nprobe)."""
    score = q @ centroids.T
    if l2:
        score = 2 * score - csq[None, :] - (q * q).sum(1, keepdim=True)
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :nprobe]
    return order, torch.gather(score, 1, order)


def row_sqnorms_ref(x: torch.Tensor) -> torch.Tensor:
    """||x_i||^2 of each row of x (n, d) float32: (n,) float32 (an L2 search's ||q||^2)."""
    return (x * x).sum(1)


def row_project_ref(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """x (n, d) @ W (d, m) in float32: a PCA index's query map (the basis and every run's
    rotation in one matrix)."""
    return x @ W


def row_dots_ref(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """<x_i, v> of each row of x (n, d) float32 with v (d,): (n,) float32 (a centred
    inner-product index's <q, mu>)."""
    return (x * v[None, :]).sum(1)


def rescore_topk_ref(q: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, metric: str, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact re-ranking of candidate rows: q (nq, d), x (n, d) float32, rows (nq, kk) int64 (-1 =
    none), scored by the metric's similarity — "ip" <q, x>, "l2" 2 <q, x> - ||x||^2 - ||q||^2
    (= -||q - x||^2), "cosine" <q, x> / max(||x||, 1e-30) — and the best k kept, best first, ties
    to the earlier candidate. Returns (vals float32, rows int64), both (nq, k), padded with -inf /
    -1 where a query has fewer than k candidates."""
    cand = x[rows.clamp_min(0)]
    dot = torch.einsum("qd,qkd->qk", q, cand)
    sqn = (cand * cand).sum(-1)
    if metric == "l2":
        s = 2 * dot - sqn - (q * q).sum(1, keepdim=True)
    elif metric == "cosine":
        s = dot / torch.sqrt(sqn).clamp_min(1e-30)
    else:
        s = dot
    s = s.masked_fill(rows < 0, -float("inf"))
    nq, kk = rows.shape
    if kk < k:
        s = torch.cat([s, s.new_full((nq, k - kk), -float("inf"))], 1)
        rows = torch.cat([rows, rows.new_full((nq, k - kk), -1)], 1)
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]
    vals = torch.gather(s, 1, order)
    return vals, torch.where(torch.isfinite(vals), torch.gather(rows, 1, order), -1)


def decode_attention_ref(qr: torch.Tensor, qbias: torch.Tensor, kpacked: torch.Tensor,
                         knorm: torch.Tensor, kcent: torch.Tensor, kb: int,
                         vpacked: torch.Tensor, vnorm: torch.Tensor, vcent: torch.Tensor,
                         vb: int, lo: torch.Tensor, hi: torch.Tensor, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax state of decode attention over TurboQuant-mse key and value codes.

    qr (BH, G, d) float32 rotated queries (G query heads per KV head); qbias (BH, G) float32
    added to every score; kpacked (BH, T, ceil(d*kb/8)) / vpacked (BH, T, ceil(d*vb/8)) uint8;
    knorm, vnorm (BH, T) float32; kcent (2^kb,), vcent (2^vb,) float32; lo, hi (BH,) int32: the
    tokens [lo, hi) that count. With s_t = scale * knorm_t <qr, kcent[kidx_t]> + qbias:
    returns m = max_t s_t, l = sum_t exp(s_t - m) (BH, G) and acc = sum_t exp(s_t - m) vnorm_t
    vcent[vidx_t] (BH, G, d), rotated domain, unnormalized (m = -inf, l = 0, acc = 0 when no token
    counts), so that a caller merges them with other tokens in one softmax.
    """
    bh, g, d = qr.shape
    t = kpacked.shape[1]
    khat = kcent[unpack_bits_ref(kpacked.reshape(bh * t, -1), d, kb).long()].reshape(bh, t, d)
    vhat = vcent[unpack_bits_ref(vpacked.reshape(bh * t, -1), d, vb).long()].reshape(bh, t, d)
    s = scale * (qr @ (khat * knorm[..., None]).transpose(1, 2)) + qbias[..., None]
    pos = torch.arange(t, device=qr.device)
    live = (pos[None, :] >= lo[:, None].long()) & (pos[None, :] < hi[:, None].long())
    s = s.masked_fill(~live[:, None, :], -float("inf"))
    m = s.amax(-1) if t else torch.full((bh, g), -float("inf"), device=qr.device)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m))[..., None])
    return m, p.sum(-1), p @ (vhat * vnorm[..., None])
