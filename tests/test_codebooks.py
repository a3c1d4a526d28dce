import math

import numpy as np
import pytest

from tests.bounds import GAUSS_LLOYD_MAX, TQ_MSE_D128, mse_lower, mse_upper
from tqvec.codebooks import (
    angle_codebook,
    gaussian_codebook,
    polar_expected_mse,
    sphere_codebook,
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
