"""KV cache: the 8-bit window (residual_bits=8) and forwards of many rows."""

import pytest
import torch

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")

import tqvec.kv as kv  # noqa: E402
from tests.test_kv import gemma3, llama, run  # noqa: E402
from tqvec.kv.quant import make_quantizer  # noqa: E402


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
