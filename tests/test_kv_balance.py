"""KV cache: BalanceKV token selection (signs, halving, merge-and-reduce, the cache)."""

import math

import pytest
import torch

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")

import tqvec.kv as kv  # noqa: E402
from tests.test_kv import llama, run  # noqa: E402


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
