"""``attention_step``'s inputs and its meaning: attention of a KV-cache layer's queries over its
code segments and its full-precision rows, merged in one softmax.

A cache layer describes what it stores once per allocation in a ``KVStepPlan`` (device-neutral:
tensors on the layer's device, views of its buffers' whole storage, so appends that fit the
storage leave the plan valid): per code segment the key and value sides' constants (``KVSide``:
the codec's rotation, centroids and width, an optional per-channel scale, the multipliers' table
for 8-bit coded norms) and their codes and per-token multipliers, and the rows every step reads
unchanged (a sink). Each step passes the segments' live token ranges and its other
full-precision rows (the window). ``compose_attention_step`` is the meaning, written with any
``decode_attention`` implementation; ``attention_step_ref`` is it over the torch reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .ref import decode_attention_ref

__all__ = ["KVSide", "KVCodeSegment", "KVStepPlan", "compose_attention_step",
           "attention_step_ref"]


@dataclass(frozen=True, eq=False)
class KVSide:
    """One code side's constants: x_hat = Pi^T (m c[idx]) (``Codec.kernel_form``), then, with a
    channel scale, x = s x_hat + mu. ``rotation`` rotates rows into the codes' domain, and
    back with ``inverse=True``: the codec's prepared Hadamard op on the plan's device
    (``ops.HadamardRotate``, which the compiled CPU step needs) or any callable of that form;
    ``mu``, ``sc`` (heads, d) float32 or None;
    ``norm_table`` (256,) float32 for multipliers stored as 8-bit codes, else None (float16)."""

    rotation: Any
    centroids: torch.Tensor  # (2^bits,) float32
    bits: int
    mu: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    norm_table: torch.Tensor | None = None

    def multipliers(self, stored: torch.Tensor) -> torch.Tensor:
        """float32 per-token multipliers from their stored form."""
        if self.norm_table is not None:
            return self.norm_table.to(stored.device)[stored.long()]
        return stored.float()


@dataclass(frozen=True, eq=False)
class KVCodeSegment:
    """One code segment: its sides and their (bh, capacity, row bytes) uint8 codes and (bh,
    capacity) stored multipliers; tokens outside a step's range are ignored."""

    key: KVSide
    value: KVSide
    key_codes: torch.Tensor
    key_mults: torch.Tensor
    value_codes: torch.Tensor
    value_mults: torch.Tensor


@dataclass(eq=False)
class KVStepPlan:
    """A layer's code segments and fixed full-precision rows (module docstring). ``heads``: KV
    heads per batch row (rows of the (bh, ...) tensors are batch-major); ``dtype``: the
    full-precision rows'. ``prepared`` holds what a kernel makes of the plan once (keyed by
    the kernel), so that a step costs only the step."""

    heads: int
    bh: int
    d: int
    dtype: torch.dtype
    segments: Sequence[KVCodeSegment]
    sink: tuple[torch.Tensor, torch.Tensor] | None = None
    prepared: dict[str, Any] = field(default_factory=dict)


def _per_head(t: torch.Tensor, plan: KVStepPlan) -> torch.Tensor:
    """(heads, d) -> (bh, 1, d): row b * heads + h takes head h."""
    return t.to(torch.float32).repeat(plan.bh // plan.heads, 1)[:, None, :]


def compose_attention_step(decode_attention: Callable, q: torch.Tensor, scale: float,
                           plan: KVStepPlan, ranges: Sequence[int],
                           exact: Sequence[tuple[torch.Tensor, torch.Tensor]],
                           bias: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """Attention output (bh, R, d) float32 of the rows q (bh, R, d) float32 (softmax scale
    ``scale``) over the plan's code segments - segment i's tokens [ranges[2i], ranges[2i+1]) -
    and its full-precision (keys, values) pairs: the plan's sink, then ``exact`` (bh, n, d).
    ``bias``: None (every token visible to every row) or one additive (bh, R, n) tensor or None
    per full-precision pair, sink first. A row that sees no token gives 0.

    Per code segment, s_t = scale <q, k_t> through the codes: <q, mu> + <Pi (q s), m c[idx]>
    (keys never decoded); values summed in the rotated domain, rotated back once per row
    (``decode_attention``'s softmax state, merged here with the exact rows' scores)."""
    bh, R, d = q.shape
    dev = q.device
    states = []
    for i, seg in enumerate(plan.segments):
        k, v = seg.key, seg.value
        qk, qbias = q, torch.zeros((bh, R), dtype=torch.float32, device=dev)
        if k.sc is not None:  # <q, k> = <q, mu> + <q s, (k - mu) / s>
            qk = q * _per_head(k.sc, plan)
            qbias = scale * (q * _per_head(k.mu, plan)).sum(-1)
        qr = k.rotation(qk.reshape(-1, d)).reshape(bh, R, d)
        lo = torch.full((bh,), ranges[2 * i], dtype=torch.int32, device=dev)
        hi = torch.full((bh,), ranges[2 * i + 1], dtype=torch.int32, device=dev)
        m, l, acc = decode_attention(
            qr.contiguous(), qbias.contiguous(), seg.key_codes, k.multipliers(seg.key_mults),
            k.centroids.to(dev), k.bits, seg.value_codes, v.multipliers(seg.value_mults),
            v.centroids.to(dev), v.bits, lo, hi, scale)
        acc = v.rotation(acc.reshape(-1, d), inverse=True).reshape(bh, R, d)
        if v.sc is not None:  # sum_t p_t (s y_t + mu) = s sum_t p_t y_t + mu sum_t p_t
            acc = acc * _per_head(v.sc, plan) + l[..., None] * _per_head(v.mu, plan)
        states.append((m, l, acc))
    pairs = ([plan.sink] if plan.sink is not None else []) + list(exact)
    scored = []
    for j, (kk, vv) in enumerate(pairs):
        s = (q @ kk.float().transpose(-1, -2)) * scale
        b = bias[j] if bias is not None else None
        scored.append((s + b if b is not None else s, vv))
    top = None
    for m, _, _ in states:
        top = m if top is None else torch.maximum(top, m)
    for s, _ in scored:
        if s.shape[-1]:
            top = s.amax(-1) if top is None else torch.maximum(top, s.amax(-1))
    if top is None:
        return torch.zeros_like(q)
    ref = torch.where(torch.isfinite(top), top, torch.zeros_like(top))[..., None]
    total = torch.zeros((bh, R, 1), dtype=torch.float32, device=dev)
    out = torch.zeros_like(q)
    for m, l, acc in states:
        w = torch.exp(m[..., None] - ref)  # 0 where the codes are all masked (m = -inf)
        total = total + l[..., None] * w
        out = out + acc * w
    for s, vv in scored:
        p = torch.exp(s - ref)
        total = total + p.sum(-1, keepdim=True)
        out = out + p @ vv.float()
    # a row with no visible key (left padding) gives 0
    return torch.where(total > 0, out / total.clamp_min(1e-38), torch.zeros_like(out))


def attention_step_ref(q: torch.Tensor, scale: float, plan: KVStepPlan, ranges: Sequence[int],
                       exact: Sequence[tuple[torch.Tensor, torch.Tensor]],
                       bias: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """``compose_attention_step`` over ``decode_attention_ref`` (plain torch)."""
    return compose_attention_step(decode_attention_ref, q, scale, plan, ranges, exact, bias)
