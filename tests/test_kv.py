"""KV-cache adapter: tiny randomly initialised models built from configs (no hub access)."""

import math

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")

import tqvec  # noqa: E402
import tqvec.kv as kv  # noqa: E402
from tqvec.kv.quant import make_quantizer  # noqa: E402


def llama(seed=0, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      **kw)
    return LlamaForCausalLM(cfg).eval()


def gemma3(seed=0):
    """Sliding-window layers (window 8) mixed with a global one, q/k-norm, head_dim 32."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, sliding_window=8, max_position_embeddings=256,
                           layer_types=["sliding_attention", "sliding_attention",
                                        "full_attention"])
    return Gemma3ForCausalLM(cfg).eval()


def run(model, ids, cache, prefill):
    """Prefill, then one token at a time; returns the logits of every step (B, T-prefill+1, V)."""
    with torch.no_grad():
        out = [model(ids[:, :prefill], cache=cache).logits[:, -1:]]
        for t in range(prefill, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], cache=cache).logits)
    return torch.cat(out, dim=1)


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
def test_window_covering_sequence_reproduces_dynamic_cache_exactly(make):
    from transformers import DynamicCache
    model = make()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = run(model, ids, DynamicCache(config=model.config), 10)
    cache = kv.TurboQuantCache(model.config, residual_length=64, sink_length=0)
    got = run(model, ids, cache, 10)
    assert torch.equal(got, ref)
    assert cache.get_seq_length() == 24


@pytest.mark.parametrize("make", [llama, gemma3])
@pytest.mark.parametrize("keys", ["turbo", "turbo-vq", "turbo-prod", "qjl", "token"])
def test_attention_from_codes_matches_decode_then_sdpa(make, keys):
    """Same codes (calibrate=False), two attention paths: scores on the codes vs decoded
    tensors handed to SDPA. Sliding windows and the mask go through both."""
    model = make()
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(2))
    kw = dict(key_codec=keys, key_bits=3, value_bits=3, residual_length=3, sink_length=2,
              calibrate=False, value_codec={"qjl": "token", "turbo-vq": "turbo-vq"}.get(
                  keys, "turbo"))
    codes = run(model, ids, kv.TurboQuantCache(model.config, **kw), 12)
    model.config._attn_implementation = "sdpa"
    dec_cache = kv.TurboQuantCache(model.config, attention="decode", **kw)
    decoded = run(model, ids, dec_cache, 12)
    torch.testing.assert_close(codes, decoded, atol=2e-4, rtol=2e-4)


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
def test_compiled_decode_step_rejects_mismatched_buffers():
    """A plan the compiled kernel cannot take as stored (another dtype, float32 multipliers)
    runs as the composition; one whose shapes disagree with its rows or the step's is refused
    with the parameter named."""
    from tqvec import ops
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
    # what the kernel does not take, the composition does
    for p, exact in ((plan(), ((x.half(), x.half()),)), (plan(mults=fit.float()), ((x, x),)),
                     (plan(sink=(x, x), dtype=torch.float16), ())):
        assert p.prepared.get("cpu") is None
        torch.testing.assert_close(step(p, qq, exact=exact), out, atol=2e-3, rtol=2e-3)
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


def test_calibrated_cache_tracks_full_precision():
    from transformers import DynamicCache
    model = llama()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(3))
    ref = run(model, ids, DynamicCache(config=model.config), 16)
    errs = {}
    for bits in (2, 4):
        got = run(model, ids, kv.TurboQuantCache(model.config, key_bits=bits, value_bits=bits,
                                                 residual_length=2), 16)
        errs[bits] = ((got - ref).norm() / ref.norm()).item()
    assert errs[4] < errs[2] < 0.5
    assert errs[4] < 0.05


def test_generate_and_sequence_bookkeeping():
    model = llama()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    cache = kv.TurboQuantCache(model.config, residual_length=4)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                         max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 16)
    assert cache.get_seq_length() == 15  # the last generated token is never fed back
    assert cache.get_max_length() == -1


def test_accounting_is_exact():
    model = llama()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(5))
    cache = kv.TurboQuantCache(model.config, key_bits=3, value_bits=2, residual_length=8,
                               sink_length=0, calibrate=False)
    run(model, ids, cache, 20)
    d, H, L = 16, 2, 2
    kq = make_quantizer("turbo", d, 3, seed=0, role="keys")
    vq = make_quantizer("turbo", d, 2, seed=0, role="values")
    n_codes = 40 - 8
    expect = L * H * (n_codes * (kq.bytes_per_token + vq.bytes_per_token) + 8 * d * 4 * 2)
    assert cache.memory_bytes() == expect
    assert kq.bytes_per_token == 6 + 2 and vq.bytes_per_token == 4 + 2  # codes + fp16 norm
    assert cache.bits_per_element() == pytest.approx(8 * expect / (L * H * 40 * d * 2))


@pytest.mark.parametrize("make", [llama, gemma3])
@pytest.mark.parametrize("residual_bits", [None, 8])
def test_the_cache_holds_no_more_than_it_counts(make, residual_bits):
    """After a prefill and decode steps, the tensors a layer holds take no more storage than
    ``memory_bytes`` counts plus the code buffers' spare slots, and those are at most a
    sixteenth of the tokens (64 at least) and one move's block dropped from the front; a
    sliding layer holds only what later queries can see (a long prefill's tokens before its
    window are dropped, not coded and kept). The window's exact tokens must not be slices of
    the prompt's full-precision keys and values, which would keep all of them alive."""
    model = make()
    ids = torch.randint(0, 97, (1, 1100), generator=torch.Generator().manual_seed(3))
    cache = kv.TurboQuantCache(model.config, key_bits=3, value_bits=3, residual_length=8,
                               residual_bits=residual_bits)
    run(model, ids, cache, 1080)
    held = spare = 0
    for layer in cache.layers:
        tensors = [layer.keys, layer.values, layer.sink_k, layer.sink_v]
        for buf in (layer.kbuf, layer.vbuf, layer.wkbuf, layer.wvbuf):
            tensors += list(buf.data.values())
            if buf.data:
                slots = next(iter(buf.data.values())).shape[2] - len(buf)
                assert slots <= max(64, len(buf) // 16) + kv.CompressedLayer.MOVE_BLOCK
                spare += slots * sum(v[:, :, 0].numel() * v.element_size()
                                     for v in buf.data.values())
        held += sum(t.untyped_storage().nbytes() for t in tensors)
        for t in (layer.keys, layer.values):  # the window: its own storage
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        if layer.is_sliding:  # nothing that no later query can see
            assert len(layer.kbuf) + layer.window_length() <= layer.sliding_window - 1
    assert held <= cache.memory_bytes() + spare


@pytest.mark.parametrize("make", [llama, gemma3])
def test_represented_elements_are_what_a_dynamic_cache_holds(make):
    """bits/element divides by the elements a DynamicCache holds after the same run (a sliding
    layer keeps window - 1 tokens): the oracle is transformers' own cache, with sinks on."""
    model = make()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(5))
    dyn = transformers.DynamicCache(config=model.config)
    run(model, ids, dyn, 20)
    held = sum(layer.keys.numel() + layer.values.numel() for layer in dyn.layers)
    cache = kv.TurboQuantCache(model.config, key_bits=3, value_bits=2, residual_length=4,
                               sink_length=2, calibrate=False)
    run(model, ids, cache, 20)
    assert cache.represented_elements() == held
    assert cache.bits_per_element() == 8 * cache.memory_bytes() / held


def test_accounting_counts_calibration_tables():
    model = llama()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(5))
    plain = kv.TurboQuantCache(model.config, residual_length=8, calibrate=False)
    cal = kv.TurboQuantCache(model.config, residual_length=8, calibrate=True)
    run(model, ids, plain, 20)
    run(model, ids, cal, 20)
    # per layer and head: a mean and a scale (16 float32 each) for keys and for values
    assert cal.memory_bytes() - plain.memory_bytes() == 2 * 2 * (4 * 16 * 4)


def test_log_coded_norms_save_a_byte_per_scalar_and_stay_close():
    model = llama()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(5))
    c16 = kv.TurboQuantCache(model.config, residual_length=8, sink_length=0, calibrate=False)
    c8 = kv.TurboQuantCache(model.config, residual_length=8, sink_length=0, calibrate=False,
                            norm_bits=8)
    run(model, ids, c16, 20)
    run(model, ids, c8, 20)
    # per layer (2), head (2), coded token (32), keys and values: 1 byte saved; + the two
    # quantizers' 4-byte centres per layer
    assert c16.memory_bytes() - c8.memory_bytes() == 2 * 2 * 32 * 2 - 2 * 2 * 4
    for l16, l8 in zip(c16.layers, c8.layers, strict=True):
        k16, v16 = l16.decoded()
        k8, v8 = l8.decoded()
        # the prefill's tokens (the later ones depend on the cache through the model): only
        # the norms differ, by at most half a 1/16-octave step
        assert torch.allclose(k8[:, :, :20], k16[:, :, :20], rtol=0.023, atol=1e-6)
        assert torch.allclose(v8[:, :, :20], v16[:, :, :20], rtol=0.023, atol=1e-6)


def test_log8_norm_code_bounds():
    q = make_quantizer("turbo", 16, 3, seed=0, role="keys", norm_bits=8)
    x = torch.randn(200, 16) * torch.logspace(-2, 2, 200)[:, None]
    x[7] = 0
    f = q.encode(x)
    # the per-token scale is the fitted one (TurboQuant scale='fit'), coded in log steps
    assert f["fit"].dtype == torch.uint8 and q.bytes_per_token == 6 + 1
    got = q._codes(f).scalars["fit"].float()
    true = tqvec.TurboQuant(16, 3, "mse", 0, scale="fit").encode(x).scalars["fit"].float()
    assert got[7] == 0
    ok = true > 0
    assert ((got[ok] / true[ok]).log2().abs() <= 1 / 32 + 1e-3).all()  # half a step


@pytest.mark.parametrize("make", [llama, gemma3])
def test_8bit_window_tracks_the_full_precision_window(make):
    """residual_bits=8: a window covering the sequence, held as 8-bit codes, stays within a
    few thousandths of DynamicCache's logits; the current forward's tokens are exact (the
    prefill's logits are DynamicCache's bit for bit)."""
    from transformers import DynamicCache
    model = make()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = run(model, ids, DynamicCache(config=model.config), 10)
    cache = kv.TurboQuantCache(model.config, residual_length=64, sink_length=0,
                               residual_bits=8)
    got = run(model, ids, cache, 10)
    assert torch.equal(got[:, 0], ref[:, 0])
    assert ((got - ref).norm() / ref.norm()) < 0.02
    for layer in cache.layers:  # the full-attention layers hold all 24 tokens
        if not layer.is_sliding:  # (prefill 10; +14 in decode: 16 coded, 8 exact)
            assert len(layer.wkbuf) == 16 and layer.keys.shape[2] == 8


def test_8bit_window_moves_tokens_in_blocks():
    from transformers import DynamicCache
    model = llama()
    ids = torch.randint(0, 97, (1, 160), generator=torch.Generator().manual_seed(5))
    cache = kv.TurboQuantCache(model.config, residual_length=8, sink_length=2,
                               residual_bits=8)
    block = kv.layer.CompressedLayer.WINDOW_BLOCK
    move = kv.layer.CompressedLayer.MOVE_BLOCK
    with torch.no_grad():
        model(ids[:, :20], cache=cache)
        full = DynamicCache(config=model.config)
        model(ids[:, :20], cache=full)
        for layer, ref in zip(cache.layers, full.layers, strict=True):
            # the prompt (20 < residual_length + a block) went to the window whole; its sink
            # tokens went to the sink as they were, not through the 8-bit codes
            assert torch.equal(layer.sink_k, ref.keys[:, :, :2])
            assert torch.equal(layer.sink_v, ref.values[:, :, :2])
        codes = set()
        for t in range(20, 160):
            model(ids[:, t: t + 1], cache=cache)
            for layer in cache.layers:
                w = layer.window_length()
                assert 8 <= w < 8 + move and layer.keys.shape[2] < block
                assert (layer.sink_k.shape[2] + len(layer.kbuf) + w
                        == layer.cumulative_length == t + 1)
                codes.add(len(layer.kbuf))
        assert codes == {0, move, 2 * move}  # the overflow left in whole blocks


def test_older_transformers_one_kwargs_dict_for_every_layer(monkeypatch):
    """transformers <= 5.17 returns one kwargs dict for all layers (its sliding_window set when
    any layer slides): the window goes to the sliding layers only."""
    from tqvec.kv import cache as cache_mod

    model = gemma3()
    monkeypatch.setattr(cache_mod, "get_layer_types_and_kwargs", lambda cfg: (
        list(cfg.layer_types), {"sliding_window": cfg.sliding_window}))
    cache = kv.TurboQuantCache(model.config, key_bits=3, value_bits=3)
    assert [layer.is_sliding for layer in cache.layers] == [True, True, False]
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(2))
    monkeypatch.undo()
    torch.testing.assert_close(run(model, ids, cache, 20),
                               run(model, ids, kv.TurboQuantCache(model.config, key_bits=3,
                                                                  value_bits=3), 20))


def test_sliding_layers_move_their_8bit_window_in_small_blocks():
    """A sliding layer holds at most its window, so its 8-bit tokens move on 16 at a time; a
    full-attention layer's 64 at a time."""
    from tqvec.kv.layer import CompressedLayer, KVSettings
    st = KVSettings(residual_length=8, sink_length=0, residual_bits=8)
    for sliding, move in ((None, CompressedLayer.MOVE_BLOCK), (200, CompressedLayer.WINDOW_BLOCK)):
        layer = CompressedLayer(st, 0, sliding)
        x = torch.randn(1, 2, 300, 16)
        seen = set()
        for t in range(300):
            layer.update(x[:, :, t:t + 1], x[:, :, t:t + 1])
            layer.awaiting_attention = False
            layer.flush()
            if t >= 100:
                seen.add(layer.window_length())
        assert max(seen) == 8 + move - 1 and min(seen) == 8


def test_8bit_window_accounting_is_exact():
    model = llama()
    ids = torch.randint(0, 97, (1, 90), generator=torch.Generator().manual_seed(5))
    cache = kv.TurboQuantCache(model.config, key_bits=3, value_bits=2, residual_length=8,
                               sink_length=0, calibrate=False, residual_bits=8)
    run(model, ids, cache, 20)
    d, H, L = 16, 2, 2
    kq = make_quantizer("turbo", d, 3, seed=0, role="keys")
    vq = make_quantizer("turbo", d, 2, seed=0, role="values")
    wq = make_quantizer("turbo", d, 8, seed=0, role="keys")
    assert wq.bytes_per_token == d + 2  # 8 bits per element + the float16 scale
    # prefill 20: the overflow (12) is less than a move, the 20 window tokens go to 8-bit codes;
    # 21..36, 37..52, 53..68 exact, coded at 36, 52, 68; at 72 the overflow is a move: 64 to the
    # final codes (4 coded and 4 exact stay); 73..84 coded at 84; at 90 = 64 codes + 20 coded
    # window + 6 exact (float32)
    layer = cache.layers[0]
    assert (len(layer.kbuf), len(layer.wkbuf), layer.keys.shape[2]) == (64, 20, 6)
    expect = L * H * (64 * (kq.bytes_per_token + vq.bytes_per_token)
                      + 20 * 2 * wq.bytes_per_token + 6 * 2 * d * 4)
    assert cache.memory_bytes() == expect
    assert cache.bits_per_element() == pytest.approx(8 * expect / (L * H * 90 * d * 2))


@pytest.mark.parametrize("make", [llama, gemma3])
def test_8bit_window_codes_attention_matches_decode_then_sdpa(make, monkeypatch):
    """The 8-bit window goes through both attention paths (codes, fused op, decode-then-SDPA)
    with the same numbers; sliding layers evict from it."""
    from tqvec.kv import attention
    model = make()
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(2))
    kw = dict(key_bits=3, value_bits=3, residual_length=5, sink_length=2, residual_bits=8)
    monkeypatch.setattr(attention, "CODES_KERNEL", "never")
    codes = run(model, ids, kv.TurboQuantCache(model.config, **kw), 12)
    monkeypatch.setattr(attention, "CODES_KERNEL", "ref")
    fused = run(model, ids, kv.TurboQuantCache(model.config, **kw), 12)
    torch.testing.assert_close(fused, codes, atol=1e-4, rtol=1e-4)
    # decode-then-SDPA sees no queries, so no query-weighted calibration: compare without
    monkeypatch.setattr(attention, "CODES_KERNEL", "auto")
    codes = run(model, ids, kv.TurboQuantCache(model.config, calibrate=False, **kw), 12)
    model.config._attn_implementation = "sdpa"
    decoded = run(model, ids, kv.TurboQuantCache(model.config, attention="decode",
                                                 calibrate=False, **kw), 12)
    torch.testing.assert_close(codes, decoded, atol=2e-4, rtol=2e-4)


def chunked(model, ids, cache, chunk):
    """Logits of every position, the sequence fed in forwards of ``chunk`` tokens."""
    with torch.no_grad():
        return torch.cat([model(ids[:, a:a + chunk], cache=cache).logits
                          for a in range(0, ids.shape[1], chunk)], dim=1)


@pytest.mark.parametrize("make", [llama, gemma3])
@pytest.mark.parametrize("kw", [dict(calibrate=False), dict(calibrate=True),
                                dict(residual_bits=8, norm_bits=8), dict(dtype=torch.bfloat16),
                                dict(outlier_channels=8)])
def test_many_row_forward_attends_over_decoded_tokens(make, kw, monkeypatch):
    """A forward of DECODED_FROM or more new tokens over stored codes (a chunked prefill, a
    later turn's prompt) decodes the stored tokens once and runs SDPA: the same logits as
    scoring the codes row by row, channel scales, 8-bit windows, outlier splits, bf16 and
    sliding layers included; BalanceKV keeps the codes path (its token weights)."""
    from tqvec.kv import attention

    kw = dict(kw)
    dtype = kw.pop("dtype", torch.float32)
    model = make().to(dtype)
    ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(7))
    kw = dict(dict(key_bits=3, value_bits=3, residual_length=3, sink_length=2), **kw)
    monkeypatch.setattr(attention, "DECODED_FROM", 0)
    rows = chunked(model, ids, kv.TurboQuantCache(model.config, **kw), 12)
    decoded, real = [], kv.CompressedLayer.decoded
    monkeypatch.setattr(kv.CompressedLayer, "decoded",
                        lambda self: decoded.append(self.mr is not None) or real(self))
    monkeypatch.setattr(attention, "DECODED_FROM", 12)
    sdpa = chunked(model, ids, kv.TurboQuantCache(model.config, **kw), 12)
    # the chunks after the first that find codes stored (with an 8-bit window: from 16 tokens
    # on), in the global layer at least
    assert len(decoded) >= 2
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(sdpa.float(), rows.float(), atol=tol, rtol=tol)
    decoded.clear()
    chunked(model, ids, kv.TurboQuantCache(model.config, balance=kv.BalanceConfig(rounds=1),
                                           **kw), 12)
    assert decoded == [False] * len(decoded)  # Gemma's sliding layers select no tokens


def test_8bit_window_crop_and_reorder():
    model = llama()
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(6))
    kw = dict(key_bits=3, value_bits=3, residual_length=4, residual_bits=8)
    cache = kv.TurboQuantCache(model.config, **kw)
    run(model, ids[:, :25], cache, 10)
    before = [layer.decoded() for layer in cache.layers]
    cache.crop(-6)  # 25 -> 19 tokens: 4 leave the 8-bit window, 2 leave the codes
    assert cache.get_seq_length() == 19
    for layer, (k, v) in zip(cache.layers, before, strict=True):
        k2, v2 = layer.decoded()
        assert torch.equal(k2, k[:, :, :19]) and torch.equal(v2, v[:, :, :19])
    cache.reorder_cache(torch.tensor([1, 0]))
    for layer, (k, v) in zip(cache.layers, before, strict=True):
        k2, v2 = layer.decoded()
        assert torch.equal(k2, k[:, :, :19].flip(0)) and torch.equal(v2, v[:, :, :19].flip(0))
    with torch.no_grad():
        logits = model(ids[:, 19:21], cache=cache).logits
    assert torch.isfinite(logits).all() and cache.get_seq_length() == 21


def test_crop_drops_exactly_the_last_tokens():
    model = llama()
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(6))
    cache = kv.TurboQuantCache(model.config, key_bits=3, value_bits=3, residual_length=4)
    run(model, ids[:, :25], cache, 10)
    before = [layer.decoded() for layer in cache.layers]
    cache.crop(-6)  # 25 -> 19 tokens: 4 leave the window, 2 leave the codes
    assert cache.get_seq_length() == 19
    for layer, (k, v) in zip(cache.layers, before, strict=True):
        k2, v2 = layer.decoded()
        assert torch.equal(k2, k[:, :, :19]) and torch.equal(v2, v[:, :, :19])
    with torch.no_grad():
        logits = model(ids[:, 19:21], cache=cache).logits
    assert torch.isfinite(logits).all() and cache.get_seq_length() == 21


def test_reorder_cache_swaps_batch_rows():
    model = llama()
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(7))
    cache = kv.TurboQuantCache(model.config, residual_length=3)
    run(model, ids, cache, 10)
    with torch.no_grad():
        nxt = torch.tensor([[5], [11]])
        cache.reorder_cache(torch.tensor([1, 0]))
        swapped = model(nxt.flip(0), cache=cache).logits
    cache2 = kv.TurboQuantCache(model.config, residual_length=3)
    run(model, ids, cache2, 10)
    with torch.no_grad():
        plain = model(nxt, cache=cache2).logits
    torch.testing.assert_close(swapped, plain.flip(0), atol=1e-5, rtol=1e-5)


def test_left_padded_batch_matches_unpadded_rows():
    model = llama()
    g = torch.Generator().manual_seed(8)
    a = torch.randint(1, 97, (1, 20), generator=g)
    b = torch.randint(1, 97, (1, 14), generator=g)
    kw = dict(key_bits=4, value_bits=4, residual_length=2, sink_length=0, calibrate=False)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 6, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :6] = 0
    cache = kv.TurboQuantCache(model.config, **kw)
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        lb = model(batch, attention_mask=mask, position_ids=pos,
                   cache=cache).logits[1, -1]
        single = model(b, cache=kv.TurboQuantCache(model.config, **kw)).logits[0, -1]
    torch.testing.assert_close(lb, single, atol=1e-4, rtol=1e-4)


def test_left_pads_are_neither_sinks_nor_calibration():
    """A left-padded row's pad tokens (masked in attention) change nothing: the results are
    the same whatever the pad tokens are (they entered the channel calibration, and took the
    sink slots, before), and the padded row's sink holds its own first tokens."""
    model = llama(3)
    g = torch.Generator().manual_seed(4)
    a = torch.randint(1, 97, (1, 60), generator=g)
    b = torch.randint(1, 97, (1, 40), generator=g)
    P = 20
    mask = torch.ones(2, 60, dtype=torch.long)
    mask[1, :P] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    kw = dict(key_bits=2, value_bits=2, residual_length=8)
    outs, caches = [], []
    for pad_token in (0, 13):
        batch = torch.cat([a, torch.cat([torch.full((1, P), pad_token), b], 1)])
        cache = kv.TurboQuantCache(model.config, **kw)
        with torch.no_grad():
            model(batch, attention_mask=mask, position_ids=pos, cache=cache)
            m2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            outs.append(model(torch.tensor([[5], [7]]), attention_mask=m2,
                              position_ids=pos[:, -1:] + 1, cache=cache).logits)
        caches.append(cache)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    alone = kv.TurboQuantCache(model.config, **kw)
    with torch.no_grad():
        model(b, cache=alone)
    sink = caches[0].layers[0].sink_k
    assert sink.shape[2] == P + 4
    torch.testing.assert_close(sink[1, :, P:], alone.layers[0].sink_k[0], atol=1e-5, rtol=1e-5)


def test_left_padded_beam_search_keeps_each_rows_pads():
    """Beam search repeats and reorders the batch: each row's pads follow it (the codes made
    after the reorder weight the right tokens), and generation runs to the end."""
    model = llama(3)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(1, 97, (2, 30), generator=g)
    ids[1, :10] = 0
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    cache = kv.TurboQuantCache(model.config, key_bits=3, value_bits=3, residual_length=40)
    out = model.generate(ids, attention_mask=mask, cache=cache, num_beams=2, max_new_tokens=24,
                         do_sample=False)
    assert out.shape == (2, 54)
    assert cache.layers[0].pads.tolist() == [0, 0, 10, 10]  # two beams per prompt
    cache = kv.TurboQuantCache(model.config, key_bits=3, value_bits=3, residual_length=40)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
    cache.reorder_cache(torch.tensor([1, 0]))
    assert [layer.pads.tolist() for layer in cache.layers] == [[10, 0]] * 2
    cache.batch_repeat_interleave(2)
    assert cache.layers[0].pads.tolist() == [10, 10, 0, 0]


@pytest.mark.parametrize("kind,bits", [("turbo-prod", 3), ("qjl", 2)])
def test_key_scores_are_unbiased(kind, bits):
    """Mean over 300 seeds of the estimated <q, k> equals the true value within 4 s.e."""
    g = torch.Generator().manual_seed(9)
    k = torch.randn(1, 1, 6, 32, generator=g)
    q = torch.randn(1, 1, 2, 32, generator=g) + 0.5 * k[:, :, :2]
    true = q @ k.transpose(-1, -2)
    est = []
    for seed in range(300):
        qz = make_quantizer(kind, 32, bits, seed=seed, role="keys")
        est.append(qz.scores(q, qz.encode_heads(k)))
    est = torch.stack(est)
    se = est.std(0) / math.sqrt(len(est))
    assert bool(((est.mean(0) - true).abs() <= 4 * se + 1e-6).all())


@pytest.mark.parametrize("d", [16, 64])
def test_block_vq_codes_beat_scalar_codes_at_equal_bytes(d):
    """turbo-vq: same bytes per token as turbo, lower error at every width; its scores and
    value sums are those of its decoded rows; a zero row stays zero."""
    from tqvec.codebooks import sphere_block_codebook, sphere_codebook
    g = torch.Generator().manual_seed(20)
    x = torch.randn(3000, d, generator=g) * torch.linspace(0.3, 3, d)
    x[5] = 0
    for bits in (1, 2, 3, 4):
        vq = make_quantizer("turbo-vq", d, bits, seed=1, role="keys")
        sq = make_quantizer("turbo", d, bits, seed=1, role="keys")
        assert vq.bytes_per_token == sq.bytes_per_token
        assert vq.expected_mse < 0.96 * sphere_codebook(d, bits).mse
        assert sphere_block_codebook(d, bits, vq.block) is sphere_block_codebook(
            d, bits, vq.block)  # once per process
        f = {k: v[None, None] for k, v in vq.encode(x).items()}
        fs = {k: v[None, None] for k, v in sq.encode(x).items()}

        def rel(q, f):
            xh = q.decode(f)[0, 0]
            return float(((xh - x)[x.norm(dim=1) > 0].norm(dim=1) ** 2
                          / x[x.norm(dim=1) > 0].norm(dim=1) ** 2).mean()), xh
        e_vq, xh = rel(vq, f)
        e_sq, _ = rel(sq, fs)
        assert e_vq < 0.97 * e_sq, (bits, e_vq, e_sq)
        assert e_vq == pytest.approx(vq.expected_mse, rel=0.15)
        assert not xh[5].any()
        q = torch.randn(1, 1, 4, d, generator=g)
        torch.testing.assert_close(vq.scores(q, f), q @ xh.T[None, None], rtol=1e-4, atol=1e-3)
        p = torch.softmax(torch.randn(1, 1, 4, len(x), generator=g), -1)
        torch.testing.assert_close(vq.weighted_sum(p, f), p @ xh, rtol=1e-4, atol=1e-5)
    n8 = make_quantizer("turbo-vq", d, 2, seed=1, role="values", norm_bits=8)
    n16 = make_quantizer("turbo-vq", d, 2, seed=1, role="values")
    assert n8.bytes_per_token == n16.bytes_per_token - 1
    f8 = {k: v[None, None] for k, v in n8.encode(x).items()}
    assert f8["fit"].dtype == torch.uint8
    with pytest.raises(ValueError, match="key_bits must be 1..4 for 'turbo-vq'"):
        make_quantizer("turbo-vq", d, 5, seed=1, role="keys")


def test_block_codebook_is_seeded_and_checks_arguments():
    from tqvec.codebooks import sphere_block_codebook
    a, b = (sphere_block_codebook.__wrapped__(16, 3, 2) for _ in range(2))
    np.testing.assert_array_equal(a.points, b.points)
    assert a.points.shape == (64, 2) and a.block == 2
    with pytest.raises(ValueError, match="block must be 1, 2, 4 or 8 and divide dim=6"):
        sphere_block_codebook(6, 2, 4)
    with pytest.raises(ValueError, match="bits \\* block must be <= 8"):
        sphere_block_codebook(16, 3, 4)
    with pytest.raises(ValueError, match="dim must be an int >= 2"):
        sphere_block_codebook(1, 2, 1)


def test_channel_split_codes_outliers_wider():
    g = torch.Generator().manual_seed(10)
    x = torch.randn(1, 2, 64, 32, generator=g)
    x[:, :, :, 3] *= 30  # a fixed outlier channel per head, as RoPE keys have
    split = make_quantizer("turbo", 32, 2, seed=0, role="keys", outlier_channels=4,
                           outlier_bits=5)
    split.set_channels(x)
    assert bool((split.channels == 3).any(-1).all())
    plain = make_quantizer("turbo", 32, 2, seed=0, role="keys")
    err_split = (split.decode(split.encode_heads(x)) - x).norm()
    err_plain = (plain.decode(plain.encode_heads(x)) - x).norm()
    assert err_split < 0.5 * err_plain


def rope_keys(T: int, d: int = 16, base: float = 1e4, start: int = 0) -> torch.Tensor:
    """(1, 1, T, d) keys with a fixed pre-RoPE mean and noise, rotated as HF's rotate_half
    layout does: pair (i, i + d/2) turns by position * base^(-2i/d)."""
    g = torch.Generator().manual_seed(12)
    h = d // 2
    pre = torch.full((d,), 3.0) + 0.3 * torch.randn(T, d, generator=g)
    pos = torch.arange(start, start + T, dtype=torch.float32)[:, None]
    ang = pos * base ** (-2 * torch.arange(h, dtype=torch.float32) / d)
    c, s = torch.cos(ang), torch.sin(ang)
    a, b = pre[:, :h], pre[:, h:]
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1)[None, None]


def test_key_calibration_respects_rope_pairs():
    from tqvec.kv.quant import ChannelScale
    d, h = 16, 8
    k = rope_keys(256, d)
    q_energy = torch.rand(1, h, generator=torch.Generator().manual_seed(13)) + 0.5
    q_energy = torch.cat([q_energy, q_energy], -1)  # RoPE'd queries: even in a pair
    cal = ChannelScale(make_quantizer("turbo", d, 3, seed=0, role="keys"), rope_pairs=True)
    cal.calibrate(k, q_energy)
    # pair i turns by 256 * 1e4^(-i/8) rad over the calibration tokens (0.08, 0.26, 0.81,
    # 2.6, ... for i = 7, 6, 5, 4): the still pairs keep their mean, the turning ones lose it,
    # the fast ones average to ~0 anyway
    turned = 256 * 1e4 ** (-torch.arange(h) / h)
    pair_mean = (cal.mean[0, :h] ** 2 + cal.mean[0, h:] ** 2).sqrt()
    full = k.mean(dim=(0, 2))[0]
    still = turned < 0.5
    assert still.sum() == 2
    torch.testing.assert_close(cal.mean[0, :h][still], full[:h][still])
    assert bool((pair_mean[(turned > 0.7) & (turned < 10)] == 0).all())
    assert bool((pair_mean[turned >= 10] < 0.1).all())
    assert torch.equal(cal.mean[0, :h] != 0, cal.mean[0, h:] != 0)
    torch.testing.assert_close(cal.scale[0, :h], cal.scale[0, h:])  # tied within each pair
    # 256 tokens later: a rotation-based quantizer's score error is ~ ||(k - mu) / s||^2 *
    # sum_i Q_i s_i^2, and the turning pairs' prefill means and untied scales cost there. (A
    # kept pair turning 0.26 rad over the calibration tokens is ~1 rad away 1,000 tokens on,
    # where its mean stops helping: the threshold trades that against noisy still pairs.)
    later = rope_keys(256, d, start=512)
    untied = ChannelScale(make_quantizer("turbo", d, 3, seed=0, role="keys"))
    untied.calibrate(k, q_energy)

    def cost(c):
        return (c.transform(later) ** 2).sum(-1).mean() * (q_energy * c.scale ** 2).sum()
    assert cost(cal) < 0.8 * cost(untied)
    # still exact algebra: <q, k> = <q s, (k - mu) / s> + <q, mu>
    q = torch.randn(1, 1, 3, d, generator=torch.Generator().manual_seed(14))
    exact = q @ later.transpose(-1, -2)
    got = (q * cal.scale) @ cal.transform(later).transpose(-1, -2) + (q * cal.mean).sum(
        -1, keepdim=True)
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-3)
    # too few tokens to tell: no mean at all
    few = ChannelScale(make_quantizer("turbo", d, 3, seed=0, role="keys"), rope_pairs=True)
    few.calibrate(k[:, :, :3], q_energy)
    assert not few.mean.any()


@pytest.mark.parametrize("make", [llama, gemma3])
@pytest.mark.parametrize("calibrate", [True, False])
def test_outlier_channel_split_in_the_cache(make, calibrate):
    """outlier_channels through the cache, with the default channel scale in front of the split
    (the first flush used to raise: the split inside a scale was never given its channels): the
    channels are picked from what the split codes, the logits stay as close to the full-precision
    cache as the plain cache's, and the bits count both widths and both norms."""
    from transformers import DynamicCache
    model = make()
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    ref = run(model, ids, DynamicCache(config=model.config), 12)
    kw = dict(key_bits=2, value_bits=2, residual_length=2, sink_length=0, calibrate=calibrate,
              outlier_channels=4, outlier_bits=4, value_outlier_channels=4)
    cache = kv.TurboQuantCache(model.config, **kw)
    got = run(model, ids, cache, 12)
    plain_cache = kv.TurboQuantCache(model.config, **dict(kw, outlier_channels=0,
                                                          value_outlier_channels=0))
    plain = run(model, ids, plain_cache, 12)
    layer = next(lay for lay in cache.layers if lay.kq is not None and len(lay.kbuf))
    split = layer.kq.inner if calibrate else layer.kq
    assert split.channels is not None and split.channels.shape[-1] == 4
    assert torch.isfinite(got).all()
    # random tiny models have no outlier channels to gain on: same order of error as the plain
    # 2-bit cache (the gain on real keys is measured in bench/kv.py; the quantizer test above
    # checks it on an outlier channel)
    assert (got - ref).abs().mean() < 2 * (plain - ref).abs().mean()
    # 4 of d channels at 4 bits instead of 2 for keys and values, plus the second quantizer's
    # per-token norm (16 bits over d = 16 channels here: the split is costly at tiny d)
    d = layer.head_dim
    assert cache.bits_per_element() > plain_cache.bits_per_element() + 2 * 4 * 2 / d


@pytest.mark.parametrize("bad,match", [
    (dict(key_codec="nope"), "key_codec"),
    (dict(value_codec="qjl"), "value_codec"),
    (dict(key_bits=0), "key_bits"),
    (dict(key_bits=2.5), "fractional"),
    (dict(key_codec="turbo-prod", key_bits=1), "turbo-prod"),
    (dict(residual_length=-1), "residual_length"),
    (dict(group=5, key_codec="token"), "group"),
    (dict(balance=kv.BalanceConfig(), attention="decode"), "balance"),
    (dict(attention="fast"), "attention"),
    (dict(norm_bits=4), "norm_bits"),
    (dict(residual_bits=4), "residual_bits"),
])
def test_bad_configurations_are_rejected(bad, match):
    model = llama()
    with pytest.raises(ValueError, match=match):
        kv.TurboQuantCache(model.config, **bad)


@pytest.mark.parametrize("residual_bits, at, what", [(None, 5, "key"), (8, 5, "key"),
                                                     (8, 90, "key/value")])
def test_nonfinite_model_states_are_named(residual_bits, at, what):
    # a model that overflows its dtype hands the cache NaN/Inf states: the error says so, with
    # the layer, instead of the codec's rows of its flattened input
    model = llama()
    cache = kv.TurboQuantCache(model.config, residual_length=20, residual_bits=residual_bits)
    k, v = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16)
    k[0, 1, at, 3] = math.inf  # token 5 is coded at the flush, 90 goes to the 8-bit window
    cache.update(k, v, 1)
    with pytest.raises(ValueError, match=rf"layer 1: the model's {what} states hold NaN/Inf"):
        cache.layers[1].flush()


def test_non_config_rejected():
    with pytest.raises(TypeError, match="config"):
        kv.TurboQuantCache({"num_hidden_layers": 2})


# -- per-layer settings and the planner ---------------------------------------------------------
def test_layer_overrides_set_each_layers_settings():
    model = gemma3()
    cache = kv.TurboQuantCache(model.config, key_bits=3, value_bits=3, residual_length=6,
                               layer_overrides={"sliding_attention": dict(residual_length=2),
                                                1: dict(key_bits=4),
                                                "full_attention": dict(value_bits=2)})
    s = [layer.settings for layer in cache.layers]
    assert [(x.key_bits, x.value_bits, x.residual_length) for x in s] == [
        (3, 3, 2), (4, 3, 2), (3, 2, 6)]  # the index's entry on top of its type's
    assert "layer_overrides" in repr(cache)
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(3))
    run(model, ids, cache, 12)
    # each layer holds its own window and codes at its own widths
    assert [layer.window_length() for layer in cache.layers] == [2, 2, 6]
    assert [layer.kq.bytes_per_token for layer in cache.layers] == [
        make_quantizer("turbo", 32, b, seed=0, role="keys").bytes_per_token for b in (3, 4, 3)]
    # the bytes follow each layer's own settings
    plain = kv.TurboQuantCache(model.config, key_bits=3, value_bits=3, residual_length=6)
    run(model, ids, plain, 12)
    assert cache.memory_bytes() != plain.memory_bytes()
    assert cache.layers[2].nbytes() < plain.layers[2].nbytes()  # 2-bit values on layer 2


def test_layer_overrides_equal_to_defaults_change_nothing():
    model = llama()
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(3))
    a = run(model, ids, kv.TurboQuantCache(model.config, residual_length=4), 10)
    b = run(model, ids, kv.TurboQuantCache(model.config, residual_length=4,
                                           layer_overrides={0: dict(key_bits=3)}), 10)
    assert torch.equal(a, b)


@pytest.mark.parametrize("bad,err,match", [
    ("nope", TypeError, "mapping"),
    ({"sliding_attention": {}}, ValueError, "no 'sliding_attention' layers"),
    ({2: {}}, ValueError, r"index 2 is outside 0\.\.1"),
    ({-1: {}}, ValueError, "outside"),
    ({1.0: {}}, TypeError, "keys must be layer indices"),
    ({0: 3}, TypeError, r"layer_overrides\[0\] must be a mapping"),
    ({0: dict(seed=3)}, TypeError, "unknown option"),
    ({0: dict(key_bits=9)}, ValueError, r"layer 0, full_attention\): key_bits"),
    ({1: dict(key_codec="nope")}, ValueError, r"layer 1.*key_codec"),
    ({0: dict(residual_bits=4)}, ValueError, "residual_bits"),
])
def test_bad_layer_overrides_are_rejected(bad, err, match):
    with pytest.raises(err, match=match):
        kv.TurboQuantCache(llama().config, layer_overrides=bad)


def test_layer_error_is_small_for_wide_codes_and_grows_as_bits_drop():
    model = gemma3()
    ids = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(2))
    samples = kv.capture_attention_inputs(model, ids)
    assert len(samples) == 3 and samples[0].sliding_window == 8
    assert samples[2].sliding_window is None and samples[0].key.shape == (1, 1, 48, 32)
    errs, bits_el = {}, {}
    for bits in (2, 4, 8):
        e, b, n = kv.layer_error(dict(key_bits=bits, value_bits=bits, residual_length=0,
                                      sink_length=0), samples[2], queries=16)
        errs[bits], bits_el[bits] = e, b
        assert n == 2 * 1 * 48 * 32  # keys + values of the 48 tokens the global layer holds
    assert errs[8] < 0.005 < errs[4] < errs[2] / 2  # 2 more bits: at least half the error
    # the same norms and calibration tables at every width: bits/element differ by the codes'
    assert bits_el[8] - bits_el[4] == pytest.approx(4)
    assert bits_el[4] - bits_el[2] == pytest.approx(2)
    # a window holding every query's context exactly: no error at all
    e, _, _ = kv.layer_error(dict(residual_length=48), samples[2], queries=16)
    assert e < 1e-3  # float16 storage only


def test_causal_mask_of_a_sliding_window_by_hand():
    """L = 6 keys, the last 3 queries (positions 3, 4, 5), a window of 2: each query sees
    itself and the one token before it, as a sliding layer of window 2 holds them."""
    m = kv.plan.causal_mask(6, 3, 2)[0, 0].int().tolist()
    assert m == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]
    full = kv.plan.causal_mask(4, 2, None)[0, 0].int().tolist()
    assert full == [[1, 1, 1, 0], [1, 1, 1, 1]]


def test_layer_error_of_an_exact_sliding_layer_is_zero():
    """A window that holds every token a sliding layer keeps: the measured attention equals the
    reference up to float16 storage - only if the reference's mask is the cache's window."""
    model = gemma3()
    ids = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(2))
    samples = kv.capture_attention_inputs(model, ids)
    assert samples[0].sliding_window == 8
    e, _, n = kv.layer_error(dict(residual_length=48, sink_length=0), samples[0], queries=16)
    assert e < 1e-3  # float16 storage only (a mask one token wider: 0.31)
    assert n == 2 * 1 * 7 * 32  # keys + values of the window - 1 tokens the layer keeps


def test_layer_error_with_a_short_prefill_stores_the_same_tokens():
    """prefill < L - queries: calibrated on the first tokens, the rest appended in one block;
    what the layer stands for (elements, bits) is the same, the default is the longest
    prefill, and bad values are refused."""
    model = gemma3()
    ids = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(2))
    samples = kv.capture_attention_inputs(model, ids)
    opts = dict(key_bits=3, value_bits=3, residual_length=4, sink_length=0)
    for s in (samples[0], samples[2]):  # sliding and global
        e_long, b_long, n_long = kv.layer_error(opts, s, queries=16)
        e_short, b_short, n_short = kv.layer_error(opts, s, queries=16, prefill=8)
        assert n_short == n_long and b_short == pytest.approx(b_long)
        assert 0.01 < e_short < 1 and 0.01 < e_long < 1
        # the default is the longest prefill
        assert kv.layer_error(opts, s, queries=16, prefill=32) == (e_long, b_long, n_long)
    with pytest.raises(ValueError, match="prefill"):
        kv.layer_error(opts, samples[2], queries=16, prefill=33)
    with pytest.raises(TypeError, match="prefill"):
        kv.layer_error(opts, samples[2], queries=16, prefill=8.0)


def test_choose_solves_the_budgeted_knapsack_exactly_on_a_small_case():
    import itertools

    from tqvec.kv.plan import choose
    # 3 layers x 3 candidates of (error, bits, elements); layer 2 stands for twice the elements
    measured = {"lo": [(0.30, 2.0, 10), (0.20, 2.0, 10), (0.40, 2.0, 20)],
                "mid": [(0.10, 3.0, 10), (0.18, 3.0, 10), (0.20, 3.0, 20)],
                "hi": [(0.05, 4.0, 10), (0.17, 4.0, 10), (0.15, 4.0, 20)]}
    def best(limit):  # brute force over all 27 plans
        return min(sum(measured[c][i][0] for i, c in enumerate(p)) / 3
                   for p in itertools.product(measured, repeat=3)
                   if sum(measured[c][i][1] * measured[c][i][2] for i, c in enumerate(p)) / 40
                   <= limit)

    for budget in (2.1, 2.5, 2.9, 3.1, 3.25, 3.6, 4.0):
        pick, bits, err = choose(measured, budget)
        assert bits <= budget and bits == pytest.approx(sum(
            measured[c][i][1] * measured[c][i][2] for i, c in enumerate(pick)) / 40)
        # never better than the optimum, never worse than the optimum of a budget smaller by
        # the rounding (3 layers x budget / resolution)
        assert best(budget + 1e-12) - 1e-12 <= err <= best(budget * (1 - 3 / 20000)) + 1e-12
    with pytest.raises(ValueError, match="budget must be >= 2.000"):
        choose(measured, 1.5)


def test_choose_with_weights_minimises_the_weighted_squared_error():
    import itertools

    from tqvec.kv.plan import choose
    measured = {"lo": [(0.30, 2.0, 10), (0.20, 2.0, 10), (0.40, 2.0, 20)],
                "hi": [(0.05, 4.0, 10), (0.10, 4.0, 10), (0.15, 4.0, 20)]}
    weights = [0.0, 5.0, 1.0]  # layer 0's error costs nothing: it never gets the bits
    pick, bits, _ = choose(measured, 3.0, weights)
    best = min(sum(weights[i] * measured[c][i][0] ** 2 for i, c in enumerate(p))
               for p in itertools.product(measured, repeat=3)
               if sum(measured[c][i][1] * measured[c][i][2] for i, c in enumerate(p)) / 40 <= 3)
    assert sum(weights[i] * measured[c][i][0] ** 2 for i, c in enumerate(pick)) == best
    assert pick == ["lo", "hi", "lo"] and bits == 2.5  # a tie goes to the cheaper candidate
    with pytest.raises(ValueError, match="weights must be 3 finite numbers"):
        choose(measured, 3.0, [1.0, -1.0, 1.0])


def test_layer_sensitivity_sees_which_layers_reach_the_loss():
    model = llama()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # layer 0's attention output is thrown away: its error cannot matter
        model.model.layers[0].self_attn.o_proj.weight.zero_()
    sens = kv.layer_sensitivity(model, ids, eps=0.2)
    assert len(sens) == 2 and sens[0] == 0.0 and sens[1] > 0
    assert sens == kv.layer_sensitivity(model, ids, eps=0.2)  # seeded
    assert model.config._attn_implementation != "tqvec_noisy"  # restored
    with pytest.raises(ValueError, match="eps"):
        kv.layer_sensitivity(model, ids, eps=2.0)


def test_plan_layers_spends_the_budget_where_it_buys_error():
    model = gemma3()
    ids = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(2))
    cands = {"k2v2": dict(key_bits=2, value_bits=2), "k4v4": dict(key_bits=4, value_bits=4)}
    base = dict(residual_length=0, sink_length=0)
    cheap = kv.plan_layers(model, ids, 100, candidates={"k2v2": cands["k2v2"]}, base=base,
                           queries=16, objective="error")
    lines = []
    rich = kv.plan_layers(model, ids, 100, candidates=cands, base=base, queries=16,
                          progress=lines.append, objective="error")
    assert len(lines) == 2 and lines[1].startswith("plan_layers: 2/2 k4v4: mean error")
    assert rich.choice == ["k4v4"] * 3 and rich.error < cheap.error
    mid_budget = (cheap.bits + rich.bits) / 2
    mid = kv.plan_layers(model, ids, mid_budget, candidates=cands, base=base, queries=16,
                         objective="error")
    assert mid.bits <= mid_budget and cheap.error >= mid.error >= rich.error
    assert set(mid.choice) == {"k2v2", "k4v4"}
    # the default objective weighs each layer's squared error by the loss's sensitivity
    loss = kv.plan_layers(model, ids, mid_budget, candidates=cands, base=base, queries=16)
    assert loss.objective == "loss" and len(loss.sensitivity) == 3 and loss.bits <= mid_budget
    assert loss.loss_increase == pytest.approx(sum(
        loss.sensitivity[i] * loss.measured[c][i][0] ** 2 for i, c in enumerate(loss.choice)))
    # the plan drives the cache: its layers get the chosen widths
    cache = kv.TurboQuantCache(model.config, **base, layer_overrides=mid.overrides)
    assert [layer.settings.key_bits for layer in cache.layers] == [
        cands[c]["key_bits"] for c in mid.choice]
    with pytest.raises(ValueError, match="budget"):
        kv.plan_layers(model, ids, 0, candidates=cands)
    with pytest.raises(ValueError, match="queries must be in 1..47"):
        kv.plan_layers(model, ids, 3, candidates=cands)
    with pytest.raises(TypeError, match="candidate 'x': unknown cache option"):
        kv.plan_layers(model, ids, 3, candidates={"x": dict(bits=3)})
    with pytest.raises(ValueError, match="candidate 'y': key_bits"):
        kv.plan_layers(model, ids, 3, candidates={"y": dict(key_bits=0)})


def test_candidate_grid_names_every_setting_of_one_codec():
    grid = kv.candidate_grid()
    assert len(grid) == 36 and grid == kv.plan.DEFAULT_CANDIDATES
    assert grid["k3v2-r16"] == dict(key_bits=3, value_bits=2, residual_length=16)
    vq = kv.candidate_grid("turbo-vq", key_bits=(3,), value_bits=(2, 3), windows=(32,))
    assert vq == {f"k3v{b}-r32": dict(key_codec="turbo-vq", value_codec="turbo-vq", key_bits=3,
                                      value_bits=b, residual_length=32) for b in (2, 3)}
    # a vq plan measures vq caches: the same bytes as scalar codes, less error
    model = gemma3()
    ids = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(2))
    base = dict(sink_length=0)
    plans = {c: kv.plan_layers(model, ids, 100, candidates=kv.candidate_grid(
        c, key_bits=(2,), value_bits=(2,), windows=(0,)), base=base, queries=16, prefill=16,
        objective="error") for c in ("turbo", "turbo-vq")}
    assert plans["turbo-vq"].bits == pytest.approx(plans["turbo"].bits)
    assert plans["turbo-vq"].error < plans["turbo"].error
    with pytest.raises(ValueError, match="codec"):
        kv.candidate_grid("qjl")


# -- BalanceKV ----------------------------------------------------------------------------------
def _discrepancy(k, v, eta, q):
    w = torch.exp(q @ k.T / math.sqrt(k.shape[1]))  # (nq, n)
    return ((w * eta) @ v).norm(dim=1).mean()


def _clustered():
    """(generator, keys (128, 16) in 6 clusters, values (128, 8) of norm ~2.8, queries (64, 16))."""
    g = torch.Generator().manual_seed(11)
    n, d = 128, 16
    centres = torch.randn(6, d, generator=g)
    k = centres[torch.randint(0, 6, (n,), generator=g)] + 0.3 * torch.randn(n, d, generator=g)
    v = 1.0 + 0.2 * torch.randn(n, 8, generator=g)
    q = torch.randn(64, d, generator=g)
    return g, k, v, q


def test_balance_signs_beat_random_signs():
    """Clustered keys (as real keys are; for i.i.d. Gaussian keys the exp kernel's effective
    dimension is so high that no signing beats random by much)."""
    g, k, v, q = _clustered()
    n, d = k.shape
    disc_bal, disc_rnd = [], []
    for s in range(10):
        eta, _ = kv.balance_signs(k, v, scale=1 / math.sqrt(d),
                                  generator=torch.Generator().manual_seed(s))
        disc_bal.append(_discrepancy(k, v, eta, q))
        rnd = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
        disc_rnd.append(_discrepancy(k, v, rnd, q))
    assert torch.stack(disc_bal).mean() < 0.6 * torch.stack(disc_rnd).mean()


def test_balance_signs_still_balance_keys_far_apart_at_the_attention_scale():
    """The walk sees keys 10x larger (the same attention logits as queries 10x smaller): at the
    attention's own scale every pair of keys is then ~exp(-36) apart and that walk flips coins;
    the neighbour width (alone or in the default multiscale kernel) still balances."""
    g, k, v, q = _clustered()
    n, d = k.shape
    disc = {b: [] for b in ("multiscale", "neighbor", "attention", "random")}
    for s in range(10):
        for b in ("multiscale", "neighbor", "attention"):
            eta, _ = kv.balance_signs(10 * k, v, scale=1 / math.sqrt(d), bandwidth=b,
                                      generator=torch.Generator().manual_seed(s))
            disc[b].append(_discrepancy(k, v, eta, q))
        disc["random"].append(_discrepancy(k, v, torch.randint(0, 2, (n,), generator=g)
                                           .float() * 2 - 1, q))
    mean = {b: torch.stack(x).mean() for b, x in disc.items()}
    assert mean["multiscale"] < 0.6 * mean["random"]
    assert mean["neighbor"] < 0.75 * mean["random"]
    assert mean["attention"] > 0.8 * mean["random"]


def test_balance_neighbor_width_ignores_the_key_scale():
    """The neighbour width is the median nearest-neighbour distance of the walk's own keys, so
    scaling every key by 4 (exact in binary floating point) leaves the signs unchanged."""
    g = torch.Generator().manual_seed(15)
    k, v = torch.randn(2, 64, 8, generator=g), torch.randn(2, 64, 8, generator=g)
    a = kv.balance_signs(k, v, scale=0.3, bandwidth="neighbor",
                         generator=torch.Generator().manual_seed(0))
    b = kv.balance_signs(4 * k, v, scale=0.3, bandwidth="neighbor",
                         generator=torch.Generator().manual_seed(0))
    assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1])
    # identical keys: a zero width is floored, the walk still runs and pairs them off
    same = k[:, :1].expand(-1, 64, -1).contiguous()
    eta, _ = kv.balance_signs(same, v.abs() + 1, scale=0.3, bandwidth="neighbor",
                              generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(eta).all() and bool((eta.sum(-1).abs() <= 8).all())


def test_balance_config_rejects_bad_settings():
    assert kv.BalanceConfig().block is None and kv.BalanceConfig().bandwidth == "multiscale"
    with pytest.raises(ValueError, match="bandwidth"):
        kv.BalanceConfig(bandwidth="wide")
    with pytest.raises(ValueError, match="block must divide batch"):
        kv.BalanceConfig(batch=256, block=48)
    with pytest.raises(ValueError, match="batch must be a power of two"):
        kv.BalanceConfig(batch=96)
    with pytest.raises(ValueError, match="bandwidth"):
        kv.balance_signs(torch.zeros(4, 2), torch.ones(4, 2), scale=1.0, bandwidth="x")


def test_halve_keeps_exactly_half_sorted():
    g = torch.Generator().manual_seed(12)
    k, v = torch.randn(3, 2, 64, 8, generator=g), torch.randn(3, 2, 64, 8, generator=g)
    for method in ("balance", "uniform"):
        idx = kv.halve(k, v, method=method, scale=0.3, c=0.5, block=16, generator=g)
        assert idx.shape == (3, 2, 32)
        assert bool((idx[..., 1:] > idx[..., :-1]).all())


def test_merge_and_reduce_levels_and_counts():
    cfg = kv.BalanceConfig(rounds=2, batch=16, block=8)
    mr = kv.MergeAndReduce(cfg, scale=0.25, seed=0)
    g = torch.Generator().manual_seed(13)
    final = 0
    for step in range(100):
        k = torch.randn(1, 2, 1, 8, generator=g)
        out = mr.push(k, k.clone(), torch.full((1, 2, 1), step))
        if out is not None:
            final += out[0].shape[2]
            assert bool((out[2][..., 1:] > out[2][..., :-1]).all())
    held = sum(k.shape[2] for _, k, _, _ in mr.pending())
    # every token is either final (weight 4), pending at level 1 (weight 2) or level 0
    weights = final * 4 + sum(2 ** lv * k.shape[2] for lv, k, _, _ in mr.pending())
    assert weights == 100
    assert held < 2 * cfg.batch


def test_balance_cache_runs_and_saves_memory():
    model = llama()
    ids = torch.randint(0, 97, (1, 300), generator=torch.Generator().manual_seed(14))
    plain = kv.TurboQuantCache(model.config, residual_length=4)
    run(model, ids, plain, 290)
    bal = kv.TurboQuantCache(model.config, residual_length=4,
                             balance=kv.BalanceConfig(rounds=1, batch=16, block=8))
    got = run(model, ids, bal, 290)
    assert torch.isfinite(got).all()
    assert bal.memory_bytes() < 0.8 * plain.memory_bytes()


def test_attention_switched_away_warns_once_and_still_answers():
    """A cache built for attention from its codes whose model was switched to another attention
    implementation since (e.g. by a cache built after it) still answers - from decoded codes -
    and says once why it became slow."""
    import warnings

    model = llama()
    ids = torch.randint(0, 97, (1, 40))
    cache = kv.TurboQuantCache(model.config, key_bits=3, value_bits=3, residual_length=8)
    with torch.no_grad():
        want = model(ids, cache=cache).logits
        model.config._attn_implementation = "sdpa"
        with pytest.warns(UserWarning, match="decodes its codes at every step"):
            step = model(ids[:, -1:], cache=cache).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(ids[:, -1:], cache=cache)  # once only
        assert not [w for w in caught if "decodes its codes" in str(w.message)]
    assert torch.isfinite(step).all() and want.shape[1] == 40


def test_cache_memory_bytes_measures_any_cache_the_same_way():
    """tqvec.kv.cache_memory_bytes: a TurboQuantCache's memory_bytes, and for transformers'
    own caches every tensor their layers hold (a DynamicCache: its keys and values)."""
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    import tqvec.kv

    cfg = LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (2, 40))
    dynamic = DynamicCache(config=cfg)
    ours = tqvec.kv.TurboQuantCache(cfg, key_bits=3, value_bits=3, residual_length=8)
    with torch.no_grad():
        model(ids, cache=dynamic)
        model(ids, cache=ours)
    want = sum(t.numel() * t.element_size() for layer in dynamic.layers
               for t in (layer.keys, layer.values))
    assert tqvec.kv.cache_memory_bytes(dynamic) == want == 2 * 2 * 2 * 16 * 40 * 2 * 4
    assert tqvec.kv.cache_bits_per_element(dynamic, cfg, 40, batch=2) == 32.0
    assert tqvec.kv.cache_memory_bytes(ours) == ours.memory_bytes()
    assert tqvec.kv.cache_bits_per_element(ours, cfg, 40, batch=2) == pytest.approx(
        ours.bits_per_element())
    with pytest.raises(TypeError, match="transformers Cache"):
        tqvec.kv.cache_memory_bytes(object())
