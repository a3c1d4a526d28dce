import numpy as np
import pytest
import torch

import tqvec
from tests.bounds import (
    GAUSS_PROD_FACTOR,
    MSE_REL_TOL,
    ORTHO_PROD_FACTOR,
    PROD_VAR_REL_TOL,
    TQ_MSE_D128,
    TQ_PROD_VAR_D,
    UNBIASED_Z,
)
from tests.conftest import on, unit_rows
from tqvec.codebooks import sphere_codebook


@pytest.mark.parametrize("rotation", ["hadamard", "haar"])
@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_mse_matches_paper_at_d128(rotation, b, rng):
    x = unit_rows(rng, 20000, 128)
    c = tqvec.TurboQuant(128, b, seed=1, rotation=rotation)
    xh = c.decode(c.encode(x), like=x)
    mse = float(((x - xh) ** 2).sum(1).mean())
    assert mse == pytest.approx(TQ_MSE_D128[b], rel=MSE_REL_TOL)


def test_norms_are_restored(rng):
    x = rng.standard_normal((3000, 96)).astype(np.float32) * rng.uniform(0.01, 100, (3000, 1))
    c = tqvec.TurboQuant(96, 3, seed=0)
    xh = c.decode(c.encode(x), like=x)
    rel = ((x - xh) ** 2).sum(1) / (x**2).sum(1)
    assert rel.mean() == pytest.approx(sphere_codebook(96, 3).mse, rel=MSE_REL_TOL)


def _paired_errors(codec, q, x):
    est = codec.score(q, codec.encode(x))  # (n, n); pairs (q_i, x_i) on the diagonal
    return np.diag(est) - (q * x).sum(1)


@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_prod_variance_gaussian_matrix_matches_paper(b, rng):
    d, n = 128, 3000
    x, q = unit_rows(rng, n, d), unit_rows(rng, n, d)
    err = _paired_errors(tqvec.TurboQuant(d, b, "prod", seed=2, jl="gaussian"), q, x)
    assert err.var() * d == pytest.approx(TQ_PROD_VAR_D[b], rel=PROD_VAR_REL_TOL)
    d_prev = sphere_codebook(d, b - 1).mse if b > 1 else 1.0
    assert err.var() * d == pytest.approx(GAUSS_PROD_FACTOR * d_prev, rel=PROD_VAR_REL_TOL)


@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_prod_variance_orthogonal_matrix_is_lower(b, rng):
    d, n = 128, 3000
    x, q = unit_rows(rng, n, d), unit_rows(rng, n, d)
    err = _paired_errors(tqvec.TurboQuant(d, b, "prod", seed=2), q, x)
    d_prev = sphere_codebook(d, b - 1).mse if b > 1 else 1.0
    assert err.var() * d == pytest.approx(ORTHO_PROD_FACTOR * d_prev, rel=PROD_VAR_REL_TOL)
    assert err.var() * d < TQ_PROD_VAR_D[b]


@pytest.mark.parametrize("jl", ["orthogonal", "gaussian"])
@pytest.mark.parametrize("b", [2, 3])
def test_prod_is_unbiased_over_seeds(jl, b, rng):
    """For fixed (q, x), including q strongly correlated with x, the mean over seeds of the
    estimate is <q, x> within UNBIASED_Z standard errors (TurboQuant Theorem 2)."""
    d, pairs, seeds = 64, 6, 300
    x = unit_rows(rng, pairs, d)
    q = np.concatenate([unit_rows(rng, 3, d), x[3:] + 0.2 * unit_rows(rng, 3, d)])
    true = (q * x).sum(1)
    est = np.stack([np.diag(tqvec.TurboQuant(d, b, "prod", seed=s, jl=jl).score(
        q, tqvec.TurboQuant(d, b, "prod", seed=s, jl=jl).encode(x))) for s in range(seeds)])
    err = est - true
    z = err.mean(0) / (err.std(0, ddof=1) / np.sqrt(seeds))
    assert np.all(np.abs(z) < UNBIASED_Z), z


def test_mse_inner_products_are_biased_towards_zero(rng):
    """The reason prod exists: <q, x_hat_mse> shrinks <q, x> by about 1 - D_mse."""
    d = 128
    x = unit_rows(rng, 2000, d)
    q = x + 0.1 * unit_rows(rng, 2000, d)
    c = tqvec.TurboQuant(d, 1, seed=0)
    ratio = np.diag(c.score(q, c.encode(x))) / (q * x).sum(1)
    assert ratio.mean() == pytest.approx(1 - sphere_codebook(d, 1).mse, rel=0.05)


@pytest.mark.parametrize("variant,bits", [("mse", 1), ("mse", 3), ("mse", 8), ("prod", 1),
                                          ("prod", 4)])
def test_score_equals_inner_product_with_decode(variant, bits, rng):
    d = 100
    x = rng.standard_normal((50, d)).astype(np.float32)
    q = rng.standard_normal((7, d)).astype(np.float32)
    c = tqvec.TurboQuant(d, bits, variant, seed=4)
    codes = c.encode(x)
    np.testing.assert_allclose(c.score(q, codes), q @ c.decode(codes, like=x).T, rtol=1e-4,
                               atol=1e-3)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8])
def test_mse_encode_decode_encode_is_idempotent(bits, rng):
    """Re-encoding x_hat = ||x|| Pi^T c[idx] renormalizes by ||c[idx]||, which is 1 - O(D) but
    can drop to ~0.95 when one coordinate lies beyond the outermost centroid; the 5 % rescale
    stays inside the wide cells of b <= 4 (exactly idempotent) and can cross the narrow inner
    cells of b >= 6 for a few coordinates."""
    x = rng.standard_normal((500, 64)).astype(np.float32)
    c = tqvec.TurboQuant(64, bits, seed=0)
    codes = c.encode(x)
    again = c.encode(c.decode(codes, like=x))
    if bits <= 4:
        assert torch.equal(again.payload, codes.payload)
    else:
        from tqvec import ops

        moved = ops.unpack_bits(again.payload, 64, bits) != ops.unpack_bits(codes.payload, 64,
                                                                            bits)
        assert moved.float().mean() < 1e-3


@pytest.mark.parametrize("variant,scale", [("mse", "norm"), ("mse", "fit"), ("prod", "norm")])
def test_same_seed_same_codes_on_every_backend(backend, variant, scale, rng):
    x = torch.from_numpy(rng.standard_normal((300, 96)).astype(np.float32))
    ref = tqvec.TurboQuant(96, 3, variant, seed=9, scale=scale, backend="ref").encode(x)
    got = tqvec.TurboQuant(96, 3, variant, seed=9, scale=scale,
                           backend=backend).encode(on(backend, x))
    if backend != "ref":  # what the reference's codes are: test_codec_oracles.py
        assert torch.equal(got.payload.cpu(), ref.payload)
        # a GPU's norm reductions may round in another order, and the fitted scale's float64
        # centroid sums in another order (test_ops: centroid_stats)
        exact = backend == "cpu" and scale != "fit"
        for k in ref.scalars:
            torch.testing.assert_close(got.scalars[k].cpu(), ref.scalars[k],
                                       rtol=0 if exact else 1e-6, atol=0)
    other = tqvec.TurboQuant(96, 3, variant, seed=10, backend=backend).encode(on(backend, x))
    assert not torch.equal(other.payload.cpu(), ref.payload)


@pytest.mark.parametrize("scale", ["norm", "fit", "unbiased"])
@pytest.mark.parametrize("bits,d", [(1, 96), (3, 64), (4, 300)])
def test_decode_is_the_same_on_every_backend(backend, scale, bits, d, rng):
    """The CPU's one-call decode (ops.turbo_mse_decode) reconstructs exactly what the
    reference's steps do, over several decode blocks."""
    from tqvec.codecs.base import block_rows

    n = block_rows(torch.device("cpu"), d) + 77
    x = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
    ref = tqvec.TurboQuant(d, bits, seed=3, scale=scale, backend="ref")
    codes = ref.encode(x)
    got = tqvec.TurboQuant(d, bits, seed=3, scale=scale, backend=backend).decode(
        codes.to(on(backend, x).device) if backend == "cuda" else codes)
    torch.testing.assert_close(got.cpu(), ref.decode(codes), rtol=0,
                               atol=0 if backend != "cuda" else 1e-6)


@pytest.mark.parametrize("variant,bits,expect", [("mse", 4, 64 + 4), ("mse", 3, 48 + 4),
                                                 ("prod", 3, 32 + 16 + 8), ("prod", 1, 16 + 4)])
def test_code_size_is_bytes_stored(variant, bits, expect, rng):
    c = tqvec.TurboQuant(128, bits, variant, seed=0)
    codes = c.encode(rng.standard_normal((10, 128)).astype(np.float32))
    assert c.code_size == expect == codes.code_size
    assert codes.nbytes == 10 * expect
    assert codes.payload.numel() + sum(v.numel() * v.element_size()
                                       for v in codes.scalars.values()) == codes.nbytes


def test_float16_norms_halve_side_information_and_refuse_overflow(rng):
    c = tqvec.TurboQuant(64, 2, seed=0, norm_dtype="float16")
    assert c.code_size == 16 + 2
    x = rng.standard_normal((4, 64)).astype(np.float32)
    assert c.encode(x).scalars["norm"].dtype == torch.float16
    with pytest.raises(ValueError, match="norm must fit in float16"):
        c.encode(x * 1e5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_encode_like_their_float32_values(dtype, rng):
    x = torch.from_numpy(rng.standard_normal((200, 64)).astype(np.float32)).to(dtype)
    c = tqvec.TurboQuant(64, 4, seed=0)
    assert torch.equal(c.encode(x).payload, c.encode(x.float()).payload)


def test_numpy_in_numpy_out_torch_in_torch_out(rng):
    x = rng.standard_normal((20, 32)).astype(np.float32)
    c = tqvec.TurboQuant(32, 2, seed=0)
    codes = c.encode(x)
    assert isinstance(c.decode(codes, like=x), np.ndarray)
    assert isinstance(c.decode(codes), torch.Tensor)
    assert isinstance(c.score(x[:3], codes), np.ndarray)
    assert isinstance(c.score(torch.from_numpy(x[:3]), codes), torch.Tensor)
    assert c.score(x[:3], codes).shape == (3, 20) and c.score(x[:3], codes).dtype == np.float32


def test_zero_vector_and_empty_input():
    c = tqvec.TurboQuant(16, 3, "prod", seed=0)
    x = np.zeros((2, 16), np.float32)
    codes = c.encode(x)
    assert float(codes.scalars["norm"].abs().sum()) == 0
    np.testing.assert_array_equal(c.decode(codes, like=x), 0)
    np.testing.assert_array_equal(c.score(np.ones((1, 16), np.float32), codes), 0)
    empty = c.encode(np.zeros((0, 16), np.float32))
    assert len(empty) == 0 and c.decode(empty, like=x).shape == (0, 16)
    assert c.score(np.ones((2, 16), np.float32), empty).shape == (2, 0)


def test_codes_slicing_and_concat(rng):
    x = rng.standard_normal((30, 32)).astype(np.float32)
    c = tqvec.TurboQuant(32, 2, seed=0)
    codes = c.encode(x)
    assert len(codes[5:9]) == 4 and len(codes[3]) == 1 and len(codes[np.arange(30) % 2 == 0]) == 15
    both = tqvec.concat_codes([codes[:10], codes[10:]])
    assert torch.equal(both.payload, codes.payload)
    np.testing.assert_array_equal(c.decode(codes[[4, 2]], like=x), c.decode(codes, like=x)[[4, 2]])
    with pytest.raises(ValueError, match="encoded with"):
        tqvec.concat_codes([codes, tqvec.TurboQuant(32, 3).encode(x)])


@pytest.mark.parametrize("b", [1, 2, 4])
def test_unbiased_scale_makes_projection_exact_and_keeps_bytes(b, rng):
    """EDEN's scale: <x_hat, x> = ||x||^2 for every vector; MSE ~ D / (1 - D); +2 bytes."""
    d = 128
    x = rng.standard_normal((3000, d)).astype(np.float32) * 3
    c = tqvec.TurboQuant(d, b, seed=0, scale="unbiased")
    assert c.code_size == tqvec.TurboQuant(d, b).code_size + 2
    xh = c.decode(c.encode(x), like=x)
    np.testing.assert_allclose((xh * x).sum(1), (x * x).sum(1), rtol=2e-3)  # float16 corr
    D = sphere_codebook(d, b).mse
    rel = ((x - xh) ** 2).sum(1) / (x**2).sum(1)
    assert rel.mean() == pytest.approx(D / (1 - D), rel=0.05)
    # Inner products with correlated queries are no longer shrunk by (1 - D).
    q = x + 0.3 * rng.standard_normal(x.shape).astype(np.float32)
    ratio = np.diag(c.score(q[:500], c.encode(x[:500]))) / (q[:500] * x[:500]).sum(1)
    assert ratio.mean() == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("b", [1, 2, 4])
def test_fitted_scale_lowers_every_vectors_error_at_the_same_bytes(b, rng):
    """scale='fit': the same indices as the paper's codes, decoded with the least-squares
    scale m = ||x|| <u, c> / ||c||^2: each vector's error is at most the norm scale's (it is
    the minimum over all scales of those centroids), ||x||^2 (1 - cos^2(u, c)); same bytes."""
    d = 128
    x = rng.standard_normal((3000, d)).astype(np.float32) * rng.uniform(0.1, 5, (3000, 1)).astype(
        np.float32)
    x[7] = 0
    c, c0 = tqvec.TurboQuant(d, b, scale="fit"), tqvec.TurboQuant(d, b)
    assert c.code_size == c0.code_size and c.unbiased_ip is False
    codes, codes0 = c.encode(x), c0.encode(x)
    assert torch.equal(codes.payload, codes0.payload) and set(codes.scalars) == {"fit"}
    xh, xh0 = c.decode(codes, like=x), c0.decode(codes0, like=x)
    err, err0 = ((x - xh) ** 2).sum(1), ((x - xh0) ** 2).sum(1)
    assert (err <= err0 * (1 + 1e-5) + 1e-6).all() and not xh[7].any()
    # x_hat = m Pi^T c[idx] is parallel to Pi^T c[idx]; the rotation keeps angles
    cos2 = (x * xh).sum(1) ** 2 / np.maximum((x * x).sum(1) * (xh * xh).sum(1), 1e-30)
    np.testing.assert_allclose(err[err0 > 0], ((x * x).sum(1) * (1 - cos2))[err0 > 0],
                               rtol=1e-3, atol=1e-4)
    assert err.sum() < err0.sum()
    with pytest.raises(NotImplementedError, match="true norm"):
        c.true_sqnorms(codes)
    with pytest.raises(ValueError, match="scale must be 'norm' for variant='prod'"):
        tqvec.TurboQuant(16, 3, "prod", scale="fit")


def test_unbiased_scale_is_mse_only():
    with pytest.raises(ValueError, match="scale must be 'norm' for variant='prod'"):
        tqvec.TurboQuant(16, 3, "prod", scale="unbiased")
    with pytest.raises(ValueError, match="scale must be one of"):
        tqvec.TurboQuant(16, 3, scale="mse")


@pytest.mark.parametrize("b", [2, 8])
def test_grid_codebook_codec(b, rng):
    """TurboQuant(codebook="grid"): the grid's MSE on unit vectors (d = 128), same bytes as
    Lloyd-Max, the sign bit as the top bit of every index, params round-trip (and params without
    the key mean Lloyd-Max, as files written before the grid say)."""
    from tqvec import ops
    from tqvec.codebooks import sphere_grid_codebook
    from tqvec.codecs import codec_from_params

    x = unit_rows(rng, 20000, 128)
    c = tqvec.TurboQuant(128, b, seed=1, codebook="grid")
    codes = c.encode(x)
    mse = float(((x - c.decode(codes, like=x)) ** 2).sum(1).mean())
    assert mse == pytest.approx(sphere_grid_codebook(128, b).mse, rel=MSE_REL_TOL)
    assert c.expected_mse == sphere_grid_codebook(128, b).mse
    assert c.code_size == tqvec.TurboQuant(128, b).code_size
    top = ops.unpack_bits(codes.payload, 128, b) >> (b - 1)
    y = c.rotate(torch.from_numpy(x))
    assert torch.equal(top.bool(), y > 0)
    assert c.params["codebook"] == "grid"
    assert codec_from_params(c.params).codebook_kind == "grid"
    assert "codebook" not in tqvec.TurboQuant(128, b).params
    with pytest.raises(ValueError, match="codebook"):
        tqvec.TurboQuant(128, b, codebook="uniform")


@pytest.mark.parametrize("make", [
    lambda: tqvec.TurboQuant(48, bits=3, seed=1),
    lambda: tqvec.TurboQuant(48, bits=2, variant="prod", seed=2, norm_dtype="float16"),
    lambda: tqvec.TurboQuant(48, bits=2, scale="fit", seed=3),
    lambda: tqvec.QJL(48, 64, seed=4),
    lambda: tqvec.PolarQuant(48, seed=5),
], ids=["mse", "prod-f16", "fit", "qjl", "polar"])
def test_blocked_encode_and_decode_equal_one_block(make, rng, monkeypatch):
    """``encode``/``decode`` return one block's own tensors and write several blocks into
    preallocated ones: both routes give the same codes, decodings and row numbers in errors."""
    import tqvec.codecs.base as base

    codec = make()
    x = rng.standard_normal((30, 48)).astype(np.float32)
    x[4] = 0.0
    one = codec.encode(x)
    dec = codec.decode(one)
    monkeypatch.setattr(base, "BLOCK_ROWS", 7)
    blocked = codec.encode(x)
    assert torch.equal(blocked.payload, one.payload)
    assert blocked.scalars.keys() == one.scalars.keys()
    for k, v in one.scalars.items():
        assert blocked.scalars[k].dtype == v.dtype and torch.equal(blocked.scalars[k], v)
    np.testing.assert_array_equal(codec.decode(blocked), dec)
    x[23, 5] = np.nan
    with pytest.raises(ValueError, match="first at row 23"):
        codec.encode(x)
    monkeypatch.setattr(base, "BLOCK_ROWS", 8192)
    with pytest.raises(ValueError, match="first at row 23"):
        codec.encode(x)
