"""Bad input gets a clear error that names the parameter, what was expected and what came."""

import numpy as np
import pytest
import torch

import tqvec

CODECS = [lambda: tqvec.TurboQuant(8, 2), lambda: tqvec.TurboQuant(8, 2, "prod"),
          lambda: tqvec.QJL(8), lambda: tqvec.PolarQuant(8, (2, 1))]


@pytest.mark.parametrize("make", CODECS)
def test_encode_rejects_bad_input(make):
    c = make()
    good = np.ones((3, 8), np.float32)
    bad_nan = good.copy()
    bad_nan[1, 2] = np.nan
    with pytest.raises(ValueError, match="x must be finite, got NaN/Inf in 1 row.*row 1"):
        c.encode(bad_nan)
    with pytest.raises(ValueError, match="x must be finite"):
        c.encode(torch.full((2, 8), float("inf")))
    with pytest.raises(ValueError, match="x must have 8 columns .* got 7"):
        c.encode(np.ones((3, 7), np.float32))
    with pytest.raises(ValueError, match=r"x must be 2-D \(n, d\), got shape \(8,\).*x\[None, :\]"):
        c.encode(np.ones(8, np.float32))
    with pytest.raises(TypeError, match="x must have dtype float32, float16 or bfloat16, got "
                                        "torch.int64"):
        c.encode(torch.ones((3, 8), dtype=torch.int64))
    with pytest.raises(TypeError, match="x must be a numpy array or torch tensor, got list"):
        c.encode([[1.0] * 8])
    assert len(c.encode(np.zeros((0, 8), np.float32))) == 0
    codes = c.encode(good)
    with pytest.raises(ValueError, match="q must have 8 columns"):
        c.score(np.ones((2, 9), np.float32), codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_large_inputs_are_checked_for_nan_by_one_sum(dtype):
    """From SUM_CHECK_MIN elements on, finiteness is one float32 sum: a NaN/Inf anywhere is
    still found (and named by row), and finite rows whose sum overflows are still accepted."""
    from tqvec import _validate as V

    n = V.SUM_CHECK_MIN // 8 + 3
    x = torch.ones((n, 8), dtype=dtype)
    assert V.float_matrix(x, "x")[0] is x
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[n - 2, 5] = bad
        with pytest.raises(ValueError, match=f"got NaN/Inf in 1 row.*row {n - 2}"):
            V.float_matrix(y, "x")
    big = torch.full((n, 8), torch.finfo(dtype).max / 2, dtype=dtype)  # the sum overflows
    assert V.float_matrix(big, "x")[0] is big


def test_float64_is_coerced_like_faiss():
    c = tqvec.TurboQuant(8, 2)
    x = np.random.default_rng(0).standard_normal((5, 8))
    assert torch.equal(c.encode(x).payload, c.encode(x.astype(np.float32)).payload)


def test_codes_are_never_cast():
    c = tqvec.TurboQuant(8, 2)
    codes = c.encode(np.ones((3, 8), np.float32))
    with pytest.raises(TypeError, match="payload must be a 2-D uint8 tensor"):
        tqvec.Codes(codes.payload.float(), codes.scalars, codes.params)
    with pytest.raises(TypeError, match="codes must be tqvec.Codes, got ndarray"):
        c.decode(codes.payload.numpy())
    with pytest.raises(ValueError, match="were encoded with .* but this codec is"):
        tqvec.TurboQuant(8, 3).decode(codes)
    with pytest.raises(ValueError, match="scalars\\['norm'\\] must have 3 rows"):
        tqvec.Codes(codes.payload, {"norm": torch.ones(2)}, codes.params)


@pytest.mark.parametrize("kwargs,err,msg", [
    (dict(dim=1), ValueError, "dim must be in 2..1048576, got 1"),
    (dict(dim=8, bits=0), ValueError, "bits must be in 1..8, got 0"),
    (dict(dim=8, bits=9), ValueError, "bits must be in 1..8, got 9"),
    (dict(dim=8, bits=2.0), TypeError, "bits must be an int"),
    (dict(dim=8, variant="fast"), ValueError,
     r"variant must be one of \['mse', 'prod'\], got 'fast'"),
    (dict(dim=8, rotation="dct"), ValueError, "rotation must be one of"),
    (dict(dim=8, seed=-1), ValueError, "seed must be in"),
    (dict(dim=8, norm_dtype="bfloat16"), ValueError, "norm_dtype must be one of"),
    (dict(dim=8, sketch_dim=4), ValueError, "sketch_dim must be None for variant='mse'"),
    (dict(dim=8, backend="tpu"), ValueError, "backend must be one of"),
])
def test_unknown_params_are_rejected(kwargs, err, msg):
    with pytest.raises(err, match=msg):
        tqvec.TurboQuant(**kwargs)


def test_codec_from_params_round_trip_and_unknown_codec():
    for make in CODECS:
        c = make()
        assert tqvec.codec_from_params(c.params) == c
    with pytest.raises(ValueError, match="codec must be one of"):
        tqvec.codec_from_params({"codec": "pq", "dim": 8})
