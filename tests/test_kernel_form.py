"""A codec that declares a ``KernelForm`` gets every fast path, and only through that method.

``UniformScalar`` (tests/scalar_codec.py) is a scalar codec that is not TurboQuant: the flat
index's fast scan, per-query tables and fused call, the IVF fast scan, the graph index, the
rotated-domain re-scoring and the KV cache's fused and compiled decode attention all take it,
and each gives the results of its own composition (the decoded or term-form path).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tqvec
from tests.scalar_codec import UniformScalar
from tests.test_routes import _data, _forced, _routes, _same
from tqvec.codecs import TurboQuant
from tqvec.index import FlatIndex, GraphIndex, IVFIndex

needs_kernels = pytest.mark.skipif(not tqvec.ops.has_cpu_kernels(),
                                   reason="compiled CPU kernels not built")


def test_forms_are_declared_without_drawing():
    assert TurboQuant(64, 3).kernel_form().bits == 3
    assert TurboQuant(64, 3, scale="fit").kernel_form().multiplier_field == "fit"
    assert TurboQuant(64, 3, scale="unbiased").kernel_form().multiplier_field is None
    assert TurboQuant(64, 3, "prod").kernel_form() is None
    assert tqvec.QJL(64, 64).kernel_form() is None
    big = TurboQuant(4096, 2, rotation="haar")  # a 4096 x 4096 QR: not drawn by the form
    assert big.kernel_form().multiplier_is_norm and "_rot" not in vars(big)


def test_the_fixture_codec_is_what_it_says():
    codec = UniformScalar(48, 3, seed=1)
    x = torch.randn(200, 48)
    codes = codec.encode(x)
    q = torch.randn(5, 48)
    np.testing.assert_allclose(codec.score(q, codes), q @ codec.decode(codes).T, rtol=1e-4,
                               atol=1e-4)
    cos = torch.nn.functional.cosine_similarity(codec.decode(codes), x).mean()
    assert 0.9 < float(cos) < 1  # 3 bits on a clipped grid: a real, lossy codec


@needs_kernels
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("refine", [None, "flat", "tq8"])
def test_flat_index_takes_every_route(metric, refine, monkeypatch):
    xb, xq = _data()
    d = xb.shape[1]
    ref = TurboQuant(d, 8, codebook="grid") if refine == "tq8" else refine
    index = FlatIndex(UniformScalar(d, 2, seed=4), metric, refine=ref)
    index.add(xb)
    want = index.search(xq, 10)
    _same(want, index.search(torch.from_numpy(xq), 10), exact=True)
    routes = _routes(index)
    assert routes == ["fast", "lut", "gemm"]
    assert index.snapshot().scan.fused is not None
    for route in routes:
        with monkeypatch.context() as m:
            got = _forced(index, route, m).search(xq, 10)
        if route == "fast" or refine is None:
            _same(want, got, exact=route == "fast")
        else:  # the fast scan ranks the candidates by its tables, the others exactly
            assert (got[1] == want[1]).mean() > 0.8


@needs_kernels
def test_ivf_index_fast_scans_it():
    xb, xq = _data()
    index = IVFIndex(UniformScalar(xb.shape[1], 3, seed=2), 8, "l2", nprobe=3)
    index.train(xb)
    index.add(xb)
    want = index.search(xq, 10)
    assert _routes(index) == ["fast", "lists"]
    with pytest.MonkeyPatch.context() as m:
        _same(want, _forced(index, "lists", m).search(xq, 10), exact=False)


@needs_kernels
def test_graph_index_takes_it():
    xb, xq = _data()
    codec = UniformScalar(xb.shape[1], 2, seed=3)
    graph = GraphIndex(codec, 16, "l2", refine="flat", efSearch=200)
    graph.add(xb)
    flat = FlatIndex(codec, "l2", refine="flat", k_factor=50)
    flat.add(xb)
    _, gi = graph.search(xq, 10)
    _, fi = flat.search(xq, 10)
    assert np.mean([len(np.intersect1d(a, b)) / 10 for a, b in zip(gi, fi, strict=True)]) > 0.9


def test_a_codec_without_the_form_is_refused_by_the_graph_with_the_reason():
    with pytest.raises(ValueError, match="kernel_form"):
        GraphIndex(TurboQuant(32, 3, "prod"), 16)


def _kv_logits(monkeypatch, codec_of, modes, tokens=30, prefill=12):
    """A tiny Llama's logits with the cache's "turbo" quantizers replaced by
    ``CodecQuantizer(codec_of(dim, bits, seed))``: first by the per-segment path, then under
    each ``CODES_KERNEL`` mode in ``modes``, with the calls of ``ops.attention_step`` and of
    the compiled CPU step each made. Returns (plain, [(logits, steps, compiled) per mode],
    decode steps over all layers)."""
    pytest.importorskip("transformers")
    from tests.test_kv import llama, run
    from tqvec import kv, ops
    from tqvec.kv import attention, layer, quant
    from tqvec.ops import cpu

    real_make = quant.make_quantizer

    def make(kind, dim, bits, *, seed, role, **kw):
        if kind == "turbo":
            return quant.CodecQuantizer(codec_of(dim, int(bits), seed))
        return real_make(kind, dim, bits, seed=seed, role=role, **kw)

    monkeypatch.setattr(layer, "make_quantizer", make)
    model = llama()
    ids = torch.randint(0, 97, (2, tokens), generator=torch.Generator().manual_seed(4))
    cfg = dict(key_bits=3, value_bits=3, residual_length=3, sink_length=2, calibrate=False)
    monkeypatch.setattr(attention, "CODES_KERNEL", "never")
    plain = run(model, ids, kv.TurboQuantCache(model.config, **cfg), prefill)
    steps, compiled = [], []
    real_step, real_np = ops.attention_step, cpu.attention_step_np
    monkeypatch.setattr(ops, "attention_step", lambda *a, **k: steps.append(1) or real_step(
        *a, **k))
    monkeypatch.setattr(cpu, "attention_step_np", lambda *a: compiled.append(1) or real_np(*a))
    out = []
    for mode in modes:
        monkeypatch.setattr(attention, "CODES_KERNEL", mode)
        steps.clear()
        compiled.clear()
        got = run(model, ids, kv.TurboQuantCache(model.config, **cfg), prefill)
        out.append((got, len(steps), len(compiled)))
    return plain, out, (tokens - prefill) * model.config.num_hidden_layers


@needs_kernels
def test_kv_cache_runs_its_kernels_on_it(monkeypatch):
    """With the cache's TurboQuant quantizers swapped for UniformScalar ones, attention runs
    through ``ops.attention_step`` - its torch reference, and on the CPU the one compiled call
    per decode step - and both give the per-segment torch composition's logits."""
    plain, runs, decode_steps = _kv_logits(
        monkeypatch, lambda d, b, seed: UniformScalar(d, b, seed=seed, norm_dtype="float16"),
        ("ref", "auto"))
    for mode, (got, steps, compiled) in zip(("ref", "auto"), runs, strict=True):
        assert steps >= decode_steps
        assert (compiled >= decode_steps) == (mode == "auto")
        torch.testing.assert_close(got, plain, atol=1e-4, rtol=1e-4)


@needs_kernels
def test_kv_cache_takes_a_dense_rotation_through_the_composition(monkeypatch):
    """A kernel-form codec without a prepared Hadamard op (TurboQuant with a Haar rotation)
    still goes through ``ops.attention_step``: its composition rotates with the codec's own
    rotate / unrotate, the compiled step (which needs a Hadamard rotation) does not run, and
    the logits are the per-segment path's."""
    plain, [(got, steps, compiled)], decode_steps = _kv_logits(
        monkeypatch, lambda d, b, seed: TurboQuant(d, b, seed=seed, rotation="haar",
                                                   norm_dtype="float16", scale="fit"),
        ("auto",), tokens=24, prefill=10)
    assert steps >= decode_steps and not compiled
    torch.testing.assert_close(got, plain, atol=1e-4, rtol=1e-4)
