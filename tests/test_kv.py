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
