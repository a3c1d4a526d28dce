import numpy as np
import pytest
import torch

import tqvec
from tqvec.codebooks import sphere_codebook
from tqvec.random import haar_matrix, jl_matrix, jl_row_scale, make_rotation


def test_haar_is_orthogonal_and_seeded():
    a = haar_matrix(50, np.random.default_rng(1))
    np.testing.assert_allclose(a @ a.T, np.eye(50), atol=1e-12)
    r1, r2 = make_rotation("haar", 50, 3), tqvec.random.HaarRotation(50, 3)
    assert torch.equal(r1.matrix(), r2.matrix())
    assert not torch.equal(r1.matrix(), make_rotation("haar", 50, 4).matrix())


@pytest.mark.parametrize("d", [2, 3, 5, 100, 384])
def test_hadamard_is_exactly_orthogonal_for_any_d(d):
    m = make_rotation("hadamard", d, 0).matrix().double()
    np.testing.assert_allclose((m @ m.T).numpy(), np.eye(d), atol=1e-5)


def _structured_mse(rotation, rounds, b, x, seeds):
    errs = []
    for s in range(seeds):
        c = tqvec.TurboQuant(x.shape[1], b, seed=s, rotation=rotation, rounds=rounds)
        xh = c.decode(c.encode(x), like=x)
        errs.append(((x - xh) ** 2).sum() / (x**2).sum())
    return float(np.mean(errs))


@pytest.mark.parametrize("kind", ["e1", "constant", "sparse"])
@pytest.mark.parametrize("b", [1, 2, 4])
def test_hadamard_handles_one_hot_constant_and_sparse_inputs(kind, b):
    """Averaged over seeds, the MSE on structured inputs equals the Lloyd-Max value, as for a
    Haar rotation (one round of D.H fails this: e_1 -> equal magnitudes, 0.1-2.2x the value)."""
    d = 128
    x = np.zeros((1, d), np.float32)
    if kind == "e1":
        x[0, 0] = 1
    elif kind == "constant":
        x[:] = 1
    else:
        x[0, [3, 50, 77]] = [1, -2, 0.5]
    got = _structured_mse("hadamard", 3, b, x, seeds=150)
    assert got == pytest.approx(sphere_codebook(d, b).mse, rel=0.06)


def test_one_round_is_not_enough_for_one_hot():
    x = np.zeros((1, 128), np.float32)
    x[0, 0] = 1
    got = _structured_mse("hadamard", 1, 1, x, seeds=20)
    assert got < 0.5 * sphere_codebook(128, 1).mse  # deterministic magnitudes: not Beta at all


def test_jl_row_scale_is_mean_chi():
    rng = np.random.default_rng(0)
    for d in (2, 16, 128):
        g = np.linalg.norm(rng.standard_normal((200000, d)), axis=1)
        assert jl_row_scale(d) == pytest.approx(g.mean(), rel=3e-3)


@pytest.mark.parametrize("m,d", [(16, 64), (64, 64), (150, 64)])
def test_jl_matrix_shapes_and_orthogonal_blocks(m, d):
    s = jl_matrix(m, d, 1, "orthogonal")
    assert s.shape == (m, d)
    c = jl_row_scale(d)
    np.testing.assert_allclose(np.linalg.norm(s, axis=1), c, rtol=1e-12)
    blk = s[: min(m, d)] / c
    np.testing.assert_allclose(blk @ blk.T, np.eye(min(m, d)), atol=1e-12)
    assert jl_matrix(m, d, 1, "gaussian").shape == (m, d)
    np.testing.assert_array_equal(s, jl_matrix(m, d, 1, "orthogonal"))
