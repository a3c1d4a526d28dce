"""KV cache: attention from the codes through ops.attention_step - its torch composition, the
compiled CPU step and the plans the layers keep - against the per-segment path."""

import pytest
import torch

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")

import tqvec  # noqa: E402
import tqvec.kv as kv  # noqa: E402
from tests.test_kv import gemma3, llama, run  # noqa: E402
from tqvec.kv.quant import make_quantizer  # noqa: E402


def fused_and_plain(model, ids, cfg, prefill, mode, monkeypatch, kernel=None):
    """Logits of ``run`` with the per-segment attention path and through ``ops.attention_step``
    (``CODES_KERNEL = mode``) as its composition over ``kernel`` (default
    ``ops.decode_attention``, the CUDA kernel's op on GPUs), and how many times the kernel ran."""
    from tqvec import ops
    from tqvec.kv import attention
    from tqvec.ops.dispatch import Op
    from tqvec.ops.kvstep import compose_attention_step

    monkeypatch.setattr(attention, "CODES_KERNEL", "never")
    plain = run(model, ids, kv.TurboQuantCache(model.config, **cfg), prefill)
    calls = []
    real = kernel or ops.decode_attention

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    def composed(*a):
        return compose_attention_step(counted, *a)

    monkeypatch.setitem(ops.OPS, "attention_step", Op(composed, composed, composed))
    monkeypatch.setattr(attention, "CODES_KERNEL", mode)
    fused = run(model, ids, kv.TurboQuantCache(model.config, **cfg), prefill)
    return plain, fused, len(calls)


@pytest.mark.parametrize("make", [llama, gemma3])
@pytest.mark.parametrize("kw", [dict(calibrate=False), dict(calibrate=True),
                                dict(calibrate=True, norm_bits=8, key_bits=4, value_bits=2)])
def test_fused_codes_attention_matches_segment_path(make, kw, monkeypatch):
    """The code segment through ops.decode_attention (the CUDA kernel's op; on the CPU its
    reference) merged with the exact segments == the per-segment path, prefill and decode,
    channel scales and log-coded norms included; sliding layers (Gemma) too."""
    model = make()
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(3))
    kw = dict(dict(key_bits=3, value_bits=3, residual_length=3, sink_length=2), **kw)
    plain, fused, calls = fused_and_plain(model, ids, kw, 12, "ref", monkeypatch)
    assert calls >= 18 * model.config.num_hidden_layers // 2
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)


def _count_steps(monkeypatch):
    """Calls of ``ops.attention_step`` as the number of rows per KV head of each, and of the
    compiled CPU step inside it."""
    from tqvec import ops
    from tqvec.ops import cpu
    rows, compiled = [], []
    real_step, real_np = ops.attention_step, cpu.attention_step_np
    monkeypatch.setattr(ops, "attention_step", lambda q, *a, **k: rows.append(q.shape[1]) or
                        real_step(q, *a, **k))
    monkeypatch.setattr(cpu, "attention_step_np", lambda *a: compiled.append(1) or real_np(*a))
    return rows, compiled


@pytest.mark.skipif(not tqvec.ops.has_cpu_kernels(), reason="compiled CPU kernels not built")
@pytest.mark.parametrize("make", [llama, gemma3])
@pytest.mark.parametrize("kw", [dict(calibrate=False), dict(residual_bits=8),
                                dict(norm_bits=8, key_bits=4, value_bits=2, residual_bits=8),
                                dict(dtype=torch.bfloat16), dict(dtype=torch.float16,
                                                                 residual_bits=8)])
def test_compiled_decode_step_matches_the_composition(make, kw, monkeypatch):
    """A decode step as one compiled call (ops.attention_step on the CPU: rotations, channel
    scales, every code segment, the exact sink and window rows in the model's dtype, the
    merge) == the op's torch composition, every decode step of every layer; sliding layers
    (Gemma) too."""
    from tqvec.kv import attention

    kw = dict(kw)
    dtype = kw.pop("dtype", torch.float32)
    model = make().to(dtype)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    kw = dict(dict(key_bits=3, value_bits=3, residual_length=3, sink_length=2), **kw)
    monkeypatch.setattr(attention, "CODES_KERNEL", "ref")
    plain = run(model, ids, kv.TurboQuantCache(model.config, **kw), 12)
    rows, compiled = _count_steps(monkeypatch)
    monkeypatch.setattr(attention, "CODES_KERNEL", "auto")
    step = run(model, ids, kv.TurboQuantCache(model.config, **kw), 12)
    # every decode step over codes runs compiled (Gemma's sliding layers, window 8, hold only
    # exact tokens and go to SDPA); only multi-token forwards are composed
    decode = sum(r == model.config.num_attention_heads // model.config.num_key_value_heads
                 for r in rows)
    assert decode >= 40 - 12 - 8 and len(compiled) == decode
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(step.float(), plain.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(not tqvec.ops.has_cpu_kernels(), reason="compiled CPU kernels not built")
def test_compiled_step_plans_follow_the_buffers(monkeypatch):
    """A layer keeps its step plan (and the compiled kernel's form of it) while its code
    buffers keep their storage and makes a new one when they grow past it (or a segment
    appears): decoding far past the first allocation (64 tokens) gives the composition's
    logits at every step."""
    from tqvec.kv import attention
    from tqvec.ops import cpu

    model = llama()
    ids = torch.randint(0, 97, (1, 110), generator=torch.Generator().manual_seed(5))
    kw = dict(key_bits=3, value_bits=3, residual_length=3, sink_length=2, residual_bits=8)
    monkeypatch.setattr(attention, "CODES_KERNEL", "ref")
    plain = run(model, ids, kv.TurboQuantCache(model.config, **kw), 8)
    plans = []
    real_plan = cpu.step_plan
    monkeypatch.setattr(cpu, "step_plan", lambda *a: plans.append(1) or real_plan(*a))
    _, steps = _count_steps(monkeypatch)
    monkeypatch.setattr(attention, "CODES_KERNEL", "auto")
    step = run(model, ids, kv.TurboQuantCache(model.config, **kw), 8)
    layers = model.config.num_hidden_layers
    assert len(steps) >= 90 * layers
    assert 2 * layers <= len(plans) < len(steps) // 4  # remade as buffers grow, mostly reused
    torch.testing.assert_close(step, plain, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not tqvec.ops.has_cpu_kernels(), reason="compiled CPU kernels not built")
def test_compiled_decode_step_rejects_mismatched_buffers(monkeypatch):
    """A plan the compiled kernel cannot take as stored (another dtype, float32 multipliers)
    runs as the composition; one whose shapes disagree with its rows or the step's is refused
    with the parameter named."""
    from tqvec import ops
    from tqvec.ops import cpu
    cpu_dev = torch.device("cpu")
    q = make_quantizer("turbo", 16, 3, seed=0, role="keys")
    codes = q.encode_heads(torch.randn(1, 2, 5, 16))
    side = q.step_side(cpu_dev)
    packed = codes["payload"].reshape(2, 5, -1)
    fit = codes["fit"].reshape(2, 5)
    x = torch.randn(2, 3, 16)

    def plan(heads=2, d=16, kp=packed, mults=fit, sink=None, dtype=torch.float32):
        seg = ops.KVCodeSegment(side, side, kp, mults, packed, mults)
        return ops.KVStepPlan(heads, 2, d, dtype, [seg], sink)

    def step(p, qq, ranges=(0, 5), exact=((x, x),)):
        return ops.attention_step(qq, 0.25, p, list(ranges), list(exact))

    qq = torch.randn(2, 4, 16)
    out = step(plan(), qq)
    assert out.shape == (2, 4, 16) and torch.isfinite(out).all()
    ref = ops.attention_step(qq, 0.25, plan(), [0, 5], [(x, x)], backend="ref")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # rows held by the plan count as rows given to the step
    torch.testing.assert_close(step(plan(sink=(x, x)), qq, exact=()), out)
    # what the kernel does not take, the composition does (the plan's compiled form is made,
    # or not, and the compiled call does not run)
    compiled = []
    real_np = cpu.attention_step_np
    monkeypatch.setattr(cpu, "attention_step_np", lambda *a: compiled.append(1) or real_np(*a))
    for p, exact, held in ((plan(), ((x.half(), x.half()),), True),
                           (plan(mults=fit.float()), ((x, x),), False),
                           (plan(sink=(x, x), dtype=torch.float16), (), False)):
        got = step(p, qq, exact=exact)
        assert not compiled and (p.prepared["cpu"] is not None) == held
        torch.testing.assert_close(got, out, atol=2e-3, rtol=2e-3)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"dimension \(16\) must equal the queries' \(8\)"):
        step(plan(), torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="q"):
        step(plan(), torch.randn(4, 4, 16))
    with pytest.raises(ValueError, match="range"):
        step(plan(), qq, ranges=(0, 6))
    with pytest.raises(ValueError, match="ranges"):
        step(plan(), qq, ranges=(0, 5, 0, 5))
    with pytest.raises(ValueError, match="exact"):
        step(plan(), qq, exact=((x, x[:, :2]),))
    with pytest.raises(ValueError, match=r"dimension \(16, 16\) must equal the queries' \(8\)"):
        step(plan(d=8), torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="packed"):
        step(plan(kp=packed[:, :, 1:]), qq)
    with pytest.raises(ValueError, match="heads"):
        step(plan(heads=3), qq)
