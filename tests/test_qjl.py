import numpy as np
import pytest
import torch

import tqvec
from tests.bounds import UNBIASED_Z
from tests.conftest import unit_rows


@pytest.mark.parametrize("jl,m", [("orthogonal", 32), ("orthogonal", 64), ("orthogonal", 150),
                                  ("gaussian", 64)])
def test_qjl_is_unbiased_over_seeds(jl, m, rng):
    """QJL paper, Lemma 3.2, for every JL-matrix convention (m < d, m = d, m > d); this fails for
    unit-norm or sqrt(d)-scaled orthogonal rows, the usual reimplementation bug."""
    d, seeds = 64, 400
    x = rng.standard_normal((5, d)).astype(np.float32) * 3
    q = np.concatenate([rng.standard_normal((2, d)), x[2:] + 0.3 * rng.standard_normal((3, d))]
                       ).astype(np.float32)
    true = (q * x).sum(1)
    est = np.stack([np.diag(tqvec.QJL(d, m, seed=s, jl=jl).score(
        q, tqvec.QJL(d, m, seed=s, jl=jl).encode(x))) for s in range(seeds)])
    err = est - true
    z = err.mean(0) / (err.std(0, ddof=1) / np.sqrt(seeds))
    assert np.all(np.abs(z) < UNBIASED_Z), z


def test_unit_norm_orthogonal_rows_would_be_biased(rng):
    """Guards the scale convention: with unit rows the estimate shrinks by ~1/sqrt(d)."""
    from tqvec.random import jl_row_scale

    d = 64
    c = tqvec.QJL(d, seed=0)
    x = unit_rows(rng, 2000, d)
    ratio = np.diag(c.score(x, c.encode(x))).mean()  # <x, x> = 1
    assert ratio == pytest.approx(1.0, rel=0.05)
    assert ratio / jl_row_scale(d) ** 2 < 0.05  # what unit rows would give


def test_variance_shrinks_with_sketch_dim(rng):
    d = 64
    x, q = unit_rows(rng, 2000, d), unit_rows(rng, 2000, d)
    v = []
    for m in (64, 256):
        c = tqvec.QJL(d, m, seed=1, jl="gaussian")
        v.append(np.var(np.diag(c.score(q, c.encode(x))) - (q * x).sum(1)))
    # Var ~ (pi/2 ||q||^2 ||x||^2 - <q,x>^2) / m
    assert v[0] * d == pytest.approx(np.pi / 2, rel=0.1)
    assert v[0] / v[1] == pytest.approx(4, rel=0.15)


def test_outlier_split_reduces_error_on_outlier_channels(rng):
    d, n = 128, 2000
    x = rng.standard_normal((n, d)).astype(np.float32)
    q = rng.standard_normal((n, d)).astype(np.float32)
    x[:, [5, 70, 71, 100]] *= 30.0  # a few fixed large channels, as in deep-layer keys
    out = tqvec.top_channels(x[:256], 4)
    assert out == [5, 70, 71, 100]
    plain = tqvec.QJL(d, 2 * d, seed=0)
    split = tqvec.QJL(d, 2 * d - 32, seed=0, outliers=out, outlier_sketch_dim=32)
    assert split.code_size == plain.code_size + 4  # one more norm, same sign bits
    e_plain = np.diag(plain.score(q, plain.encode(x))) - (q * x).sum(1)
    e_split = np.diag(split.score(q, split.encode(x))) - (q * x).sum(1)
    assert np.mean(e_split**2) < 0.5 * np.mean(e_plain**2)
    assert abs(e_split.mean()) < UNBIASED_Z * e_split.std() / np.sqrt(n)


def test_decode_score_consistency_and_idempotent_signs(rng):
    d = 48
    x = rng.standard_normal((40, d)).astype(np.float32)
    q = rng.standard_normal((3, d)).astype(np.float32)
    for c in (tqvec.QJL(d, 32, seed=3), tqvec.QJL(d, seed=3, outliers=[1, 2])):
        codes = c.encode(x)
        np.testing.assert_allclose(c.score(q, codes), q @ c.decode(codes, like=x).T, rtol=1e-4,
                                   atol=1e-3)
    c = tqvec.QJL(d, 32, seed=3)
    codes = c.encode(x)
    assert torch.equal(c.encode(c.decode(codes, like=x)).payload, codes.payload)


def test_qjl_code_size():
    assert tqvec.QJL(128, 256).code_size == 32 + 4
    assert tqvec.QJL(128, 100, norm_dtype="float16").code_size == 13 + 2


def test_qjl_bad_params():
    with pytest.raises(ValueError, match="outliers must be channel indices"):
        tqvec.QJL(16, outliers=[16])
    with pytest.raises(ValueError, match="outlier_sketch_dim must be None"):
        tqvec.QJL(16, outlier_sketch_dim=8)
    with pytest.raises(ValueError, match="jl must be one of"):
        tqvec.QJL(16, jl="sparse")
