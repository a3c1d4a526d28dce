"""KV cache: the per-layer planner (layer errors, sensitivities, the budgeted choice)."""


import pytest
import torch

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")

import tqvec.kv as kv  # noqa: E402
from tests.test_kv import gemma3, llama  # noqa: E402


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
