"""Each codec against its paper's definition, computed here in numpy float64 from the codes'
raw bits, the codec's seeded random matrices (``tqvec.random``, public) and its codebooks
(``tqvec.codebooks``) - not through the codec's own decode or score, so that a wrong constant,
scale or pairing in them cannot cancel out (a score compared with ``q @ decode(codes).T``
shares all of them).

Tolerances: float32 work against the float64 oracle, a d-term sum within gamma(d) sum |terms|
(tests/oracle.py); codes may differ only where a value lies within float32 rounding of a
threshold.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import tqvec
from tests import oracle
from tqvec.codebooks import angle_codebook, sphere_codebook
from tqvec.random import jl_matrix, make_rotation

SQRT_PI_2 = math.sqrt(math.pi / 2)  # QJL paper, Eq. (4): E|<s, k>| = sqrt(2/pi) ||k|| ||s||


def _indices(u: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd-Max indices #{t : thr_t <= u} and where u is within rounding of a threshold."""
    idx = (u[..., None] >= thresholds).sum(-1)
    near = (np.abs(u[..., None] - thresholds) <= 1e-6 * (1 + np.abs(u[..., None]))).any(-1)
    return idx, near


def _rotation(d: int, seed: int, kind: str = "hadamard") -> np.ndarray:
    return oracle.np64(make_rotation(kind, d, seed).matrix())


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("rotation", ["hadamard", "haar"])
def test_turboquant_mse_is_algorithm_1(bits, rotation, rng):
    """idx = Q(Pi x / ||x||) with the Lloyd-Max thresholds; x_hat = ||x|| Pi^T c[idx];
    score = <q, x_hat> (TurboQuant Algorithm 1)."""
    d, n = 96, 200
    x = rng.standard_normal((n, d)).astype(np.float32)
    q = rng.standard_normal((3, d)).astype(np.float32)
    c = tqvec.TurboQuant(d, bits, seed=5, rotation=rotation)
    codes = c.encode(x)
    R = _rotation(d, 5, rotation)
    cb = sphere_codebook(d, bits)
    xn = x.astype(np.float64)
    nrm = np.linalg.norm(xn, axis=1)
    idx, near = _indices((xn @ R.T) / nrm[:, None], cb.thresholds)
    got = oracle.unpack(codes.payload, d, bits)
    assert (got[~near] == idx[~near]).all() and near.mean() < 1e-3
    np.testing.assert_allclose(oracle.np64(codes.scalars["norm"]), nrm, rtol=2e-7)
    y = cb.centroids[got]  # the oracle of what these codes mean
    x_hat = (nrm[:, None] * y) @ R
    bound = 4 * oracle.gamma(d) * (np.abs(nrm[:, None] * y) @ np.abs(R)) + 1e-6
    assert (np.abs(c.decode(codes, like=x) - x_hat) <= bound).all()
    s = q.astype(np.float64) @ x_hat.T
    sb = 4 * oracle.gamma(2 * d) * (np.abs(q) @ np.abs(x_hat).T) + 1e-5
    assert (np.abs(c.score(q, codes) - s) <= sb).all()


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("m", [96, 40])
def test_turboquant_prod_is_algorithm_2(bits, m, rng):
    """(b-1)-bit mse codes of u = Pi x / ||x||, the residual r = u - c[idx] sketched as sign(S r)
    with gamma = ||r||, and <q, x> ~ ||x|| (<Pi q, c[idx]> + gamma sqrt(pi/2)/m <S Pi q,
    sign(S r)>) (TurboQuant Algorithm 2; the sketch lives in the rotated domain)."""
    d, n = 96, 150
    x = rng.standard_normal((n, d)).astype(np.float32)
    q = rng.standard_normal((4, d)).astype(np.float32)
    c = tqvec.TurboQuant(d, bits, "prod", seed=3, sketch_dim=m)
    codes = c.encode(x)
    R = _rotation(d, 3)
    S = jl_matrix(m, d, 3, "orthogonal", purpose="turboquant.qjl")
    cb = sphere_codebook(d, bits - 1)
    xn = x.astype(np.float64)
    nrm = np.linalg.norm(xn, axis=1)
    u = (xn @ R.T) / nrm[:, None]
    mse_bytes = (d * (bits - 1) + 7) // 8
    idx = oracle.unpack(codes.payload[:, :mse_bytes], d, bits - 1)
    want, near = _indices(u, cb.thresholds)
    assert (idx[~near] == want[~near]).all()
    r = u - cb.centroids[idx]
    np.testing.assert_allclose(oracle.np64(codes.scalars["rnorm"]), np.linalg.norm(r, axis=1),
                               rtol=1e-5, atol=1e-6)
    signs = oracle.unpack(codes.payload[:, mse_bytes:], m, 1) * 2 - 1
    z = r @ S.T
    clear = np.abs(z) > 1e-4 * np.abs(z).max()
    assert (signs[clear] == np.sign(z[clear])).all()
    qr = q.astype(np.float64) @ R.T
    est = nrm[None, :] * (qr @ cb.centroids[idx].T + np.linalg.norm(r, axis=1)[None, :]
                          * SQRT_PI_2 / m * ((qr @ S.T) @ signs.T))
    scale = nrm[None, :] * (np.abs(qr).sum(1)[:, None] * (1 + np.abs(S).sum(0).max()))
    assert (np.abs(c.score(q, codes) - est) <= 8 * oracle.gamma(d + m) * scale + 1e-5).all()


@pytest.mark.parametrize("m", [64, 200])
@pytest.mark.parametrize("jl", ["orthogonal", "gaussian"])
def test_qjl_is_eq_4(m, jl, rng):
    """Codes sign(S k) and ||k||; <q, k> ~ sqrt(pi/2)/m ||k|| <S q, sign(S k)> (QJL paper,
    Eq. (4)); decode = sqrt(pi/2)/m ||k|| S^T sign(S k)."""
    d, n = 64, 120
    x = rng.standard_normal((n, d)).astype(np.float32)
    q = rng.standard_normal((3, d)).astype(np.float32)
    c = tqvec.QJL(d, m, seed=8, jl=jl)
    codes = c.encode(x)
    S = jl_matrix(m, d, 8, jl, purpose="qjl")
    xn = x.astype(np.float64)
    z = xn @ S.T
    signs = oracle.unpack(codes.payload, m, 1) * 2 - 1
    clear = np.abs(z) > 1e-4 * np.abs(z).max()
    assert (signs[clear] == np.sign(z[clear])).all()
    nrm = np.linalg.norm(xn, axis=1)
    np.testing.assert_allclose(oracle.np64(codes.scalars["norm"]), nrm, rtol=2e-7)
    est = SQRT_PI_2 / m * nrm[None, :] * ((q.astype(np.float64) @ S.T) @ signs.T)
    scale = SQRT_PI_2 / m * nrm[None, :] * (np.abs(q) @ np.abs(S).T).sum(1)[:, None]
    assert (np.abs(c.score(q, codes) - est) <= 8 * oracle.gamma(d + m) * scale + 1e-6).all()
    dec = SQRT_PI_2 / m * nrm[:, None] * (signs @ S)
    dscale = SQRT_PI_2 / m * nrm[:, None] * np.abs(S).sum(0)[None, :]
    assert (np.abs(c.decode(codes, like=x) - dec) <= 8 * oracle.gamma(m) * dscale + 1e-6).all()


def test_polarquant_is_the_recursive_polar_transform(rng):
    """Level 1: angles atan2(y_{2i+1}, y_{2i}) in [0, 2 pi); level l: atan2 of pairs of the
    previous radii in [0, pi/2]; each quantized by its level's Lloyd-Max codebook; the last
    radii stored (float16). Decode inverts the transform with the centroid angles
    (PolarQuant paper, Algorithm 1)."""
    d, n, levels = 64, 100, (4, 2, 2, 2)
    x = rng.standard_normal((n, d)).astype(np.float32)
    c = tqvec.PolarQuant(d, levels, seed=6)
    codes = c.encode(x)
    y = x.astype(np.float64) @ _rotation(d, 6).T
    off, r = 0, y
    want_idx = []
    for lv, b in enumerate(levels, 1):
        psi = np.arctan2(r[:, 1::2], r[:, 0::2])
        if lv == 1:
            psi = np.where(psi < 0, psi + 2 * np.pi, psi)
        cb = angle_codebook(lv, b)
        idx, near = _indices(psi, cb.thresholds)
        idx = np.minimum(idx, (1 << b) - 1)
        count = r.shape[1] // 2
        nb = (count * b + 7) // 8
        got = oracle.unpack(codes.payload[:, off: off + nb], count, b)
        assert (got[~near] == idx[~near]).all(), f"level {lv}"
        want_idx.append(got)
        off += nb
        r = np.hypot(r[:, 0::2], r[:, 1::2])
    np.testing.assert_allclose(oracle.np64(codes.scalars["radii"]), r, rtol=1e-3)
    rad = oracle.np64(codes.scalars["radii"])
    for lv in range(len(levels), 0, -1):
        psi = angle_codebook(lv, levels[lv - 1]).centroids[want_idx[lv - 1]]
        rad = np.stack([rad * np.cos(psi), rad * np.sin(psi)], axis=2).reshape(n, -1)
    x_hat = rad @ _rotation(d, 6)
    np.testing.assert_allclose(c.decode(codes, like=x), x_hat, rtol=1e-4, atol=1e-4)
