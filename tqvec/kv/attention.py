"""Attention computed from the codes, registered with transformers as ``"tqvec"``.

For each (batch, KV head) the queries of its group are scored against every stored segment:
codes by the codec's asymmetric estimator (queries rotated/projected once per call, keys never
decoded), full-precision segments exactly; one softmax over all of them (with BalanceKV's
log 2^level token weights as additive logits); values of code segments accumulated in the
rotated domain and rotated back once per output row.

The mask: transformers builds it for the layer's logical key range (``get_mask_sizes``); every
stored token carries its absolute position, so its mask column is looked up by position. That
is what keeps sliding windows, padding and BalanceKV's sparse token sets right. Registering an
attention function alone makes transformers build *no* mask for it, so the sdpa mask builder
is registered under the same name.

The code segments (the codes proper and the window's 8-bit codes) go through one op,
``ops.attention_step``, when the layer allows it - codecs whose ``kernel_form`` is one
rotated-domain term with a stored multiplier (TurboQuant-mse; optionally channel-scaled), code
segments that every current query may see in full, no BalanceKV weights, no softcap: the layer's
``KVStepPlan`` (made once per buffer allocation, kept on the layer) holds its code segments and
sink, each call adds the window's exact rows and, where some rows may not see some exact tokens,
their additive masks. On the CPU a call with nothing masked is one compiled call
(csrc/cpu/attention.cpp: query transforms and rotations, every code segment, the exact rows, the
merge), else the op's composition over the compiled decode-attention kernel; on a GPU the
composition over the CUDA kernel. ``CODES_KERNEL`` chooses: "auto" (the op where a compiled
kernel exists), "ref" (the op's torch reference, ``ops.kvstep.attention_step_ref``), "never"
(the per-segment torch path below, ``_attend_rows``, which the tests compare with).

A forward of many new tokens (a prefill chunk, a later turn's prompt: ``DECODED_FROM`` query
rows or more) decodes the layer's stored tokens once and hands them to SDPA: decoding costs
O(tokens x d) once, while scoring from the codes costs lookups for every (query, token) pair
that SDPA's matrix products do faster once the queries are many; same scores up to float
rounding (the decode reference's), the codes stay the only thing the cache holds.

Any other cache (or none) gets transformers' SDPA attention unchanged, so switching a model to
"tqvec" is harmless for it; a layer holding only full-precision tokens also goes to SDPA, which
makes a cache whose window covers the sequence reproduce DynamicCache's logits bit for bit.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import ops

__all__ = ["ATTENTION_NAME", "CODES_KERNEL", "DECODED_FROM", "register", "tqvec_attention",
           "attend"]

ATTENTION_NAME = "tqvec"
CODES_KERNEL = "auto"  # "auto" | "ref" | "never": see the module docstring
_QUERY_ROWS = 1024  # rows of (group x query) scored at once: bounds the score matrix memory
#: A forward of at least this many query positions attends over the decoded tokens with SDPA
#: (module docstring; the crossover measured in docs/kv-benchmarks.md); 0 never does.
DECODED_FROM = 64


def register() -> None:
    """Register the attention and mask functions (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, tqvec_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def tqvec_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                    scaling: float | None = None, softcap: float | None = None, **kwargs):
    layer = getattr(key, "tqvec_layer", None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, softcap=softcap, **kwargs)
    if dropout:
        raise ValueError(f"dropout must be 0 with the compressed cache, got {dropout}")
    if kwargs.get("s_aux") is not None:
        raise ValueError("attention sinks (s_aux) are not supported by the compressed cache")
    layer.awaiting_attention = False
    layer.observe_padding(attention_mask, query.shape[2])
    layer.observe_queries(query)
    try:
        if layer.only_window() and softcap is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=0.0, scaling=scaling, **kwargs)
        if (softcap is None and DECODED_FROM and query.shape[2] >= DECODED_FROM
                and layer.mr is None):  # BalanceKV's token weights are not SDPA's to apply
            k, v = layer.decoded()
            return sdpa_attention_forward(module, query, k, v, attention_mask,
                                          dropout=0.0, scaling=scaling, **kwargs)
        if scaling is None:
            scaling = 1.0 / math.sqrt(query.shape[-1])
        out = attend(layer, query, attention_mask, scaling, softcap)
        return out.transpose(1, 2).contiguous(), None
    finally:
        layer.flush()


def _all_visible(m: torch.Tensor) -> bool:
    """Whether a mask slice hides nothing (bool: all True; additive: all 0). On the CPU through
    numpy: a torch reduction and its host read would cost more than the step's attention at
    short contexts, per layer and step."""
    if m.device.type == "cpu":
        a = m.numpy()
        return bool(a.all()) if a.dtype == bool else not a.any()
    return bool(m.all() if m.dtype == torch.bool else (m == 0).all())


def _bias(mask, pos, qpos: range, kv_offset: int, B: int, H: int, G: int,
          device: torch.device) -> torch.Tensor | None:
    """Additive mask (B or 1, H or 1, G*Q, n) for keys at positions ``pos``: a (start, stop)
    range or a (B, H, n) tensor, seen by queries at positions ``qpos``. mask: None (causal) or
    (B, 1, Q, kv_len) bool / additive."""
    Q = len(qpos)
    if mask is None:
        if isinstance(pos, tuple):
            if pos[1] - 1 <= qpos.start:  # every stored token precedes every query: no mask,
                return None               # known on the host (no GPU sync)
            p = torch.arange(pos[0], pos[1], device=device)
            allowed = p[None, :] <= torch.arange(qpos.start, qpos.stop, device=device)[:, None]
            bias = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
            bias = bias.masked_fill_(~allowed, float("-inf"))
            return bias.repeat(G, 1)[None, None]
        qt = torch.arange(qpos.start, qpos.stop, device=device)
        allowed = pos[:, :, None, :] <= qt[None, None, :, None]  # (B, H, Q, n)
    else:
        kv_len = mask.shape[-1]
        if isinstance(pos, tuple):
            a, b = pos[0] - kv_offset, pos[1] - kv_offset
            if a < 0 or b > kv_len:
                raise RuntimeError(f"stored positions {pos} fall outside the mask's key range "
                                   f"[{kv_offset}, {kv_offset + kv_len})")
            m = mask[:, :, :, a:b]  # (B, 1, Q, n)
        else:
            col = pos - kv_offset
            if bool((col < 0).any()) or bool((col >= kv_len).any()):
                raise RuntimeError("stored positions fall outside the mask's key range")
            m = torch.gather(mask.expand(B, H, Q, kv_len), 3,
                             col[:, :, None, :].expand(B, H, Q, col.shape[-1]))
        if isinstance(pos, tuple) and _all_visible(m):
            return None  # decode steps: nothing hidden
        if m.dtype == torch.bool:
            allowed = m
        else:
            return m.float().repeat(1, 1, G, 1)
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
    bias.masked_fill_(~allowed, float("-inf"))
    return bias.repeat(1, 1, G, 1)


def attend(layer, query: torch.Tensor, mask, scaling: float, softcap: float | None = None
           ) -> torch.Tensor:
    """Attention output (B, Hq, Q, D) in query's dtype from the layer's stored segments.

    query: (B, Hq, Q, D), query head h*G + g reads KV head h (transformers' repeat_kv order).
    """
    B, Hq, Q, D = query.shape
    H = layer.num_heads
    if Hq % H:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({H})")
    G = Hq // H
    L = layer.cumulative_length
    kv_offset = L - mask.shape[-1] if mask is not None else 0
    qpos = range(L - Q, L)
    parts = _step_parts(layer, query, mask, kv_offset, softcap)
    plan = layer.step_plan(parts) if parts is not None else None
    visible = plan is not None and (
        (Q == 1 and mask is None) or (mask is not None and parts.first >= kv_offset
                                      and _all_visible(mask)))
    step = max(1, _QUERY_ROWS // G)
    if plan is not None and Q <= step:  # one block of rows (decode steps): no copies
        # rows are (g, q) pairs, g-major: query head h * G + g's row q
        o = _attend_step(parts, plan, query.float().reshape(B * H, G * Q, D), B, G, qpos, mask,
                         kv_offset, scaling, visible)
        return o.reshape(B, Hq, Q, D).to(query.dtype)
    qs = query.float().reshape(B, H, G, Q, D)
    segs = list(layer.segments()) if plan is None else None
    outs = []
    for s0 in range(0, Q, step):
        s1 = min(Q, s0 + step)
        # Rows are (g, q) pairs, g-major, for the queries s0..s1 of every group member.
        q = qs[:, :, :, s0:s1].reshape(B, H, G * (s1 - s0), D)
        m = mask[:, :, s0:s1] if mask is not None else None
        if plan is not None:
            o = _attend_step(parts, plan, q.reshape(B * H, -1, D), B, G, qpos[s0:s1], m,
                             kv_offset, scaling, visible)
        else:
            o = _attend_rows(segs, q, G, qpos[s0:s1], m, kv_offset, scaling, softcap)
        outs.append(o.reshape(B, H, G, s1 - s0, D))
    out = torch.cat(outs, dim=3)
    return out.reshape(B, Hq, Q, D).to(query.dtype)


def _step_parts(layer, query, mask, kv_offset: int, softcap):
    """The layer's ``StepParts`` where ``ops.attention_step`` applies to this call (module
    docstring: ``CODES_KERNEL``, no softcap or BalanceKV, some codes, every code visible to every
    current query), else None."""
    if CODES_KERNEL == "never" or softcap is not None:
        return None
    if CODES_KERNEL == "auto" and not query.is_cuda and not ops.has_cpu_kernels():
        return None  # the CPU kernels (csrc/cpu/attention.cpp) are not built
    parts = layer.step_parts()
    if parts is None or not parts.codes:
        return None
    if mask is not None:  # every current query must see every code (no padding among them)
        for start, stop in parts.code_pos:
            a, b = start - kv_offset, stop - kv_offset
            if a < 0 or b > mask.shape[-1] or not _all_visible(mask[..., a:b]):
                return None
    return parts


def _attend_step(parts, plan, q, B, G, qpos, mask, kv_offset, scaling, visible: bool):
    """``_attend_rows`` through ``ops.attention_step``: q (B H, R, D) float32 rows for the
    queries at positions qpos, batch-major; ``visible``: every row sees every stored token
    (no masks), else the exact rows' additive masks are made from ``mask`` (None: causal).
    Returns (B H, R, D)."""
    bh, R, D = q.shape
    H = bh // B
    exact = []
    if parts.window is not None:
        k, v = parts.window
        exact.append((k.reshape(bh, -1, D), v.reshape(bh, -1, D)))
    bias = None
    if not visible:
        spans = [(0, parts.sink[0].shape[2])] if parts.sink is not None else []
        if parts.window is not None:
            spans.append((parts.window_start, parts.window_start + parts.window[0].shape[2]))
        bias = []
        for span in spans:
            b = _bias(mask, span, qpos, kv_offset, B, H, G, q.device)
            bias.append(None if b is None else b.expand(B, H, R, b.shape[-1]).reshape(bh, R, -1))
    ranges = [i for c in parts.codes for i in (c.kbuf.start, c.kbuf.stop)]
    return ops.attention_step(q, scaling, plan, ranges, exact, bias,
                              backend="ref" if CODES_KERNEL == "ref" else "auto")


def _attend_rows(segs, q, G, qpos, mask, kv_offset, scaling, softcap):
    """q: (B, H, G*Q, D) float32 rows for queries at positions qpos (Q,), over the layer's
    ``Segment``s, each scored on its own (codes by the quantizers' estimators)."""
    B, H = q.shape[:2]
    scores = []
    for seg in segs:
        if seg.kind == "codes":
            s = seg.coder.kq.scores(q, seg.keys)
        else:
            s = q @ seg.keys.float().transpose(-1, -2)
        s = s * scaling
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        bias = _bias(mask, seg.pos, qpos, kv_offset, B, H, G, q.device)
        if bias is not None:
            s = s + bias
        if seg.log_weight:
            s = s + seg.log_weight
        scores.append(s)
    sizes = [s.shape[-1] for s in scores]
    p = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    # A row whose every key is masked (left padding) gives NaN; SDPA returns 0 there too
    # only by accident of the kernel, so define it: zero output.
    p = torch.nan_to_num(p, nan=0.0)
    out = None
    for seg, pp in zip(segs, torch.split(p, sizes, dim=-1), strict=True):
        o = seg.coder.vq.weighted_sum(pp, seg.values) if seg.kind == "codes" else \
            pp @ seg.values.float()
        out = o if out is None else out + o
    return out
