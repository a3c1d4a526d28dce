import numpy as np
import pytest
import torch

import tqvec
from tests.conftest import on, unit_rows
from tqvec.codebooks import polar_expected_mse


@pytest.mark.parametrize("level_bits", [(4, 2, 2, 2), (3, 2, 2), (2, 1), (6, 3, 3, 3, 3)])
def test_measured_mse_matches_codebook_prediction(level_bits, rng):
    """E||x - x_hat||^2 = 2 (1 - prod_l E cos(psi_l - Q(psi_l))) with independent angles."""
    x = unit_rows(rng, 20000, 128)
    c = tqvec.PolarQuant(128, level_bits, seed=0, radius_dtype="float32")
    xh = c.decode(c.encode(x), like=x)
    mse = float(((x - xh) ** 2).sum(1).mean())
    assert mse == pytest.approx(polar_expected_mse(level_bits), rel=0.03)
    assert mse == pytest.approx(c.expected_mse, rel=0.03)


def test_default_bits_per_coordinate_is_3_875():
    c = tqvec.PolarQuant(128)
    assert c.code_size == (64 * 4 + 32 * 2 + 16 * 2 + 8 * 2) // 8 + 8 * 2
    assert c.bits_per_dim == pytest.approx(3.875)


def test_float16_radii_cost_almost_nothing(rng):
    x = unit_rows(rng, 5000, 64)
    e = {}
    for dt in ("float16", "float32"):
        c = tqvec.PolarQuant(64, seed=1, radius_dtype=dt)
        e[dt] = float(((x - c.decode(c.encode(x), like=x)) ** 2).sum(1).mean())
    assert e["float16"] == pytest.approx(e["float32"], rel=0.01)


def test_polar_score_decode_idempotence_and_backends(backend, rng):
    """Every backend on its own device's tensors (the cuda backend takes CUDA tensors)."""
    x = on(backend, torch.from_numpy(rng.standard_normal((300, 64)).astype(np.float32)))
    q = on(backend, torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32)))
    c = tqvec.PolarQuant(64, seed=2, backend=backend)
    codes = c.encode(x)
    if backend != "ref":  # the codes themselves: test_codec_oracles.py
        ref = tqvec.PolarQuant(64, seed=2, backend="ref").encode(x.cpu())
        assert torch.equal(codes.payload.cpu(), ref.payload)
    xhat = c.decode(codes)
    torch.testing.assert_close(c.score(q, codes).cpu(), (q @ xhat.T).cpu(), rtol=1e-4,
                               atol=1e-3)
    assert torch.equal(c.encode(xhat).payload, codes.payload)
    zero = c.encode(torch.zeros_like(x[:1]))
    assert not c.decode(zero).any()


def test_polar_rejects_indivisible_dim():
    with pytest.raises(ValueError, match="divisible by 2\\^4 = 16"):
        tqvec.PolarQuant(100)
    with pytest.raises(ValueError, match="level_bits must be"):
        tqvec.PolarQuant(64, level_bits=())
