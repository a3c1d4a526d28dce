"""One decoder layer's compressed KV cache (a transformers ``CacheLayerMixin``).

Tokens live in up to four segments, oldest first, per (batch, KV head):

* sink:    the first ``sink_length`` tokens, full precision (attention sinks);
* codes:   keys and values as tqvec codes (never decoded to d-space during attention);
* pending: BalanceKV tokens still inside MergeAndReduce (full precision, weight 2^level);
* window:  the most recent ``residual_length`` tokens plus the tokens of the current forward,
           full precision in the model's dtype; with ``residual_bits=8`` held as 8-bit
           TurboQuant codes instead (attended from the codes like the code segment: ~0.6 %
           error per vector, half the bytes of float16), coded in blocks of 16 tokens (the
           newest < 16 stay exact, and a forward's own tokens are exact in its attention)
           and moved on in blocks of 64 (of 16 on sliding-window layers).

Tokens move window -> (sink | balance ->) codes when the window overflows, each token encoded
exactly once into its final code (from its 8-bit window code when ``residual_bits=8``: the 8-bit
error, a relative mean square of ~4e-5, adds to the final code's ~3e-2 at 3 bits). The move
happens right after the attention of the forward that brought the token (so a forward always
attends to its own tokens exactly) or, on the decode-then-SDPA fallback, at the start of the
next ``update``. Sliding-window layers drop tokens older than the window.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from transformers.cache_utils import CacheLayerMixin

from .. import ops
from .balance import BalanceConfig, MergeAndReduce
from .quant import ChannelScale, ChannelSplit, Fields, KVQuantizer, make_quantizer

__all__ = ["KVSettings", "CompressedLayer", "LAYER_OPTIONS"]


@dataclass(frozen=True)
class KVSettings:
    key_codec: str = "turbo"
    key_bits: float = 3
    value_codec: str = "turbo"
    value_bits: float = 3
    residual_length: int = 32
    sink_length: int = 4
    outlier_channels: int = 0
    outlier_bits: int | None = None
    value_outlier_channels: int = 0
    group: int | None = None
    calibrate: bool = True
    balance: BalanceConfig | None = None
    seed: int = 0
    norm_bits: int = 16
    residual_bits: int | None = None


# the options one layer may set (``TurboQuantCache(layer_overrides=...)``): all but the seed
LAYER_OPTIONS = tuple(f.name for f in fields(KVSettings) if f.name != "seed")


def _capacity(tokens: int) -> int:
    """Token slots to allocate for ``tokens``: a sixteenth more, at least 64 more (a window
    move's block fits without another reallocation, which also remakes the compiled step's
    plan)."""
    return tokens + max(64, tokens // 16)


class _Buffer:
    """Growable (B, H, capacity, *) buffers for per-token fields; append along tokens."""

    def __init__(self) -> None:
        self.data: dict[str, torch.Tensor] = {}
        self.start = 0
        self.stop = 0

    def __len__(self) -> int:
        return self.stop - self.start

    def append(self, f: Fields) -> None:
        n = next(iter(f.values())).shape[2]
        # Spare capacity is zero-filled: the fused decode-attention op reads whole buffers
        # (tokens [start, stop) count), so no slot may hold NaN/Inf garbage.
        # Capacity grows by a sixteenth: amortized O(1) appends with at most ~6 % of a long
        # context's codes allocated and unused.
        if not self.data:
            self.data = {k: v.new_zeros((*v.shape[:2], _capacity(n), *v.shape[3:]))
                         for k, v in f.items()}
        cap = next(iter(self.data.values())).shape[2]
        if self.stop + n > cap:
            live = len(self)
            new_cap = _capacity(live + n)
            self.data = {k: torch.cat([v[:, :, self.start: self.stop],
                                       v.new_zeros((*v.shape[:2], new_cap - live, *v.shape[3:]))],
                                      dim=2) for k, v in self.data.items()}
            self.start, self.stop = 0, live
        for k, v in f.items():
            self.data[k][:, :, self.stop: self.stop + n] = v
        self.stop += n

    def view(self) -> Fields:
        return {k: v[:, :, self.start: self.stop] for k, v in self.data.items()}

    def drop_front(self, n: int) -> None:
        self.start += min(n, len(self))

    def keep_front(self, n: int) -> None:
        self.stop = self.start + min(n, len(self))

    def map_(self, fn) -> None:
        self.data = {k: fn(v[:, :, self.start: self.stop]) for k, v in self.data.items()}
        self.stop -= self.start
        self.start = 0

    def nbytes(self) -> int:
        return sum(v[0, 0, 0].numel() * v.element_size() * v.shape[0] * v.shape[1]
                   for v in self.data.values()) * len(self)


class CodePart(NamedTuple):
    """A code segment's quantizers and the buffers of its codes."""

    kq: KVQuantizer
    vq: KVQuantizer
    kbuf: _Buffer
    vbuf: _Buffer


class Segment(NamedTuple):
    """One stored segment (``CompressedLayer.segments``). kind ``"exact"``: keys and values
    are (B, H, n, D) tensors, coder None; kind ``"codes"``: field dicts, coder their
    ``CodePart``. pos: a (start, stop) position range or a (B, H, n) tensor of positions;
    log_weight: BalanceKV's log 2^level added to the segment's scores."""

    kind: str
    keys: Any
    values: Any
    pos: tuple[int, int] | torch.Tensor
    log_weight: float
    coder: CodePart | None


class StepParts(NamedTuple):
    """The stored tokens as ``ops.attention_step`` takes them (``CompressedLayer.step_parts``):
    the oldest stored position, the code parts (the codes, the window's 8-bit codes), the
    sink's and the window's exact (keys, values) (B, H, n, D) or None, and the position of the
    window's first exact token; every part holds a contiguous position range."""

    first: int
    codes: list[CodePart]
    code_pos: list[tuple[int, int]]  # each code part's position range
    sink: tuple[torch.Tensor, torch.Tensor] | None
    window: tuple[torch.Tensor, torch.Tensor] | None
    window_start: int


def _window(x: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
    """Tokens [start, stop) of a (B, H, T, D) window, in storage of their own: a slice would
    keep its source alive - after a prefill, every prompt token's full-precision keys and values,
    many times the bytes of the codes."""
    return x[:, :, start:stop].clone()


class CompressedLayer(CacheLayerMixin):
    """Keys/values of one layer: sink + codes (+ BalanceKV pending) + full-precision window."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False
    WINDOW_BLOCK = 16  # exact window tokens coded at once with residual_bits (see ``flush``)
    MOVE_BLOCK = 64  # 8-bit window tokens moved on at once, full-attention layers (``flush``)

    def __init__(self, settings: KVSettings, layer_idx: int, sliding_window: int | None = None,
                 codes_attention=lambda: True):
        super().__init__()
        self.settings = settings
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self._codes_attention = codes_attention
        self._reset_state()

    def _reset_state(self) -> None:
        self.keys = self.values = None  # the window's exact tokens (B, H, w, D)
        self.wkbuf, self.wvbuf = _Buffer(), _Buffer()  # its 8-bit coded tokens (residual_bits)
        self.wkq = self.wvq = None
        self.is_initialized = False
        self.cumulative_length = 0
        self.sink_k = self.sink_v = None
        self.kbuf, self.vbuf = _Buffer(), _Buffer()
        self.code_start = 0                 # position of the first code (no balance)
        self.code_pos: _Buffer | None = None  # explicit positions (with balance)
        self.mr: MergeAndReduce | None = None
        self.kq = self.vq = None
        self.awaiting_attention = False
        self.unsettled = False  # tokens appended since the last flush (else flush is a no-op)
        self.q_energy = None  # (H, d) query mean squares seen at the first attention
        # (B,) leading pad tokens of each row of a left-padded batch (None: not seen yet)
        self.pads: torch.Tensor | None = None
        # (what it was made from, ops.KVStepPlan or None): ``step_plan``
        self._step: tuple[list, ops.KVStepPlan | None] | None = None

    # -- setup -------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        s = self.settings
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch, self.num_heads, _, self.head_dim = key_states.shape
        d = self.head_dim
        seed = s.seed + 1000003 * self.layer_idx
        self.kq: KVQuantizer = make_quantizer(s.key_codec, d, s.key_bits, seed=seed, role="keys",
                                              outlier_channels=s.outlier_channels,
                                              outlier_bits=s.outlier_bits, group=s.group,
                                              norm_bits=s.norm_bits)
        self.vq: KVQuantizer = make_quantizer(s.value_codec, d, s.value_bits, seed=seed + 1,
                                              role="values",
                                              outlier_channels=s.value_outlier_channels,
                                              group=s.group, norm_bits=s.norm_bits)
        if s.residual_bits is not None:
            # one 8-bit codec for the window's keys and values: a block of tokens moves through
            # one encode (and later one decode) of both, not two - a call's fixed cost is more
            # than its arithmetic
            self.wkq = self.wvq = make_quantizer("turbo", d, s.residual_bits, seed=seed + 3,
                                                 role="keys")
        if s.calibrate and s.key_codec != "fp16":
            self.kq = ChannelScale(self.kq, rope_pairs=True)
        if s.calibrate and s.value_codec != "fp16":
            self.vq = ChannelScale(self.vq)
        # A sliding window forgets old tokens anyway: no sink and no token selection there.
        self.balance = s.balance if not self.is_sliding else None
        self.sink_length = s.sink_length if not self.is_sliding else 0
        if self.balance is not None:
            self.mr = MergeAndReduce(self.balance, 1.0 / math.sqrt(d), seed + 2)
            self.code_pos = _Buffer()
        empty = key_states.new_zeros((self.batch, self.num_heads, 0, d))
        self.keys, self.values = empty, empty.clone()
        self.sink_k, self.sink_v = empty.clone(), empty.clone()
        self.is_initialized = True

    # -- transformers API --------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.batch or key_states.shape[1] != self.num_heads or (
                key_states.shape[3] != self.head_dim):
            raise ValueError(f"key_states must have shape ({self.batch}, {self.num_heads}, T, "
                             f"{self.head_dim}) in layer {self.layer_idx}, got "
                             f"{tuple(key_states.shape)}")
        if self.awaiting_attention:
            raise RuntimeError(
                f"layer {self.layer_idx}: the previous forward never ran the 'tqvec' attention "
                "on this cache's keys (the model changed the key states between cache.update and "
                "attention, or bypassed the attention interface); the cache cannot compute "
                "attention from its codes for this model")
        self.flush()  # on sliding layers this also forgets what the new tokens cannot see
        self.cumulative_length += key_states.shape[2]
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        self.unsettled = True
        if self._codes_attention():
            self.awaiting_attention = True
            handle_k, handle_v = self.keys, self.values
            # The attention function finds this layer through the returned key tensor.
            handle_k = handle_k.view_as(handle_k)
            handle_k.tqvec_layer = self
            return handle_k, handle_v
        if self.mr is not None:
            raise ValueError("balance needs attention='codes' (its 2^level token weights cannot "
                             "be expressed to SDPA)")
        return self.decoded()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.is_sliding:
            return self.cumulative_length + query_length, 0
        kv_offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        if self.cumulative_length >= self.sliding_window:
            return self.sliding_window - 1 + query_length, kv_offset
        return self.cumulative_length + query_length, kv_offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        self._reset_state()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers passes a negative count),
        or keep the first ``tokens_to_remove`` when it is positive (legacy form)."""
        if not self.is_initialized:
            return
        keep = (self.cumulative_length + tokens_to_remove if tokens_to_remove <= 0
                else tokens_to_remove)
        if keep >= self.cumulative_length:
            return
        if self.mr is not None or self.is_sliding:
            raise ValueError("crop is not supported with balance or on sliding-window layers "
                             "once tokens have left the window")
        self.flush()
        drop = self.cumulative_length - keep
        w = self.keys.shape[2]
        cut = min(drop, w)
        self.keys, self.values = _window(self.keys, 0, w - cut), _window(self.values, 0, w - cut)
        drop -= cut
        for kb, vb in ((self.wkbuf, self.wvbuf), (self.kbuf, self.vbuf)):  # newest first
            n = len(kb)
            cut = min(drop, n)
            kb.keep_front(n - cut)
            vb.keep_front(n - cut)
            drop -= cut
        if drop:
            s = self.sink_k.shape[2] - drop
            self.sink_k, self.sink_v = self.sink_k[:, :, :s], self.sink_v[:, :, :s]
        self.cumulative_length = keep

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.keys, self.values = fn(self.keys), fn(self.values)
        self.sink_k, self.sink_v = fn(self.sink_k), fn(self.sink_v)
        for buf in (self.kbuf, self.vbuf, self.wkbuf, self.wvbuf, self.code_pos):
            if buf is not None and buf.data:
                buf.map_(fn)
        if self.mr is not None:
            self.mr.map_(fn)
        if self.pads is not None:
            self.pads = fn(self.pads)
        self.batch = self.keys.shape[0]

    def offload(self):
        raise NotImplementedError("offloading is not supported by the compressed cache")

    def prefetch(self):
        return None

    # -- token movement ----------------------------------------------------------------------
    def flush(self) -> None:
        """Move the window's overflow (all but the last residual_length tokens) onward.

        With ``residual_bits`` tokens move in blocks: the window's exact tokens into 8-bit codes
        once they fill ``WINDOW_BLOCK``, the overflow on to the codes once it reaches
        ``MOVE_BLOCK`` (``WINDOW_BLOCK`` on sliding layers; so the window holds residual_length
        to residual_length + MOVE_BLOCK - 1 tokens, at most WINDOW_BLOCK - 1 of them exact).
        A codec call costs far more than its arithmetic on a few tokens, about as much for 64
        tokens as for 16: per 64 decode steps these blocks make 7 calls (four 8-bit encodes,
        one 8-bit decode, the key and the value encodes) where blocks of 16 for both made 16."""
        # a flush leaves less than a move's overflow and a block's exact tokens: only appended
        # tokens give the next one work (it runs at every layer's update and attention)
        if not self.is_initialized or not self.unsettled:
            return
        if self.is_sliding:  # what no later query can see is dropped now, not coded and held
            self._evict(self.cumulative_length - (self.sliding_window - 1))
        block = 1 if self.wkq is None else self.WINDOW_BLOCK
        # a sliding layer holds at most its window: there the longer 8-bit window of bigger
        # moves would cost a large share of its bytes, so it moves on 16 at a time
        move = 1 if self.wkq is None else block if self.is_sliding else self.MOVE_BLOCK
        w = self.window_length()
        over = w - self.settings.residual_length
        if over >= move:
            self._flush_oldest(over, self.cumulative_length - w)
        if self.wkq is not None and self.keys.shape[2] >= block:
            # sink tokens still in the window go to the sink as they are, not through 8 bits
            n_sink = min(max(self.sink_length - self.sink_k.shape[2], 0), self.keys.shape[2])
            if n_sink and not len(self.wkbuf) and not len(self.kbuf):
                self.sink_k = torch.cat([self.sink_k, self.keys[:, :, :n_sink]], dim=2)
                self.sink_v = torch.cat([self.sink_v, self.values[:, :, :n_sink]], dim=2)
                self.keys, self.values = _window(self.keys, n_sink), _window(self.values, n_sink)
            # what stays in the window is held as 8-bit codes from now on
            n = self.keys.shape[2]
            f = self._code(self.wkq, torch.cat([self.keys, self.values], dim=2).float(),
                           "key/value")
            self.wkbuf.append({k: v[:, :, :n] for k, v in f.items()})
            self.wvbuf.append({k: v[:, :, n:] for k, v in f.items()})
            self.keys, self.values = _window(self.keys, 0, 0), _window(self.values, 0, 0)
        self.unsettled = False

    def window_length(self) -> int:
        return len(self.wkbuf) + self.keys.shape[2]

    def _coded_window(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` 8-bit coded window tokens, decoded (float32), to move onward."""
        kf, vf = self.wkbuf.view(), self.wvbuf.view()
        both = self.wkq.decode({k: torch.cat([kf[k][:, :, :n], vf[k][:, :, :n]], dim=2)
                                for k in kf})  # one codec for both (lazy_initialization)
        return both[:, :, :n], both[:, :, n:]

    def _flush_oldest(self, over: int, first: int) -> None:
        """Move the window's ``over`` oldest tokens (the first at position ``first``) onward."""
        n_coded = min(over, len(self.wkbuf))
        if n_coded:
            k_c, v_c = self._coded_window(n_coded)
            self.wkbuf.drop_front(n_coded)
            self.wvbuf.drop_front(n_coded)
        n_exact = over - n_coded
        k_old, v_old = self.keys[:, :, :n_exact], self.values[:, :, :n_exact]
        self.keys, self.values = _window(self.keys, n_exact), _window(self.values, n_exact)
        if n_coded:
            k_old = torch.cat([k_c.to(self.dtype), k_old], dim=2)
            v_old = torch.cat([v_c.to(self.dtype), v_old], dim=2)
        n_sink = min(max(self.sink_length - first, 0), over)
        if n_sink:
            self.sink_k = torch.cat([self.sink_k, k_old[:, :, :n_sink]], dim=2)
            self.sink_v = torch.cat([self.sink_v, v_old[:, :, :n_sink]], dim=2)
            k_old, v_old = k_old[:, :, n_sink:], v_old[:, :, n_sink:]
            first += n_sink
        if not k_old.shape[2]:
            return
        if self.mr is not None:
            pos = torch.arange(first, first + k_old.shape[2], device=self.device)
            out = self.mr.push(k_old.float(), v_old.float(),
                               pos.expand(self.batch, self.num_heads, -1).contiguous())
            if out is None:
                return
            k_old, v_old, pos = out
            self.code_pos.append({"pos": pos[..., None].to(torch.int32)})
        elif not len(self.kbuf):
            self.code_start = first
        self._encode(k_old, v_old, first)

    def _encode(self, k: torch.Tensor, v: torch.Tensor, first: int) -> None:
        """Code tokens at positions first .. of k, v (with balance: their selection)."""
        k, v = k.float(), v.float()
        w = self.token_weights(first, k.shape[2]) if self.mr is None else None
        # Data-dependent setup at the first codes: the channel scale, then the outlier channels
        # of what the split actually codes ((x - mu) / s under a scale - the default with
        # outlier_channels: the channels whose error weighs most in the scores).
        for quant, x, q_energy in ((self.kq, k, self.q_energy), (self.vq, v, None)):
            inner, coded = quant, x
            if isinstance(quant, ChannelScale):
                if quant.scale is None:
                    quant.calibrate(x, q_energy, w)
                inner, coded = quant.inner, quant.transform(x)
            if isinstance(inner, ChannelSplit) and inner.channels is None:
                inner.set_channels(coded, w)
        kf = self._code(self.kq, k.contiguous(), "key")
        vf = self._code(self.vq, v.contiguous(), "value")
        self.kbuf.append(kf)
        self.vbuf.append(vf)

    def _code(self, quant, x: torch.Tensor, what: str) -> dict:
        """``quant.encode_heads(x)``; a NaN/Inf the model put in its key/value states is named
        as such (the codec's own message speaks of rows of its flattened input)."""
        try:
            return quant.encode_heads(x)
        except ValueError as e:
            if bool(torch.isfinite(x).all()):
                raise
            raise ValueError(
                f"layer {self.layer_idx}: the model's {what} states hold NaN/Inf ({e}): the "
                "model overflowed its dtype (some bf16-trained models do in float16; run them "
                "in bfloat16 or float32). Tokens were being moved into codes: discard this "
                "cache") from e

    def _evict(self, first_visible: int) -> None:
        """Sliding layers: forget tokens before position ``first_visible``."""
        if first_visible <= 0:
            return
        n = len(self.kbuf)
        if n and first_visible > self.code_start:
            drop = min(first_visible - self.code_start, n)
            self.kbuf.drop_front(drop)
            self.vbuf.drop_front(drop)
            self.code_start += drop
        wstart = self.cumulative_length - self.window_length()
        if first_visible > wstart and len(self.wkbuf):
            cut = min(first_visible - wstart, len(self.wkbuf))
            self.wkbuf.drop_front(cut)
            self.wvbuf.drop_front(cut)
            wstart += cut
        w = self.keys.shape[2]
        if first_visible > wstart:
            cut = min(first_visible - wstart, w)
            self.keys, self.values = _window(self.keys, cut), _window(self.values, cut)

    def observe_padding(self, mask: torch.Tensor | None, query_length: int) -> None:
        """At the layer's first forward (positions from 0), the leading pad tokens of each row
        of a left-padded batch, from the attention mask (B, 1, Q, K): the key columns its last
        query row may not see before the first one it may. The sink then reaches past every
        row's pads, and calibration counts no pad token (a pad's key is no key of the text)."""
        if self.pads is not None or self.cumulative_length != query_length:
            return
        pads = torch.zeros(self.batch, dtype=torch.int64, device=self.device)
        if mask is not None and mask.dim() == 4:
            last = mask[:, 0, -1, :]
            seen = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
            seen = seen.expand(self.batch, -1)
            pads = torch.where(seen.any(-1), seen.to(torch.int8).argmax(-1),
                               torch.zeros_like(pads)).to(torch.int64)
        self.pads = pads
        if self.sink_length:
            self.sink_length = self.settings.sink_length + int(pads.max())

    def token_weights(self, first: int, n: int) -> torch.Tensor | None:
        """(B, 1, n, 1) float32 weights of the tokens at positions first .. first+n-1 in the
        per-head statistics of calibration: 0 for a row's pad tokens, 1 for the rest; None
        without pads."""
        if self.pads is None or not bool((self.pads > 0).any()):
            return None
        pos = torch.arange(first, first + n, device=self.pads.device)
        return (pos[None, :] >= self.pads[:, None]).to(torch.float32)[:, None, :, None]

    def observe_queries(self, query: torch.Tensor) -> None:
        """Record per-KV-head query channel energy (once, at prefill) for key calibration
        (a left-padded row's pad queries left out)."""
        if self.q_energy is None:
            B, Hq, Q, D = query.shape
            g = query.float().reshape(B, self.num_heads, Hq // self.num_heads, Q, D)
            w = self.token_weights(self.cumulative_length - Q, Q)
            if w is None:
                self.q_energy = (g ** 2).mean(dim=(0, 2, 3))
            else:
                w = w[:, :, None]  # (B, 1, 1, Q, 1)
                self.q_energy = ((g ** 2) * w).sum(dim=(0, 2, 3)) / (
                    w.sum() * (Hq // self.num_heads)).clamp_min(1.0)

    # -- views for attention -----------------------------------------------------------------
    def segments(self):
        """Yield a ``Segment`` for every stored segment, oldest first: the sink, the codes
        proper, BalanceKV's pending tokens, the window's 8-bit codes (``residual_bits``) and
        its exact tokens."""
        w = self.window_length()
        s = self.sink_k.shape[2]
        if s:
            yield Segment("exact", self.sink_k, self.sink_v, (0, s), 0.0, None)
        coder = CodePart(self.kq, self.vq, self.kbuf, self.vbuf)
        if len(self.kbuf):
            if self.code_pos is not None:
                pos = self.code_pos.view()["pos"][..., 0].long()
                yield Segment("codes", self.kbuf.view(), self.vbuf.view(), pos,
                              self.balance.rounds * math.log(2.0), coder)
            else:
                yield Segment("codes", self.kbuf.view(), self.vbuf.view(),
                              (self.code_start, self.code_start + len(self.kbuf)), 0.0, coder)
        if self.mr is not None:
            for level, k, v, pos in self.mr.pending():
                yield Segment("exact", k, v, pos, level * math.log(2.0), None)
        start = self.cumulative_length - w
        if len(self.wkbuf):
            n = len(self.wkbuf)
            yield Segment("codes", self.wkbuf.view(), self.wvbuf.view(), (start, start + n), 0.0,
                          CodePart(self.wkq, self.wvq, self.wkbuf, self.wvbuf))
            start += n
        yield Segment("exact", self.keys, self.values, (start, self.cumulative_length), 0.0,
                      None)

    def step_parts(self) -> StepParts | None:
        """The stored tokens as ``ops.attention_step`` takes them (``StepParts``), or None
        with BalanceKV (its tokens carry explicit positions and weights)."""
        if self.mr is not None:
            return None
        w0 = self.cumulative_length - self.window_length()
        codes, code_pos = [], []
        if len(self.kbuf):
            codes.append(CodePart(self.kq, self.vq, self.kbuf, self.vbuf))
            code_pos.append((self.code_start, self.code_start + len(self.kbuf)))
        if len(self.wkbuf):
            codes.append(CodePart(self.wkq, self.wvq, self.wkbuf, self.wvbuf))
            code_pos.append((w0, w0 + len(self.wkbuf)))
        sink = (self.sink_k, self.sink_v) if self.sink_k.shape[2] else None
        window = (self.keys, self.values) if self.keys.shape[2] else None
        window_start = self.cumulative_length - self.keys.shape[2]
        if sink is not None:
            first = 0
        elif len(self.kbuf):
            first = self.code_start
        else:
            first = w0
        return StepParts(first, codes, code_pos, sink, window, window_start)

    def step_plan(self, parts: StepParts) -> ops.KVStepPlan | None:
        """The layer's code parts and sink as an ``ops.KVStepPlan``, made again only when a
        quantizer, a buffer's storage or the sink changed (the buffers are reallocated only as
        they grow, and a quantizer's constants are set before its first codes exist, so new
        constants come with new storage); None where a side has no ``step_side``."""
        made_of = []
        for c in parts.codes:
            made_of += (c.kq, c.kbuf.data["payload"], c.vq, c.vbuf.data["payload"])
        made_of += parts.sink or ()
        if self._step is not None and len(self._step[0]) == len(made_of) and all(
                map(operator.is_, self._step[0], made_of)):
            return self._step[1]
        self._step = (made_of, self._make_step_plan(parts))
        return self._step[1]

    def _make_step_plan(self, parts: StepParts) -> ops.KVStepPlan | None:
        bh, d = self.batch * self.num_heads, self.head_dim
        segments = []
        for c in parts.codes:
            sides = []
            for quantizer, buf in ((c.kq, c.kbuf), (c.vq, c.vbuf)):
                side = quantizer.step_side(self.device)
                if side is None:
                    return None
                data = buf.data
                cap = data["payload"].shape[2]
                sides.append((side, data["payload"].reshape(bh, cap, -1),
                              data[quantizer.multiplier_field()].reshape(bh, cap)))
            (k, kc, km), (v, vc, vm) = sides
            segments.append(ops.KVCodeSegment(k, v, kc, km, vc, vm))
        sink = None if parts.sink is None else tuple(t.reshape(bh, -1, d) for t in parts.sink)
        return ops.KVStepPlan(self.num_heads, bh, d, self.dtype, segments, sink)

    def only_window(self) -> bool:
        return not (self.sink_k.shape[2] or len(self.kbuf) or len(self.wkbuf)
                    or (self.mr is not None and self.mr.pending()))

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored tokens decoded to full tensors (the decode-then-SDPA reference)."""
        ks, vs = [], []
        for seg in self.segments():
            k, v = seg.keys, seg.values
            if seg.kind == "codes":
                k, v = seg.coder.kq.decode(k), seg.coder.vq.decode(v)
            ks.append(k.to(self.dtype))
            vs.append(v.to(self.dtype))
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2)

    # -- accounting --------------------------------------------------------------------------
    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        t = 0
        for x in (self.keys, self.values, self.sink_k, self.sink_v):
            t += x.numel() * x.element_size()
        t += self.kbuf.nbytes() + self.vbuf.nbytes() + self.wkbuf.nbytes() + self.wvbuf.nbytes()
        t += self.kq.side_bytes() + self.vq.side_bytes()
        if self.code_pos is not None:
            t += self.code_pos.nbytes()
        if self.mr is not None:
            t += self.mr.nbytes()
        return t

    def represented_tokens(self) -> int:
        """Tokens this layer stands for: all seen, or the visible window on sliding layers."""
        if self.is_sliding:
            return min(self.cumulative_length, self.sliding_window - 1)
        return self.cumulative_length
