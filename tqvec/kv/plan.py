"""Per-layer settings chosen from measurements: ``plan_layers`` picks, for each decoder layer,
the cache settings (key/value bits, window length, ...) that minimise the mean attention-output
error of the model's layers at a bits/element budget, measured on a calibration text.

Layers differ a lot: on SmolLM2-135M the 3-bit attention error ranges over 0.03-0.20 across
layers, and on Gemma 3 270M the 512-token sliding layers pay for their recent-token window
over 512 tokens, the global layers over the whole context. One setting for all layers spends
bits where they buy little.

The measurement is the decode regime the cache runs in (``layer_error``): a prefill, then
``queries`` decode steps, each appending one token, attending with its query and flushing, so
each query sees the window, codes and sinks it would see while generating. The error is
``||Z - Attn||_F / ||Attn||_F`` against exact attention over the same tokens.

Layers also differ in how much the model's loss cares about their error, and the mean
attention error ignores that: planned by it alone, SmolLM2 / Gemma 3 at 3.5 bits got a third
less attention error and no better perplexity. So each layer's sensitivity is measured too
(``layer_sensitivity``: the loss increase when its attention output gets random noise of a
known relative size) and the plan minimises the predicted loss increase,
sum_l sensitivity_l * error_l^2.

The choice is a multiple-choice knapsack (one candidate per layer, the whole cache's
bits/element at most the budget, the objective least), solved by dynamic programming over the
budget in 20,000 steps (``choose``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from .. import _validate as V
from .attention import attend
from .cache import config_head_dim, layer_settings
from .layer import LAYER_OPTIONS, CompressedLayer, KVSettings

__all__ = ["LayerSample", "capture_attention_inputs", "layer_error", "layer_sensitivity",
           "LayerPlan", "plan_layers", "choose", "predicted_loss", "candidate_grid",
           "DEFAULT_CANDIDATES"]


@dataclass
class LayerSample:
    """One layer's attention inputs from a forward: query (B, Hq, L, d), key and value
    (B, Hkv, L, d), the attention scaling, sliding window (None: full) and logit softcap."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None


def capture_attention_inputs(model, input_ids: torch.Tensor) -> list[LayerSample]:
    """Run one forward of ``model`` on ``input_ids`` (1, L) with a capturing attention function
    (transformers' ``AttentionInterface``; the outputs are SDPA's) and return each layer's
    query/key/value as its attention saw them (after RoPE and q/k-norm)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be a (batch, length >= 2) tensor, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    got: dict[int, LayerSample] = {}

    def capture(module, query, key, value, attention_mask, **kw):
        got[module.layer_idx] = LayerSample(query.detach().clone(), key.detach().clone(),
                                            value.detach().clone(), kw.get("scaling"),
                                            kw.get("sliding_window"), kw.get("softcap"))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("tqvec_capture", capture)
    old = model.config._attn_implementation
    model.config._attn_implementation = "tqvec_capture"
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        model.config._attn_implementation = old
    return [got[i] for i in sorted(got)]


def layer_sensitivity(model, input_ids: torch.Tensor, eps: float = 0.1, seed: int = 0,
                      stride: int = 8) -> list[float]:
    """Per layer, how much the model's predictions on ``input_ids`` (1, L) move with that
    layer's attention error: the mean KL divergence (nats per token) from the clean next-token
    distributions to those with the layer's attention output given random noise of relative
    size ``eps`` on every (position, head) row, divided by eps^2 (KL grows quadratically in a
    small perturbation; it is the expected loss increase were the text drawn from the model,
    and unlike a loss difference on one text it is never negative). A layer's loss increase
    at attention error e is then ~ sensitivity * e^2: what ``plan_layers`` minimises (summed
    over layers). The KL is averaged over every ``stride``-th position (the output layer runs
    on those only: with Gemma 3's 262k-token vocabulary it costs as much as the rest of the
    model). Costs one forward per layer, plus one."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not (isinstance(eps, float) and 0 < eps < 1):
        raise ValueError(f"eps must be a float in (0, 1), got {eps!r}")
    V.positive_int(stride, "stride", 1)
    keep = torch.arange(stride - 1, input_ids.shape[1], stride)
    target: list[int | None] = [None]
    gen = torch.Generator()

    def noisy(module, query, key, value, attention_mask, **kw):
        out, w = sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
        if module.layer_idx == target[0]:  # out: (B, L, H, d)
            n = torch.randn(out.shape, generator=gen).to(out)
            n *= eps * out.norm(dim=-1, keepdim=True) / n.norm(dim=-1, keepdim=True)
            out = out + n
        return out, w

    def logprobs() -> torch.Tensor:  # (len(keep), vocab) float32
        gen.manual_seed(seed)
        with torch.no_grad():
            try:
                logits = model(input_ids, logits_to_keep=keep).logits[0]
            except TypeError:  # a model without logits_to_keep
                logits = model(input_ids).logits[0, keep]
        return torch.log_softmax(logits.float(), -1)

    def kl(p: torch.Tensor, q: torch.Tensor, rows: int = 256) -> float:
        tot = 0.0
        for a in range(0, p.shape[0], rows):  # in slices: no (L, vocab) temporaries
            pa, qa = p[a: a + rows], q[a: a + rows]
            tot += float((pa.exp() * (pa - qa)).sum(-1).double().sum())
        return tot / p.shape[0]

    AttentionInterface.register("tqvec_noisy", noisy)
    old = model.config._attn_implementation
    model.config._attn_implementation = "tqvec_noisy"
    try:
        clean = logprobs()
        n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        out = []
        for i in range(n_layers):
            target[0] = i
            out.append(max(kl(clean, logprobs()), 0.0) / eps ** 2)
    finally:
        model.config._attn_implementation = old
    return out


def causal_mask(L: int, nq: int, window: int | None) -> torch.Tensor:
    """(1, 1, nq, L) bool: which of L keys each of the last nq queries may attend to."""
    qpos = torch.arange(L - nq, L)[:, None]
    kpos = torch.arange(L)[None, :]
    m = kpos <= qpos
    if window is not None:
        m &= kpos > qpos - window
    return m[None, None]


def exact_attention(q, k, v, mask, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """float32 softmax attention (GQA: KV heads repeated), the reference of ``layer_error``."""
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, 1).float()
    v = v.repeat_interleave(G, 1).float()
    s = (q.float() @ k.transpose(-1, -2)) * scaling
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def layer_error(settings: KVSettings | Mapping[str, Any], sample: LayerSample, queries: int = 64,
                bit_steps: int = CompressedLayer.MOVE_BLOCK, prefill: int | None = None
                ) -> tuple[float, float, int]:
    """(relative error, bits/element, elements) of one layer's cache with ``settings`` on
    ``sample``, in the regime the cache runs in when it generates: a prefill of ``prefill``
    tokens (default L - queries; calibrated from the prefill's queries, as the attention
    function does), the tokens up to L - queries appended in one block (as decode steps would,
    without their attention, which does not change what is stored), then ``queries`` decode
    steps, each appending one token, attending with that token's query and flushing. A short
    prefill is the harder regime: the key/value calibration is fixed from its tokens and must
    hold for all later ones. K/V are held as float16 (full-precision tokens cost 16 bits, as in
    an fp16/bf16 deployment); a sliding-window layer evicts as the cache does. Bits are counted
    over the tokens the layer stands for, averaged over the last ``bit_steps`` steps (a cache
    with ``residual_bits=8`` moves tokens on in blocks of 64 and cycles through 64 states)."""
    if not isinstance(settings, KVSettings):
        settings = KVSettings(**settings)
    q, k, v = sample.query, sample.key, sample.value
    L = k.shape[2]
    V.positive_int(queries, "queries", 1, L - 1)
    P = L - queries
    P0 = P if prefill is None else V.positive_int(prefill, "prefill", 1, P)
    mask = causal_mask(L, queries, sample.sliding_window)
    ref = exact_attention(q[:, :, -queries:], k, v, mask, sample.scaling, sample.softcap)
    layer = CompressedLayer(settings, 0, sample.sliding_window)
    kh, vh = k.half(), v.half()
    layer.update(kh[:, :, :P0], vh[:, :, :P0])  # prefill: attends to its own tokens exactly
    layer.observe_queries(q[:, :, :P0])
    layer.awaiting_attention = False
    layer.flush()
    if P0 < P:
        layer.update(kh[:, :, P0:P], vh[:, :, P0:P])
        layer.awaiting_attention = False
        layer.flush()
    outs, bits = [], []
    B, H, _, d = k.shape
    for j in range(queries):
        p = P + j
        layer.update(kh[:, :, p: p + 1], vh[:, :, p: p + 1])
        layer.awaiting_attention = False
        outs.append(attend(layer, q[:, :, p: p + 1].float(), mask[:, :, j: j + 1, : p + 1],
                           sample.scaling, sample.softcap).float())
        layer.flush()
        if j >= queries - bit_steps:
            bits.append(8 * layer.nbytes() / (2 * B * H * layer.represented_tokens() * d))
    out = torch.cat(outs, dim=2)
    err = (torch.linalg.norm(out - ref) / torch.linalg.norm(ref)).item()
    return err, sum(bits) / len(bits), 2 * B * H * layer.represented_tokens() * d


def candidate_grid(codec: str = "turbo", key_bits: Sequence[int] = (2, 3, 4),
                   value_bits: Sequence[int] = (2, 3, 4),
                   windows: Sequence[int] = (0, 16, 32, 96)) -> dict[str, dict[str, Any]]:
    """Candidates for ``plan_layers``: every (key bits, value bits, window length) with keys
    and values coded by ``codec`` ("turbo": scalar codes, "turbo-vq": the vector codebook, the
    same bytes), named ``k{key bits}v{value bits}-r{window}``."""
    V.choice(codec, "codec", ("turbo", "turbo-vq"))
    extra = {} if codec == "turbo" else dict(key_codec=codec, value_codec=codec)
    return {f"k{kb}v{vb}-r{r}": dict(extra, key_bits=kb, value_bits=vb, residual_length=r)
            for kb, vb, r in itertools.product(key_bits, value_bits, windows)}


# 2-4 bit keys x 2-4 bit values x a 0/16/32/96-token window: 36 candidates
DEFAULT_CANDIDATES: dict[str, dict[str, Any]] = candidate_grid()


@dataclass
class LayerPlan:
    """What ``plan_layers`` chose. ``overrides`` goes to ``TurboQuantCache(...,
    layer_overrides=plan.overrides)`` together with the same ``base`` options; ``bits`` and
    ``error`` are the predicted whole-cache bits/element (float16 full-precision tokens) and
    mean attention error at the calibration length; ``choice`` names each layer's candidate;
    ``loss_increase`` the predicted growth of the mean next-token loss (objective "loss");
    ``sensitivity`` each layer's (``layer_sensitivity``); ``measured`` holds every
    (layer, candidate) -> (error, bits, elements)."""

    overrides: dict[int, dict[str, Any]]
    choice: list[str]
    bits: float
    error: float
    budget: float
    objective: str = "loss"
    loss_increase: float | None = None  # predicted sum of sensitivity * error^2 (nats)
    sensitivity: list[float] | None = None
    measured: dict[str, list[tuple[float, float, int]]] = field(repr=False, default_factory=dict)


def choose(measured: Mapping[str, Sequence[tuple[float, float, int]]], budget: float,
           weights: Sequence[float] | None = None, resolution: int = 20000
           ) -> tuple[list[str], float, float]:
    """The knapsack: per layer one candidate name, minimising the mean error (or, with
    ``weights``, sum_l weights[l] * error_l^2: the predicted loss increase) with whole-cache
    bits/element <= budget. Returns (choice, bits, mean error). Dynamic programming over the budget
    cut into ``resolution`` units, each layer's cost rounded up to whole units (so the result
    never exceeds the budget; it is optimal among plans whose rounded costs fit, which misses
    only plans within layers x budget / resolution of the budget). ValueError if even the
    cheapest candidate on every layer is over budget."""
    names = list(measured)
    n_layers = len(measured[names[0]])
    if any(len(m) != n_layers for m in measured.values()):
        raise ValueError("measured: every candidate needs one entry per layer")
    elems = np.array([measured[names[0]][i][2] for i in range(n_layers)], dtype=np.float64)
    err = np.array([[measured[c][i][0] for c in names] for i in range(n_layers)])
    if weights is None:
        obj = err
    else:
        w8 = np.asarray(weights, dtype=np.float64)
        if w8.shape != (n_layers,) or not np.all(np.isfinite(w8)) or np.any(w8 < 0):
            raise ValueError(f"weights must be {n_layers} finite numbers >= 0, got {weights!r}")
        obj = w8[:, None] * err ** 2
    bits = np.array([[measured[c][i][1] for c in names] for i in range(n_layers)])
    share = bits * (elems / elems.sum())[:, None]  # each layer's term of the whole-cache bits
    lowest = share.min(axis=1).sum()
    if lowest > budget * (1 + 1e-12):
        raise ValueError(f"budget must be >= {lowest:.3f} bits/element (the cheapest candidate "
                         f"on every layer), got {budget}")
    R = int(resolution)
    w = np.ceil(share / (budget / R) - 1e-6).astype(np.int64)
    dp = np.zeros(R + 1)  # dp[j]: least error sum of the layers so far within j units
    back = np.zeros((n_layers, R + 1), dtype=np.int32)
    for i in range(n_layers):
        new = np.full(R + 1, np.inf)
        arg = np.zeros(R + 1, dtype=np.int32)
        for k in np.argsort(bits[i], kind="stable"):  # ties go to the cheaper candidate
            if w[i, k] > R:
                continue
            cand = np.full(R + 1, np.inf)
            cand[w[i, k]:] = dp[: R + 1 - w[i, k]] + obj[i, k]
            better = cand < new
            new[better], arg[better] = cand[better], k
        dp, back[i] = new, arg
    if not np.isfinite(dp[R]):  # rounding pushed the cheapest plan over: a budget at its edge
        raise ValueError(f"budget {budget} is within rounding of the cheapest plan "
                         f"({lowest:.4f}); raise it slightly")
    pick, j = [], R
    for i in reversed(range(n_layers)):
        k = int(back[i, j])
        pick.append(k)
        j -= int(w[i, k])
    pick.reverse()
    total = float(sum(share[i, k] for i, k in enumerate(pick)))
    mean_err = float(sum(err[i, k] for i, k in enumerate(pick)) / n_layers)
    return [names[k] for k in pick], total, mean_err


def predicted_loss(measured: Mapping[str, Sequence[tuple[float, float, int]]],
                   sensitivity: Sequence[float], choice: Sequence[str]) -> float:
    """sum_l sensitivity_l * error_l^2 of a per-layer choice: the loss increase (nats/token)
    the weighting predicts."""
    return float(sum(sensitivity[i] * measured[c][i][0] ** 2 for i, c in enumerate(choice)))


def plan_layers(model, input_ids: torch.Tensor, budget: float,
                candidates: Mapping[str, Mapping[str, Any]] | None = None,
                base: Mapping[str, Any] | None = None, queries: int = 64,
                seed: int = 0, progress: Callable[[str], None] | None = None,
                objective: str = "loss", prefill: int | None = None) -> LayerPlan:
    """Choose per-layer cache settings for ``model`` at ``budget`` bits/element.

    input_ids: (1, L) calibration tokens (a few thousand tokens of text like the model's use;
        the budget holds at this length: windows and sinks weigh less at longer contexts).
    candidates: name -> cache options tried on every layer (default ``DEFAULT_CANDIDATES``:
        2-4 bit keys x 2-4 bit values x 0/16/32/96-token windows), on top of ``base``.
    base: the cache options shared by all layers (e.g. ``dict(residual_bits=8, norm_bits=8)``);
        pass the same to ``TurboQuantCache`` with ``layer_overrides=plan.overrides``.
    objective: ``"loss"`` (default) minimises sum_l sensitivity_l * error_l^2, each layer's
        attention error weighted by how much the model's loss grows with it
        (``layer_sensitivity``, one more forward per layer); ``"error"`` the mean attention
        error, every layer alike. On SmolLM2 / Gemma 3 the unweighted plan cut the mean
        attention error by a third at 3.5 bits but not perplexity (it starved the layers the
        loss is most sensitive to, e.g. Gemma's global layers).
    queries, prefill: the decode steps whose attention error is measured (the last ``queries``
        of the calibration tokens) and the prefill the calibration is fixed from (default: all
        tokens before them); see ``layer_error``. The per-layer errors of 64 queries are noisy
        (on Gemma 3 270M, one KV head, a layer's 3-bit error moved by up to 2x between
        consecutive blocks of 64 queries), and a plan that picks each layer's cheapest-looking
        candidate favours the lucky ones (docs/kv-benchmarks.md: the predicted and measured
        loss from 64 and 256 queries). More queries cost time in proportion.
    progress: called with a line per candidate measured (e.g. ``print``).
    Costs one forward plus ``len(candidates) x layers`` decode-regime measurements (SmolLM2,
    36 candidates, 2,048 tokens: about 5 minutes on 2 CPU cores).
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ValueError(f"budget must be a positive number of bits/element, got {budget!r}")
    candidates = dict(DEFAULT_CANDIDATES if candidates is None else candidates)
    if not candidates:
        raise ValueError("candidates must name at least one setting")
    base = dict(base or {})
    seed = V.seed(seed)
    V.choice(objective, "objective", ("loss", "error"))
    head_dim = config_head_dim(model.config)
    defaults = {f.name: f.default for f in fields(KVSettings) if f.name != "seed"}
    settings = {}
    for name, opts in [("base", {}), *candidates.items()]:
        mine = {**base, **opts}
        unknown = sorted(set(mine) - set(LAYER_OPTIONS))
        if unknown:
            raise TypeError(f"candidate {name!r}: unknown cache option(s) {unknown}; allowed: "
                            f"{list(LAYER_OPTIONS)}")
        settings[name] = layer_settings({**defaults, **mine}, seed, head_dim, "codes",
                                   f"candidate {name!r}: ")
    samples = capture_attention_inputs(model, input_ids)
    V.positive_int(queries, "queries", 1, samples[0].key.shape[2] - 1)
    measured = {}
    for n, name in enumerate(candidates, 1):
        measured[name] = [layer_error(settings[name], s, queries, prefill=prefill)
                          for s in samples]
        if progress is not None:
            errs = [m[0] for m in measured[name]]
            progress(f"plan_layers: {n}/{len(candidates)} {name}: mean error "
                     f"{sum(errs) / len(errs):.4f}")
    sens = layer_sensitivity(model, input_ids, seed=seed) if objective == "loss" else None
    choice, bits, err = choose(measured, float(budget), sens)
    loss = None if sens is None else predicted_loss(measured, sens, choice)
    return LayerPlan(overrides={i: dict(candidates[c]) for i, c in enumerate(choice)},
                     choice=choice, bits=bits, error=err, budget=float(budget),
                     objective=objective, loss_increase=loss, sensitivity=sens,
                     measured=measured)
