import math

import numpy as np
import pytest

from tests.bounds import GAUSS_LLOYD_MAX, TQ_MSE_D128, mse_lower, mse_upper
from tqvec.codebooks import (
    _CosPower,
    _grid_mse,
    angle_codebook,
    gaussian_codebook,
    grid_half_step,
    polar_expected_mse,
    sphere_codebook,
    sphere_grid_codebook,
)


@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_sphere_codebook_d128_matches_paper(b):
    cb = sphere_codebook(128, b)
    assert cb.mse == pytest.approx(TQ_MSE_D128[b], rel=5e-3)
    assert mse_lower(b) < cb.mse < mse_upper(b)


def test_b1_is_the_closed_form():
    # One bit: centroids +-E|X| = +-G(d/2) / (sqrt(pi) G((d+1)/2)); MSE = 1 - d E|X|^2.
    for d in (2, 5, 128, 1536):
        e = math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)
        cb = sphere_codebook(d, 1)
        assert cb.centroids[1] == pytest.approx(e, rel=1e-9)
        assert cb.mse == pytest.approx(1 - d * e * e, rel=1e-9)


def test_d3_is_uniform():
    # d = 3: the coordinate of a uniform point on S^2 is uniform on [-1, 1] (Archimedes).
    cb = sphere_codebook(3, 2)
    np.testing.assert_allclose(cb.centroids, [-0.75, -0.25, 0.25, 0.75], atol=1e-10)


@pytest.mark.parametrize("d,b", [(2, 3), (7, 2), (64, 4), (384, 6), (1536, 8)])
def test_codebook_is_a_lloyd_max_fixed_point_against_scipy(d, b):
    scipy_stats = pytest.importorskip("scipy.stats")
    from scipy import integrate

    cb = sphere_codebook(d, b)
    a = (d - 1) / 2
    dist = scipy_stats.beta(a, a, loc=-1, scale=2)
    edges = np.concatenate([[-1.0], cb.thresholds, [1.0]])
    for i, c in enumerate(cb.centroids):
        lo, hi = edges[i], edges[i + 1]
        p = dist.cdf(hi) - dist.cdf(lo)
        if p < 1e-12:
            continue
        m1 = integrate.quad(lambda x: x * dist.pdf(x), lo, hi, epsabs=1e-14, limit=200)[0]
        assert c == pytest.approx(m1 / p, rel=1e-6, abs=1e-9)
    assert np.all(np.diff(cb.centroids) > 0)
    np.testing.assert_array_equal(cb.centroids, -cb.centroids[::-1])


@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_gaussian_cross_check_at_large_d(b):
    g = gaussian_codebook(4096, b)
    assert g.mse == pytest.approx(GAUSS_LLOYD_MAX[b], rel=2e-3)
    assert sphere_codebook(4096, b).mse == pytest.approx(g.mse, rel=5e-3)
    np.testing.assert_allclose(sphere_codebook(4096, b).centroids, g.centroids, rtol=5e-3)


def test_angle_codebooks():
    c1 = angle_codebook(1, 4)
    np.testing.assert_allclose(np.diff(c1.centroids), 2 * math.pi / 16)
    for level in (2, 3, 5):
        cb = angle_codebook(level, 2)
        assert 0 < cb.centroids[0] < math.pi / 4 < cb.centroids[-1] < math.pi / 2
        np.testing.assert_allclose(cb.centroids + cb.centroids[::-1], math.pi / 2, atol=1e-12)
    # Angles concentrate around pi/4 as the level grows: the same bits buy less error.
    errs = [angle_codebook(lv, 2).mse for lv in (2, 3, 4, 5)]
    assert all(a > b for a, b in zip(errs, errs[1:], strict=False))
    assert 0.02 < polar_expected_mse((4, 2, 2, 2)) < 0.05


@pytest.mark.parametrize("bad", [0, 9, 2.5])
def test_codebook_rejects_bad_bits(bad):
    with pytest.raises(ValueError, match="bits must be in 1..8"):
        sphere_codebook(64, bad)


@pytest.mark.parametrize("d,b", [(2, 3), (3, 2), (64, 1), (128, 2), (384, 4), (784, 8)])
def test_grid_codebook_is_an_exact_float32_grid_with_the_least_error(d, b):
    """c[i] = hs (2 i - K + 1) exactly in float32 (what the kernels' affine decode relies on),
    symmetric with the middle threshold exactly 0 (the sign bit), thresholds at the midpoints;
    its MSE is at least Lloyd-Max's (equal at 1 bit, where a symmetric 2-level codebook is a
    grid, and at d = 3) and no other step does better."""
    cb = sphere_grid_codebook(d, b)
    K = 1 << b
    c32 = cb.centroids.astype(np.float32)
    hs = grid_half_step(c32)
    assert hs > 0 and float(np.float32(hs)) == hs
    np.testing.assert_array_equal(cb.centroids, hs * (2.0 * np.arange(K) - (K - 1)))
    assert cb.thresholds[K // 2 - 1] == 0.0
    np.testing.assert_allclose(cb.thresholds, (cb.centroids[:-1] + cb.centroids[1:]) / 2,
                               atol=1e-15)
    lm = sphere_codebook(d, b)
    if b == 1 or d == 3:  # d = 3: a uniform law, whose Lloyd-Max codebook is a grid
        assert cb.mse == pytest.approx(lm.mse, rel=1e-6)
    else:
        assert cb.mse > lm.mse
    dist = _CosPower(d - 2, "sin")
    for f in (0.99, 1.01):
        assert _grid_mse(dist, K, hs * f) * d > cb.mse


def test_grid_codebook_mse_by_monte_carlo(rng):
    """The quadrature's MSE against sampled unit vectors (d = 128, 2 and 8 bits)."""
    d = 128
    x = rng.standard_normal((20000, d))
    u = (x / np.linalg.norm(x, axis=1, keepdims=True)).ravel()
    for b in (2, 8):
        cb = sphere_grid_codebook(d, b)
        q = cb.centroids[np.searchsorted(cb.thresholds, u, side="right")]
        assert float(((u - q) ** 2).mean() * d) == pytest.approx(cb.mse, rel=0.02)


def test_grid_half_step_refuses_non_grids():
    assert grid_half_step(sphere_codebook(64, 3).centroids.astype(np.float32)) == 0.0
    assert grid_half_step(np.array([1.0], np.float32)) == 0.0
    assert grid_half_step(np.array([0.5, -0.5], np.float32)) == 0.0  # descending
    assert grid_half_step(np.array([-1.5, -0.5, 0.5, 1.5], np.float32)) == 0.5
    with pytest.raises(ValueError, match="bits"):
        sphere_grid_codebook(64, 9)
