"""BalanceKV token selection (Han et al., "BalanceKV: KV cache compression through discrepancy
theory"): SoftmaxBalance, its blocked parallel form, and MergeAndReduce for streams.

SoftmaxBalance (paper Algorithm 2) runs the self-balancing walk of Alweiss-Liu-Sawhney on the
implicit vectors phi(k) (x) v, whose inner products are exp(<k_i, k_j> * scale) <v_i, v_j>. Each
token gets a sign; the smaller half survives and, weighted by 2, estimates the sum
sum_j exp(<q, k_j> * scale) v_j over all tokens for every query q.

Choices made here, and why:

* One selection serves the numerator and the denominator of attention. The paper runs separate
  MergeAndReduce instances (values v for the numerator, v = 1 for the denominator); a cache can
  keep only one set of tokens, so the walk balances phi(k) (x) [v / r, 1]: its kernel is
  exp(<k_i, k_j> scale) (<v_i, v_j> / r^2 + 1), which bounds both discrepancies at once.
* Value-norm buckets (paper Algorithm 1, line 4): tokens only interact with tokens whose
  ||v|| lies in the same power-of-two bucket (the kernel is masked across buckets), which is
  running one walk per bucket; r is the bucket's upper edge, so ||v / r|| lies in (1/2, 1].
* The kernel is normalized per pair, K_ij / sqrt(K_ii K_jj) = exp(-||k_i - k_j||^2 scale / 2)
  (a Gaussian kernel in k, times the value term), not by the paper's R^2 = max_i K_ii: at real
  key norms the latter leaves every off-diagonal entry ~0 and the walk flips fair coins.
* Bandwidth (``bandwidth``): at the attention's own scale real keys are far apart for the walk
  too (Gemma 3: a key's nearest neighbour at a kernel value of e^-24 to e^-67; SmolLM2 e^-1 to
  e^-8), so most signs are coin flips. ``"neighbor"`` sets the Gaussian's width per walk to the
  median squared distance from a key to its nearest neighbour (tokens interact with their
  neighbours, whatever the model's key scale); ``"multiscale"`` (default) balances the mean of
  both kernels (a sum of kernels is the concatenation of their feature maps, so the walk bounds
  the discrepancy at both scales); ``"attention"`` is the attention's scale alone. Measured
  (``python bench/kv.py balance``: GPL-3, keep 1/4, fp16 tokens, mean over seeds; numbers in
  bench/results/kv_balance.md): "attention" wins on SmolLM2's early layers, whose error comes
  from a few heavy tokens, "neighbor" on Gemma 3 and SmolLM2's late layers; "multiscale" has
  the lowest mean on SmolLM2 (0.093 against uniform sampling's 0.108) and ties "neighbor" on
  Gemma 3 (0.112 against 0.123), and is below uniform sampling on every layer of both (20
  seeds; on three of SmolLM2's 30 layers by less than two standard errors).
* One walk per batch (``block=None``, default). The paper's blocked parallel form (Section 4)
  cuts the batch into blocks walked independently (a block-diagonal kernel); here a batch's
  walk is one sequential loop over its tokens whatever the block, so blocks only cut
  interactions. With blocks of 64 of 256, SmolLM2's heavy tokens (a few % of the attention
  each, hundreds of positions apart) rarely share a walk: 0.107 mean error, level with uniform
  sampling (0.108) and below it on 24 of 30 layers; one walk, same kernel: 0.096.
* The constant c: the theory's c = 30 log(n / delta) makes every p_j ~ 1/2 (the walk degenerates
  to uniform sampling). ``c`` is a parameter (default 0.05 against the normalized kernel:
  near-greedy); p_j is clipped to [0, 1].
* Exactly floor(n / 2) tokens are kept ("we strictly select n/2 embeddings", paper Section 4):
  the +1 side, completed or trimmed by p_j.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import _validate as V

__all__ = ["BalanceConfig", "balance_signs", "halve", "MergeAndReduce"]

BANDWIDTHS = ("multiscale", "attention", "neighbor")


@dataclass(frozen=True)
class BalanceConfig:
    """Token selection stage of the cache.

    rounds: T, keep 1 / 2^T of the tokens between the sink and the recent window.
    method: ``"balance"`` (SoftmaxBalance walk) or ``"uniform"`` (a uniformly random half per
        round: the baseline the paper compares with).
    batch: MergeAndReduce batch size t (tokens reduced together; a power of two >= 2).
    block: ``None`` (default): one walk over each batch; an int dividing ``batch``: the
        paper's blocked parallel walk (blocks of that many tokens walked independently).
    c: walk constant (see the module docstring).
    bandwidth: the walk's kernel width: ``"multiscale"`` (default), ``"attention"`` or
        ``"neighbor"`` (see the module docstring).
    """

    rounds: int = 1
    method: str = "balance"
    batch: int = 256
    block: int | None = None
    c: float = 0.05
    bandwidth: str = "multiscale"

    def __post_init__(self) -> None:
        V.positive_int(self.rounds, "rounds", 1, 16)
        V.choice(self.method, "method", ("balance", "uniform"))
        b = V.positive_int(self.batch, "batch", 2)
        if b & (b - 1):
            raise ValueError(f"batch must be a power of two, got {b}")
        if self.block is not None:
            blk = V.positive_int(self.block, "block", 2)
            if b % blk:
                raise ValueError(f"block must divide batch {b}, got {blk}")
        V.choice(self.bandwidth, "bandwidth", BANDWIDTHS)
        if not (math.isfinite(self.c) and self.c > 0):
            raise ValueError(f"c must be a positive finite number, got {self.c}")


def balance_signs(k: torch.Tensor, v: torch.Tensor, *, scale: float, c: float = 0.05,
                  block: int | None = None, bandwidth: str = "multiscale",
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-balancing walk signs for (k, v) pairs.

    k: (..., n, d), v: (..., n, s) float32 (leading dims are independent problems).
    Returns (eta (..., n) float32 of +-1, p (..., n) the probability each sign had of being +1).
    """
    V.choice(bandwidth, "bandwidth", BANDWIDTHS)
    k = k.float()
    v = v.float()
    n = k.shape[-2]
    block = n if block is None else min(block, n)
    vn = torch.linalg.vector_norm(v, dim=-1)
    bucket = torch.floor(torch.log2(vn.clamp_min(1e-30)))
    vr = v / torch.exp2(bucket + 1)[..., None]
    pos = torch.arange(n, device=k.device)
    walk = (pos[:, None] // block) == (pos[None, :] // block)
    same = (bucket[..., :, None] == bucket[..., None, :]) & walk
    sq = (k * k).sum(-1)
    dist = (sq[..., :, None] + sq[..., None, :] - 2.0 * (k @ k.transpose(-1, -2))).clamp_min(0.0)
    kern = torch.zeros_like(dist)
    if bandwidth != "neighbor":
        # K_ij / sqrt(K_ii K_jj) of the attention kernel exp(<k_i, k_j> scale)
        kern = kern + torch.exp(-dist * (scale / 2.0))
    if bandwidth != "attention":
        kern = kern + torch.exp(-dist / _neighbor_width(dist, walk, sq, scale))
    if bandwidth == "multiscale":
        kern = kern / 2.0
    kern = kern * ((vr @ vr.transpose(-1, -2) + 1.0) / 2.0) * same
    eta = torch.zeros(k.shape[:-1], dtype=torch.float32, device=k.device)
    prob = torch.empty_like(eta)
    u = torch.rand(k.shape[:-1], generator=generator, device="cpu").to(k.device)
    for j in range(n):
        y = (kern[..., j, :j] * eta[..., :j]).sum(-1)
        p = (0.5 - y / (2.0 * c)).clamp(0.0, 1.0)
        prob[..., j] = p
        eta[..., j] = torch.where(u[..., j] < p, 1.0, -1.0)
    return eta, prob


def _neighbor_width(dist: torch.Tensor, walk: torch.Tensor, sq: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """(..., 1, 1): the median over tokens of the squared distance to the nearest other key of
    the same walk; the attention's width 2 / scale where no token has a neighbour, and at
    least 1e-6 of the mean squared norm (identical keys)."""
    n = dist.shape[-1]
    others = walk & ~torch.eye(n, dtype=torch.bool, device=dist.device)
    nearest = dist.masked_fill(~others, float("inf")).amin(-1)
    nearest = torch.where(torch.isfinite(nearest), nearest, torch.full_like(nearest, math.nan))
    width = torch.nanmedian(nearest, dim=-1).values
    width = torch.where(torch.isnan(width), torch.full_like(width, 2.0 / scale), width)
    return width.clamp_min(1e-6 * sq.mean(-1) + 1e-30)[..., None, None]


def halve(k: torch.Tensor, v: torch.Tensor, *, method: str, scale: float, c: float,
          block: int | None, generator: torch.Generator | None,
          bandwidth: str = "multiscale") -> torch.Tensor:
    """Indices (..., n // 2), increasing, of the tokens one balancing round keeps."""
    n = k.shape[-2]
    if method == "uniform":
        r = torch.rand(k.shape[:-1], generator=generator, device="cpu").to(k.device)
    else:
        eta, p = balance_signs(k, v, scale=scale, c=c, block=block, bandwidth=bandwidth,
                               generator=generator)
        # +1 side first, completed or trimmed by the probability of +1 (paper Section 4:
        # "we strictly select n/2 embeddings").
        r = eta + p
    keep = torch.topk(r, n // 2, dim=-1).indices
    return keep.sort(-1).values


class MergeAndReduce:
    """Streaming BalanceKV (paper Algorithm 3) over (B, H) independent streams.

    Level i holds tokens that survived i halvings; each carries weight 2^i. When level i < T
    reaches ``batch`` tokens it is halved into level i + 1. Level T is final: the cache hands
    those tokens on (to be quantized) and forgets them here.
    """

    def __init__(self, cfg: BalanceConfig, scale: float, seed: int):
        self.cfg = cfg
        self.scale = scale
        self.gen = torch.Generator().manual_seed(seed)
        self.levels: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = (
            [None] * cfg.rounds)

    def push(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Add tokens k, v (B, H, n, d), positions (B, H, n). Returns the tokens that reached
        level T (weight 2^T) as (k, v, pos), or None."""
        out = []
        self._add(0, k, v, pos, out)
        if not out:
            return None
        return tuple(torch.cat([o[i] for o in out], dim=2) for i in range(3))  # type: ignore

    def _add(self, level: int, k, v, pos, out: list) -> None:
        if level == self.cfg.rounds:
            out.append((k, v, pos))
            return
        cur = self.levels[level]
        if cur is not None:
            k, v, pos = (torch.cat([a, b], dim=2) for a, b in zip(cur, (k, v, pos), strict=True))
        t = self.cfg.batch
        full = (k.shape[2] // t) * t
        self.levels[level] = (k[:, :, full:], v[:, :, full:], pos[:, :, full:]) if (
            k.shape[2] > full) else None
        if not full:
            return
        kb, vb, pb = (a[:, :, :full] for a in (k, v, pos))
        B, H = kb.shape[:2]
        nb = full // t
        # Each batch of t tokens is reduced on its own (batches are independent problems).
        shp = (B, H, nb, t)
        idx = halve(kb.reshape(*shp, -1), vb.reshape(*shp, -1), method=self.cfg.method,
                    scale=self.scale, c=self.cfg.c, block=self.cfg.block, generator=self.gen,
                    bandwidth=self.cfg.bandwidth)
        idx = idx + (torch.arange(nb, device=idx.device) * t)[None, None, :, None]
        idx = idx.reshape(B, H, -1)
        sel = idx[..., None]
        self._add(level + 1, kb.gather(2, sel.expand(-1, -1, -1, kb.shape[-1])),
                  vb.gather(2, sel.expand(-1, -1, -1, vb.shape[-1])), pb.gather(2, idx), out)

    def pending(self) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(level, k, v, pos) of the tokens still held here (full precision, weight 2^level)."""
        return [(i, *lv) for i, lv in enumerate(self.levels) if lv is not None]

    def map_(self, fn) -> None:
        """Apply fn to every held tensor (batch reordering)."""
        self.levels = [None if lv is None else tuple(fn(a) for a in lv) for lv in self.levels]

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for lv in self.levels if lv is not None
                   for a in lv[:2])
