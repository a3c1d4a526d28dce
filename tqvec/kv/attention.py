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

The code segments (the codes proper and the window's 8-bit codes) go through the fused
decode-attention op (``ops.decode_attention``: csrc/cuda/attention.cu on GPUs, flash-decoding
over the packed codes; csrc/cpu/attention.cpp on the CPU) when the layer allows it -
TurboQuant-mse keys and values (optionally channel-scaled), code segments that every current
query may see in full, no BalanceKV weights, no softcap - and their softmax states (max, sum,
rotated-domain accumulator) are merged with the exact segments' scores here.
``CODES_KERNEL`` chooses: "auto" (where a compiled kernel exists), "always" (also the op's
torch reference), "never" (the per-segment torch path below, which the tests compare with).
On the CPU, a decode step whose every stored token is visible to every query row runs that
whole composition - query transforms and rotations, every code segment, the exact segments,
the merge - as one compiled call (``ops.attention_step``, csrc/cpu/attention.cpp): ~70 torch
ops per layer and step cost more than the codes' arithmetic. ``COMPILED_STEP = False`` keeps
the composition (the tests compare the two).

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
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import ops
from .quant import ChannelScale, CodecQuantizer

__all__ = ["ATTENTION_NAME", "CODES_KERNEL", "DECODED_FROM", "register", "tqvec_attention",
           "attend"]

ATTENTION_NAME = "tqvec"
CODES_KERNEL = "auto"  # "auto" | "always" | "never": see the module docstring
COMPILED_STEP = True  # one compiled call per decode step where it applies (module docstring)
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
    numpy: a torch reduction and its host read cost ~0.1 ms per call, per layer and step."""
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
    if softcap is None:
        out = _compiled_step(layer, query, mask, kv_offset, scaling, G)
        if out is not None:
            return out.to(query.dtype)
    qpos = range(L - Q, L)
    qs = query.float().reshape(B, H, G, Q, D)
    segs = list(layer.segments())
    outs = []
    step = max(1, _QUERY_ROWS // G)
    for s0 in range(0, Q, step):
        s1 = min(Q, s0 + step)
        # Rows are (g, q) pairs, g-major, for the queries s0..s1 of every group member.
        q = qs[:, :, :, s0:s1].reshape(B, H, G * (s1 - s0), D)
        m = mask[:, :, s0:s1] if mask is not None else None
        o = _attend_rows(layer, segs, q, G, qpos[s0:s1], m, kv_offset, scaling, softcap)
        outs.append(o.reshape(B, H, G, s1 - s0, D))
    out = torch.cat(outs, dim=3)
    return out.reshape(B, Hq, Q, D).to(query.dtype)


def _mse_parts(quantizer):
    """(CodecQuantizer over a codec of one rotated-domain term whose multiplier is stored -
    ``Codec.kernel_form``: TurboQuant-mse with the norm's or the fitted scale -, its
    ChannelScale or None), or None."""
    scale = quantizer if isinstance(quantizer, ChannelScale) else None
    inner = quantizer.inner if scale is not None else quantizer
    form = inner.codec.kernel_form() if isinstance(inner, CodecQuantizer) else None
    if form is None or form.multiplier_field is None:
        return None
    if scale is not None and scale.scale is None:
        return None
    return inner, scale


def _kernel_plan(layer, segs, q, mask, kv_offset, softcap):
    """The fused op's inputs for each code segment - ((key quantizer, its ChannelScale or None),
    (value ...), key buffer, value buffer) - when it applies to this call (module docstring)."""
    if CODES_KERNEL == "never":
        return None
    if CODES_KERNEL == "auto" and not q.is_cuda:
        if not ops.has_cpu_kernels():  # the CPU kernel (csrc/cpu/attention.cpp) is not built
            return None
    if softcap is not None or layer.mr is not None:
        return None
    plans = []
    for kind, _, _, pos, logw, coder in segs:
        if kind != "codes":
            continue
        if not isinstance(pos, tuple) or logw:
            return None
        kq, vq, kbuf, vbuf = coder
        kp, vp = _mse_parts(kq), _mse_parts(vq)
        if kp is None or vp is None:
            return None
        if mask is not None:  # every current query must see every code (decode, no padding)
            a, b = pos[0] - kv_offset, pos[1] - kv_offset
            if a < 0 or b > mask.shape[-1] or not _all_visible(mask[..., a:b]):
                return None
        plans.append((kp, vp, kbuf, vbuf))
    return plans or None


def _multiplier_field(quantizer) -> str:
    """The stored field that is a kernel-form quantizer's per-token multiplier (the norm, or
    TurboQuant's fitted scale of ``scale='fit'``)."""
    return quantizer.codec.kernel_form().multiplier_field


def _field_norms(quantizer, data: dict) -> torch.Tensor:
    """float32 per-token multipliers of a whole buffer (``_multiplier_field``; its zero-filled
    spare capacity gives 0)."""
    name = _multiplier_field(quantizer)
    nrm = data[name]
    if name in quantizer.log_fields:
        return quantizer.unlog8(nrm).float()
    return nrm.float()


def _codes_state(kp, vp, kbuf, vbuf, q, scaling):
    """One code segment's softmax state (max, sum, value accumulator in d-space) for the rows
    q (B, H, R, D), through ``ops.decode_attention``."""
    (kq, ks), (vq, vs) = kp, vp
    B, H, R, D = q.shape
    qk, qbias = q, torch.zeros((B, H, R), dtype=torch.float32, device=q.device)
    if ks is not None:  # <q, k> = <q, mu> + <q s, (k - mu) / s>
        mu, sc = ks.stats(q.device)
        qk, qbias = q * sc, scaling * (q * mu).sum(-1)
    qr = kq.codec.query_terms(qk.reshape(-1, D))[0].reshape(B * H, R, D)
    kd, vd = kbuf.data, vbuf.data
    cap = kd["payload"].shape[2]
    lo = torch.full((B * H,), kbuf.start, dtype=torch.int32, device=q.device)
    hi = torch.full((B * H,), kbuf.stop, dtype=torch.int32, device=q.device)
    m, l, acc = ops.decode_attention(
        qr.contiguous(), qbias.reshape(B * H, R).contiguous(),
        kd["payload"].reshape(B * H, cap, -1), _field_norms(kq, kd).reshape(B * H, cap),
        kq.codec.centroids_on(q.device), kq.codec.kernel_form().bits,
        vd["payload"].reshape(B * H, cap, -1), _field_norms(vq, vd).reshape(B * H, cap),
        vq.codec.centroids_on(q.device), vq.codec.kernel_form().bits, lo, hi, scaling)
    m, l = m.reshape(B, H, R), l.reshape(B, H, R)
    acc = vq.codec.unrotate(acc.reshape(-1, D)).reshape(B, H, R, D)
    if vs is not None:  # sum_t p_t (s y_t + mu) = s sum_t p_t y_t + mu sum_t p_t
        mu, sc = vs.stats(q.device)
        acc = acc * sc + l[..., None] * mu
    return m, l, acc


def _attend_rows_kernel(plans, segs, q, G, qpos, mask, kv_offset, scaling):
    """``_attend_rows`` with every code segment through ``ops.decode_attention``, their
    softmax states merged with the exact segments' scores."""
    B, H = q.shape[:2]
    states = [_codes_state(*plan, q, scaling) for plan in plans]
    exact = []
    for kind, k, v, pos, _, _ in segs:
        if kind == "codes":
            continue
        s = (q @ k.float().transpose(-1, -2)) * scaling
        bias = _bias(mask, pos, qpos, kv_offset, B, H, G, q.device)
        exact.append((s + bias if bias is not None else s, v))
    top = states[0][0]
    for m, _, _ in states[1:]:
        top = torch.maximum(top, m)
    for s, _ in exact:
        if s.shape[-1]:
            top = torch.maximum(top, s.amax(-1))
    ref = torch.where(torch.isfinite(top), top, torch.zeros_like(top))[..., None]
    total = out = None
    for m, l, acc in states:
        w = torch.exp(m[..., None] - ref)  # 0 where the codes are all masked (m = -inf)
        total = l[..., None] * w if total is None else total + l[..., None] * w
        out = acc * w if out is None else out + acc * w
    for s, v in exact:
        p = torch.exp(s - ref)
        total = total + p.sum(-1, keepdim=True)
        out = out + p @ v.float()
    # a row with no visible key (left padding) gives 0, as in _attend_rows
    return torch.where(total > 0, out / total.clamp_min(1e-38), torch.zeros_like(out))


# quantizer -> ((what its constants depend on), (prepared side, its multipliers' field) or None)
_SIDES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _step_side(quantizer):
    """The compiled step's prepared constants of one side and the name of its per-token
    multiplier field, made once per quantizer; None where the step cannot take it (not
    TurboQuant-mse, an uncalibrated scale, a Haar rotation)."""
    hit = _SIDES.get(quantizer)
    parts = _mse_parts(quantizer)
    key = None if parts is None else (parts[0].center, id(parts[1] and parts[1].scale))
    if hit is not None and hit[0] == key:
        return hit[1]
    out = None
    if parts is not None:
        inner, scale = parts
        rot = inner.codec.query_rotation()
        name = _multiplier_field(inner)
        stored = torch.uint8 if name in inner.log_fields else inner.codec.scalar_layout()[name][1]
        if rot is not None and rot.host is not None and stored in (torch.uint8, torch.float16):
            table = None
            if stored == torch.uint8:
                table = inner.unlog8(torch.arange(256, dtype=torch.uint8)).float()
            side = ops.compiled_kv_side(
                rotation=(*rot.host, rot.p), bits=inner.codec.kernel_form().bits,
                centroids=inner.codec.centroids_on(torch.device("cpu")),
                mu=None if scale is None else scale.mean,
                sc=None if scale is None else scale.scale, norm_table=table)
            out = None if side is None else (side, name)
    _SIDES[quantizer] = (key, out)
    return out


# layer -> (what its plan was made from, the plan): the codes' buffers are reallocated only as
# they grow, so a step mostly reuses the plan its layer made before
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _step_plan(layer, codes, sink, bh: int, d: int):
    """The compiled step's plan of the layer's code parts and sink (``ops.attention_plan``),
    made again only when a quantizer, a buffer's storage or the sink changed (a quantizer's
    constants are set before its first codes exist, so new sides come with new storage); None
    where the step cannot take them."""
    made_of = [x for kq, vq, kbuf, vbuf in codes
               for x in (kq, kbuf.data["payload"], vq, vbuf.data["payload"])]
    made_of += sink or ()
    hit = _PLANS.get(layer)
    if hit is not None and len(hit[0]) == len(made_of) and all(
            a is b for a, b in zip(hit[0], made_of, strict=True)):
        return hit[1]
    plan = _make_plan(layer, codes, sink, bh, d)
    _PLANS[layer] = (made_of, plan)
    return plan


def _make_plan(layer, codes, sink, bh: int, d: int):
    sides, packed, norms = [], [], []
    for kq, vq, kbuf, vbuf in codes:
        for quantizer, buf in ((kq, kbuf), (vq, vbuf)):
            got = _step_side(quantizer)
            if got is None:
                return None
            codes_np, norms_np = buf.host("payload", got[1])
            sides.append(got[0])
            packed.append(codes_np)
            norms.append(norms_np)
    exact = [t.reshape(bh, -1, d) for t in sink or ()]
    return ops.attention_plan(layer.num_heads, bh, d, sides, packed, norms, exact, layer.dtype)


def _compiled_step(layer, query, mask, kv_offset, scaling, G):
    """``attend`` as one compiled call (``ops.attention_step``) when every stored token is
    visible to every query (a decode step without padding) and the layer's segments are what
    the kernel takes; else None."""
    if not COMPILED_STEP or query.device.type != "cpu" or not ops.has_cpu_kernels():
        return None
    B, Hq, Q, D = query.shape
    if mask is None:
        if Q != 1:  # several new tokens: causal among themselves
            return None
    elif not _all_visible(mask):
        return None
    parts = layer.step_parts()
    if parts is None:
        return None
    first, codes, sink, window = parts
    if mask is not None and first < kv_offset:
        return None
    bh = B * layer.num_heads
    plan = _step_plan(layer, codes, sink, bh, D)
    if plan is None:
        return None
    ranges = [i for _, _, kbuf, _ in codes for i in (kbuf.start, kbuf.stop)]
    ex = [t.reshape(bh, -1, D) for t in window or ()]
    out = ops.attention_step(query.float().reshape(bh, G * Q, D), scaling, plan, ranges, ex)
    return None if out is None else out.reshape(B, Hq, Q, D)


def _attend_rows(layer, segs, q, G, qpos, mask, kv_offset, scaling, softcap):
    """q: (B, H, G*Q, D) float32 rows for queries at positions qpos (Q,)."""
    plans = _kernel_plan(layer, segs, q, mask, kv_offset, softcap)
    if plans is not None:
        return _attend_rows_kernel(plans, segs, q, G, qpos, mask, kv_offset, scaling)
    B, H = q.shape[:2]
    scores = []
    for kind, k, _, pos, logw, coder in segs:
        if kind == "codes":
            s = coder[0].scores(q, k)
        else:
            s = q @ k.float().transpose(-1, -2)
        s = s * scaling
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        bias = _bias(mask, pos, qpos, kv_offset, B, H, G, q.device)
        if bias is not None:
            s = s + bias
        if logw:
            s = s + logw
        scores.append(s)
    sizes = [s.shape[-1] for s in scores]
    p = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    # A row whose every key is masked (left padding) gives NaN; SDPA returns 0 there too
    # only by accident of the kernel, so define it: zero output.
    p = torch.nan_to_num(p, nan=0.0)
    out = None
    for (kind, _, v, _, _, coder), pp in zip(segs, torch.split(p, sizes, dim=-1), strict=True):
        o = coder[1].weighted_sum(pp, v) if kind == "codes" else pp @ v.float()
        out = o if out is None else out + o
    return out
