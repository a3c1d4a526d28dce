"""The error-bounded first pass (``prefilter_sigmas``, factory ``Prefilter``): the codec's error
model against measured errors, the kernel against its reference, the index against the exact
scan where a fixed shortlist loses recall, and the setting's checks and persistence."""

import math

import numpy as np
import pytest
import torch

import tqvec
from tqvec import ops
from tqvec.index import GraphIndex, read_index, write_index
from tqvec.index.state import index_from_state

needs_cpu = pytest.mark.skipif("cpu" not in ops.available_backends(),
                               reason="tqvec._C not built")


def _planes(codec, x):
    codes = codec.encode(torch.from_numpy(x))
    term, signs = codec.lut_terms(codes)[0], codec.sign_term(codes)
    d = codec.dim
    full = term.centroids[ops.unpack_bits(term.packed, d, codec.mse_bits).long()]
    sign = signs.centroids[ops.unpack_bits(signs.packed, d, 1).long()]
    return codes, term.scale, full, sign


@pytest.mark.parametrize("d,b", [(128, 2), (256, 3), (768, 4)])
def test_the_sign_term_error_model_matches_measured_errors(d, b):
    """full - gain_row * sign estimate, over rows and queries (random and near each row),
    has mean ~0 and the model's standard deviation noise |m| ||q|| sin: the measured ratio's
    spread is 1 within 10 %, and its mean 0 within 0.05."""
    rng = np.random.default_rng(d + b)
    codec = tqvec.TurboQuant(d, b, seed=1)
    model = codec.sign_term_error()
    x = rng.standard_normal((1500, d)).astype(np.float32)
    codes, m, full, sign = _planes(codec, x)
    gains = codec.sign_term_gains(codes)
    # the model's constants: the rows' mean gain and ||c|| (for unit rows)
    assert abs(float(gains.mean()) / model.gain - 1) < 0.01
    assert abs(float(full.norm(dim=1).mean()) / model.cnorm - 1) < 0.01
    near = x[:40] + 0.3 * rng.standard_normal((40, d)).astype(np.float32)
    for q in (rng.standard_normal((40, d)).astype(np.float32), near):
        qr = codec.query_terms(torch.from_numpy(q))[0]
        qn = qr.norm(dim=1, keepdim=True)
        t = qr @ sign.T
        err = (qr @ full.T - gains[None, :] * t) * m[None, :]
        cos = model.gain * t / (model.cnorm * qn)
        sin = torch.sqrt(torch.clamp(1 - cos * cos, min=1.0 / d))
        ratio = err / (model.noise * m.abs()[None, :] * qn * sin)
        assert abs(float(ratio.mean())) < 0.05
        assert abs(float(ratio.std()) - 1) < 0.1


def test_codecs_without_a_model_say_so():
    assert tqvec.TurboQuant(64, 1).sign_term_error() is None  # its pass is a prefix
    assert tqvec.TurboQuant(64, 3, "prod").sign_term_error() is None
    assert tqvec.QJL(64, 64).sign_term_error() is None
    g = tqvec.TurboQuant(256, 2).sign_term_error()
    # Lloyd-Max: gain = E[c^2] / c1^2 = (1 - D_2) / (2 / pi) at large d
    assert abs(g.gain - (1 - 0.1175) / (2 / math.pi)) < 0.01


def _index_data(seed=0, n=4000, d=256, nq=30):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n + nq, d)).astype(np.float32)
    return x[:n], x[n:]


@needs_cpu
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_the_bounded_pass_finds_the_exact_scans_results(metric):
    """Isotropic rows, where a fixed shortlist of the sign pass loses results: the bounded pass
    returns the full codes' own top k (the exact scan's) for nearly every result, by the
    compiled call (numpy queries) and the composition (torch queries) alike."""
    xb, xq = _index_data()
    exact = tqvec.index_factory(xb.shape[1], "TQ4", metric)
    bounded = tqvec.index_factory(xb.shape[1], "TQ4,Prefilter", metric)
    fixed = tqvec.index_factory(xb.shape[1], "TQ4,Prefilter(2)", metric)
    for index in (exact, bounded, fixed):
        index.add(xb)
    assert bounded.prefilter == 0 and bounded.prefilter_sigmas == 3.0
    De, Ie = exact.search(xq, 10)
    Db, Ib = bounded.search(xq, 10)
    _, If = fixed.search(xq, 10)
    assert (Ib == Ie).mean() >= 0.99
    np.testing.assert_allclose(Db[Ib == Ie], De[Ib == Ie], rtol=1e-4, atol=1e-4)
    assert (If == Ie).mean() < (Ib == Ie).mean()  # what the bound is for
    Dt, It = bounded.search(torch.from_numpy(xq), 10)
    assert np.array_equal(It, Ib) and np.array_equal(Dt, Db)


def _kernel_inputs(seed, codec_seed, d, n):
    """3-bit codes of n random rows for the kernel-level tests: the generator (to draw on),
    the codec, the rows' sign reconstructions, full and sign terms, and the bounded pass's
    multipliers (each row's gain times its scale)."""
    rng = np.random.default_rng(seed)
    codec = tqvec.TurboQuant(d, 3, seed=codec_seed)
    codes, _, _, sign = _planes(codec, rng.standard_normal((n, d)).astype(np.float32))
    term, signs = codec.lut_terms(codes)[0], codec.sign_term(codes)
    mult1 = (codec.sign_term_gains(codes) * term.scale).float().contiguous()
    return rng, codec, sign, term, signs, mult1


@needs_cpu
def test_the_kernel_keeps_every_row_its_reference_keeps():
    """ops.fast_scan_two_stage with a bound: the kernel's candidates include the reference's
    (its table scores' error widens each bound), so its k-th best is at least the reference's,
    and both agree with the full codes' exact top k on nearly every row."""
    d, n, k = 128, 3000, 10
    rng, codec, _, term, signs, mult1 = _kernel_inputs(5, 2, d, n)
    model = codec.sign_term_error()
    add = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    add[::17] = -float("inf")
    qr = codec.query_terms(torch.from_numpy(rng.standard_normal((8, d)).astype(np.float32)))[0]
    blocked = ops.block_codes(signs.packed, d, 1)
    bound = ops.SignBound(3 * model.noise, model.gain, model.cnorm, 1 / math.sqrt(d))
    args = (qr, blocked, n, signs.centroids.float(), term.packed, 3, term.centroids.float(),
            term.scale.float(), add, add, 1, k)
    vc, pc = ops.fast_scan_two_stage(*args, backend="cpu", mult1=mult1, bound=bound)
    vr, pr = ops.fast_scan_two_stage(*args, backend="ref", mult1=mult1, bound=bound)
    ve, pe = ops.lut_scan(qr, term.packed, term.centroids.float(), term.scale.float(), add, 3, k,
                          backend="ref")
    assert torch.all(vc[:, -1] >= vr[:, -1] - 1e-4)
    assert (pc == pe).float().mean() >= 0.95 and (pr == pe).float().mean() >= 0.95
    assert not torch.isin(pc, torch.arange(0, n, 17)).any()
    with pytest.raises(ValueError, match="bound"):
        ops.fast_scan_two_stage(*args, bound=ops.SignBound(-1.0, 1.0, 1.0))
    with pytest.raises(TypeError, match="SignBound"):
        ops.fast_scan_two_stage(*args, bound=(3.0, 1.0, 1.0, 0.0))


@needs_cpu
def test_rows_the_stop_passes_over_are_not_scored():
    """A candidate whose bound is below the k-th full score of the rows re-scored before it is
    never scored, in the kernel and the reference alike: planted full codes that score it
    first (its sign plane, hence its bound, left low) stay out of both results, and would be
    in them if every candidate were scored."""
    d, n, k = 128, 3000, 10
    rng, codec, sign, term, signs, mult1 = _kernel_inputs(11, 4, d, n)
    model = codec.sign_term_error()
    add = torch.zeros(n)
    q = rng.standard_normal((1, d)).astype(np.float32)
    qr = codec.query_terms(torch.from_numpy(q))[0]
    bound = ops.SignBound(3 * model.noise, model.gain, model.cnorm, 1 / math.sqrt(d))
    # the reference's bounds (fast_scan_two_stage_ref) and the candidates
    t = (qr @ sign.T)[0]
    est = t * mult1
    cos = model.gain * t / (model.cnorm * qr.norm())
    e = bound.sigma / model.gain * qr.norm() * torch.sqrt(torch.clamp(1 - cos * cos, min=1 / d))
    ub = est + e * mult1.abs()
    cand = torch.nonzero(ub >= torch.topk(est - e * mult1.abs(), k).values[-1]).flatten()
    cents, scale = term.centroids.float(), term.scale.float()
    full = (qr @ cents[ops.unpack_bits(term.packed, d, 3).long()].T)[0] * scale
    r = int(cand[torch.argmin(ub[cand])])
    assert float(ub[r]) < float(torch.topk(full, k).values[-1])  # the stop passes over it
    planted = term.packed.clone()
    planted[r] = codec.lut_terms(codec.encode(torch.from_numpy(q)))[0].packed[0]
    args = (qr, ops.block_codes(signs.packed, d, 1), n, signs.centroids.float(), planted, 3,
            cents, scale, add, add, 1, k)
    _, every = ops.lut_rescore(qr, planted, cents, scale, add, cand[None], 3, k, backend="ref")
    assert int(every[0, 0]) == r  # the best full score of all
    for backend in ("cpu", "ref"):
        _, pos = ops.fast_scan_two_stage(*args, backend=backend, mult1=mult1, bound=bound)
        assert r not in pos[0].tolist(), backend


def test_the_setting_is_checked():
    codec = tqvec.TurboQuant(64, 2)
    for bad in (-1.0, float("nan"), 11.0):
        with pytest.raises(ValueError, match="prefilter_sigmas"):
            tqvec.FlatIndex(codec, prefilter_sigmas=bad)
    with pytest.raises(TypeError, match="prefilter_sigmas"):
        tqvec.FlatIndex(codec, prefilter_sigmas="3")
    with pytest.raises(ValueError, match="prefilter_sigmas must be 0 for"):
        tqvec.FlatIndex(tqvec.TurboQuant(64, 1), prefilter_sigmas=3.0)
    with pytest.raises(ValueError, match="prefilter_sigmas must be 0 for"):
        tqvec.FlatIndex(tqvec.QJL(64, 64), prefilter_sigmas=3.0)
    with pytest.raises(ValueError, match="while prefilter is set"):
        tqvec.FlatIndex(codec, prefilter=5, prefilter_sigmas=3.0)
    index = tqvec.FlatIndex(codec, prefilter_sigmas=3.0)
    with pytest.raises(ValueError, match="while prefilter_sigmas is set"):
        index.prefilter = 5
    index.prefilter_sigmas = 0.0
    index.prefilter = 5  # one or the other
    with pytest.raises(ValueError, match="IVF"):
        tqvec.index_factory(64, "IVF8,TQ2,Prefilter")
    if "cpu" in ops.available_backends():
        graph = GraphIndex(codec, 8)
        with pytest.raises(ValueError, match="prefilter_sigmas must be 0 for a graph"):
            graph.prefilter_sigmas = 3.0


@needs_cpu
def test_files_keep_the_bound(tmp_path):
    xb, xq = _index_data(n=1500, d=64)
    index = tqvec.index_factory(64, "Center,TQ2,Prefilter")
    index.train(xb)
    index.add(xb)
    index.prefilter_sigmas = 2.5
    write_index(index, tmp_path / "b.tqi")
    back = read_index(tmp_path / "b.tqi")
    assert back.prefilter_sigmas == 2.5 and back.prefilter == 0
    for a, b in zip(index.search(xq, 5), back.search(xq, 5), strict=True):
        assert np.array_equal(a, b)
    meta, arrays = index.state()
    meta.pop("prefilter_sigmas")  # a file written before the setting: no bound
    assert index_from_state(meta, arrays).prefilter_sigmas == 0.0
    meta["prefilter_sigmas"] = -1.0
    with pytest.raises(ValueError, match="prefilter_sigmas"):
        index_from_state(meta, arrays)
