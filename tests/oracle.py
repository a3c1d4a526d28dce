"""Independent oracles for the ops: numpy, float64, written from the ops' documented meaning
(not from tqvec.ops.ref), with the float32 rounding bound each result must meet.

A float32 sum of n terms is within gamma(n) * sum |terms| of the exact sum (Higham, "Accuracy
and Stability of Numerical Algorithms", Eq. (3.5): gamma(n) = n u / (1 - n u), u = 2^-24), in
any order of summation - BLAS, SIMD lanes or a kernel's own order alike. The bounds below are
that, plus one rounding per further operation, doubled for slack; a result outside them is a
wrong result, not a rounding difference.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
import torch

U = 2.0 ** -24  # float32 unit roundoff


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def np64(t) -> np.ndarray:
    return (t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)).astype(
        np.float64)


def unpack(packed, d: int, b: int) -> np.ndarray:
    """(n, d) int64 indices of LSB-first packed b-bit fields (numpy's own bit unpacking)."""
    p = packed.cpu().numpy() if isinstance(packed, torch.Tensor) else np.asarray(packed)
    bits = np.unpackbits(p.astype(np.uint8), axis=1, bitorder="little")[:, : d * b]
    return (bits.reshape(p.shape[0], d, b).astype(np.int64) << np.arange(b)).sum(-1)


def lut_scores(qr, packed, centroids, mult, add, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(s, bound) (nq, n): s = mult_i <qr, c[idx_i]> + add_i exactly (add = -inf excludes a
    row), and the float32 error bound of a computation of it."""
    q, c = np64(qr), np64(centroids)
    y = c[unpack(packed, q.shape[1], b)]
    m, a = np64(mult), np64(add)
    dot = q @ y.T
    absum = np.abs(q) @ np.abs(y).T
    s = dot * m[None, :] + a[None, :]
    bound = 2 * ((gamma(q.shape[1]) + 2 * U) * absum * np.abs(m)[None, :]
                 + 2 * U * np.abs(np.where(np.isfinite(a), a, 0))[None, :])
    return s, bound


def topk(s: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Best k of each row, ties to the lower position, padded with -inf / -1."""
    nq, n = s.shape
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    vals = np.take_along_axis(s, order, 1)
    pos = np.where(np.isfinite(vals), order, -1)
    if n < k:
        vals = np.concatenate([vals, np.full((nq, k - n), -np.inf)], 1)
        pos = np.concatenate([pos, np.full((nq, k - n), -1)], 1)
    return vals, pos


def check_topk(vals, pos, s: np.ndarray, bound: np.ndarray | float, k: int,
               rows=None) -> None:
    """A top-k result against the oracle scores s (nq, n) and their error bound: every returned
    value is its row's oracle score (within the bound), the values are the oracle's k best
    (within twice the largest bound: a near-tie may swap rows), padding exactly where fewer
    than k rows score finite, no row twice, no excluded row. ``rows`` (nq, r): the candidates
    a query may return (a re-score of listed rows); None: all rows."""
    v, p = np64(vals), (pos.cpu().numpy() if isinstance(pos, torch.Tensor) else np.asarray(pos))
    nq = s.shape[0]
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), s.shape)
    if rows is not None:  # only the listed candidates count
        r = rows.cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
        allowed = np.zeros(s.shape, bool)
        for i in range(nq):
            allowed[i, r[i][r[i] >= 0]] = True
        s = np.where(allowed, s, -np.inf)
    want_v, _ = topk(s, k)
    assert v.shape == p.shape == (nq, k), (v.shape, p.shape)
    for i in range(nq):
        ok = p[i] >= 0
        assert (ok == np.isfinite(want_v[i])).all(), f"query {i}: padding differs"
        assert (np.isfinite(v[i]) == ok).all(), f"query {i}: -inf where a row is returned"
        got = p[i][ok]
        assert len(set(got.tolist())) == len(got), f"query {i}: a row returned twice"
        assert np.isfinite(s[i, got]).all(), f"query {i}: an excluded row returned"
        err = np.abs(v[i][ok] - s[i, got])
        assert (err <= bound[i, got]).all(), (
            f"query {i}: a score off its row's exact value by {err.max():.3g} > bound "
            f"{bound[i, got][err.argmax()]:.3g}")
        slack = 2 * bound[i][np.isfinite(s[i])].max(initial=0.0)
        assert (np.abs(np.sort(v[i][ok]) - np.sort(want_v[i][ok])) <= slack).all(), (
            f"query {i}: not the k best (beyond near-ties)")


def hadamard_matrix(perms, signs, p: int, d: int) -> np.ndarray:
    """The (d, d) float64 matrix M of the multi-round randomized Hadamard rotation, y = M x:
    round r permutes (x -> x[perms[r]]), flips signs, and applies H_p / sqrt(p) (Sylvester
    order) to the first p and then the last p coordinates."""
    h = scipy.linalg.hadamard(p).astype(np.float64) / np.sqrt(p)
    m = np.eye(d)
    for perm, sign in zip(np.asarray(perms), np64(signs), strict=True):
        step = np.zeros((d, d))
        step[np.arange(d), perm] = sign  # (P x)_j = sign_j x_{perm_j}
        first = np.eye(d)
        first[:p, :p] = h
        second = np.eye(d)
        second[d - p:, d - p:] = h
        m = (second if p < d else np.eye(d)) @ first @ step @ m
    return m


def attention_state(qr, qbias, kpacked, knorm, kcent, kb, vpacked, vnorm, vcent, vb, lo, hi,
                    scale) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode attention's softmax state in float64: s_t = scale knorm_t <qr, kc[kidx_t]> +
    qbias over the tokens [lo, hi); m = max s, l = sum exp(s - m), acc = sum exp(s - m) vnorm_t
    vc[vidx_t] (m = -inf, l = 0, acc = 0 without tokens)."""
    q = np64(qr)
    bh, g, d = q.shape
    t = kpacked.shape[1]
    m = np.full((bh, g), -np.inf)
    lsum = np.zeros((bh, g))
    acc = np.zeros((bh, g, d))
    for h in range(bh):
        a, z = int(lo[h]), int(hi[h])
        if z <= a:
            continue
        k = np64(kcent)[unpack(kpacked[h], d, kb)][a:z] * np64(knorm[h])[a:z, None]
        v = np64(vcent)[unpack(vpacked[h], d, vb)][a:z] * np64(vnorm[h])[a:z, None]
        s = scale * (q[h] @ k.T) + np64(qbias[h])[:, None]
        m[h] = s.max(1)
        w = np.exp(s - m[h][:, None])
        lsum[h] = w.sum(1)
        acc[h] = w @ v
    assert t >= 0
    return m, lsum, acc
