"""Per-token quantizers for cached keys and values, batched over (batch, KV head).

A quantizer turns rows x (N, d) into a dict of per-row fields (packed payload + scalars); the
cache layer keeps those fields in buffers of shape (B, H, T, ...). Attention then needs only:

* keys:   ``scores(q (B, H, M, d), fields) -> (B, H, M, T)``, the asymmetric estimate of <q, k>
  computed on the codes (queries rotated/projected once, keys never decoded to d-space);
* values: ``weighted_sum(p (B, H, M, T), fields) -> (B, H, M, d)``, sum_t p_t v_hat_t, for
  TurboQuant accumulated in the rotated domain and rotated back once per output row.

``decode`` exists for the reference path (decode-then-SDPA) and the tests.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import _validate as V
from .. import ops
from ..codebooks import sphere_block_codebook
from ..codecs import QJL, TurboQuant
from ..codecs.base import Codec, Codes, store_norm
from ..random import make_rotation

__all__ = ["KVQuantizer", "CodecQuantizer", "BlockVQQuantizer", "TokenQuantizer", "ChannelSplit",
           "make_quantizer", "Float16Quantizer"]

Fields = dict[str, torch.Tensor]


class KVQuantizer:
    """Interface; ``bytes_per_token`` is the exact storage of one (token, head) row."""

    dim: int
    bytes_per_token: int

    def encode(self, x: torch.Tensor) -> Fields:  # (N, d) float32 -> per-row fields
        raise NotImplementedError

    def encode_heads(self, x: torch.Tensor) -> Fields:
        """(B, H, T, d) float32 -> fields of shape (B, H, T, *)."""
        B, H, T, d = x.shape
        f = self.encode(x.reshape(-1, d))
        return {k: v.reshape(B, H, T, *v.shape[1:]) for k, v in f.items()}

    def decode(self, f: Fields) -> torch.Tensor:  # fields (..., T, *) -> (..., T, d) float32
        raise NotImplementedError

    def scores(self, q: torch.Tensor, f: Fields) -> torch.Tensor:
        """(B, H, M, d) float32 queries x fields (B, H, T, *) -> (B, H, M, T) float32."""
        return q @ self.decode(f).transpose(-1, -2)

    def weighted_sum(self, p: torch.Tensor, f: Fields) -> torch.Tensor:
        """(B, H, M, T) float32 weights x fields -> (B, H, M, d) float32."""
        return p @ self.decode(f)

    def side_bytes(self) -> int:
        """Bytes of per-layer tables (calibration vectors, channel sets), not per token."""
        return 0

    def step_side(self, device: torch.device) -> ops.KVSide | None:
        """This quantizer's constants as ``ops.attention_step`` takes a code side, or None where
        its codes are not of that form (one rotated-domain scalar term per token)."""
        return None

    def multiplier_field(self) -> str | None:
        """The stored field ``step_side``'s per-token multipliers are read from."""
        return None


class _CodecRotation:
    """A codec's rotation called as ``ops.HadamardRotate`` is (``x`` or ``x, inverse=True``),
    for codecs without a prepared Hadamard op (a dense rotation)."""

    def __init__(self, codec: Codec):
        self.codec = codec

    def __call__(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return self.codec.unrotate(x) if inverse else self.codec.rotate(x)


def _mean_bt(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """(H, d) mean of x (B, H, T, d) over batch and tokens, each token weighted by weights
    (B, 1, T, 1) (None: the plain mean)."""
    if weights is None:
        return x.mean(dim=(0, 2))
    total = weights.sum() * 1.0
    if not float(total):
        return x.mean(dim=(0, 2))
    return (x * weights).sum(dim=(0, 2)) / total


def _flat(f: Fields) -> tuple[tuple[int, ...], Fields]:
    """(B, H, T, *) fields -> leading shape and (B*H*T, *) contiguous fields."""
    lead = tuple(f["payload"].shape[:-1])
    return lead, {k: v.reshape(-1, *v.shape[len(lead):]) for k, v in f.items()}


class _LogNorms:
    """One-byte log codes for per-row float16 scalars (``norm_bits=8``): log2 in steps of 1/16
    octave (relative error <= 2.2 %, a mean-square ~1.6e-4 added to a codec's relative MSE)
    over +-8 octaves around the median of the first rows encoded (fixed then; 4 bytes per
    quantizer, counted); 0 codes a zero, values beyond the range clamp to its ends."""

    _STEPS = 16  # codes per octave
    _OCTAVES = 8  # each side of the centre
    center: float | None = None

    def _log8(self, v: torch.Tensor) -> torch.Tensor:
        lg = torch.log2(v.float().clamp_min(1e-30))
        if self.center is None:
            pos = lg[v > 0]
            self.center = float(torch.round(pos.median())) if pos.numel() else 0.0
        half = self._STEPS * self._OCTAVES
        code = torch.round((lg - self.center) * self._STEPS).clamp(-half + 1, half - 1) + half
        return torch.where(v > 0, code, torch.zeros_like(code)).to(torch.uint8)

    def unlog8(self, c: torch.Tensor) -> torch.Tensor:
        half = self._STEPS * self._OCTAVES
        v = torch.exp2((c.float() - half) / self._STEPS + (self.center or 0.0))
        return torch.where(c > 0, v, torch.zeros_like(v)).to(torch.float16)

    def side_bytes(self) -> int:
        return 4 if self.center is not None else 0


class CodecQuantizer(_LogNorms, KVQuantizer):
    """Any tqvec codec with a term-form estimator (TurboQuant mse/prod, QJL).

    ``norm_bits=8`` stores the codec's float16 per-row scalars (the norm; prod's residual norm)
    as one byte each (``_LogNorms``): at head_dim 64 that is 0.125 bit/element less than
    float16 norms for keys and values each.
    """

    def __init__(self, codec: Codec, norm_bits: int = 16):
        self.codec = codec
        self.dim = codec.dim
        self.norm_bits = V.choice(norm_bits, "norm_bits", (8, 16))
        layout = codec.scalar_layout()
        self.log_fields = [k for k, (shape, dt) in layout.items()
                           if shape == () and dt == torch.float16] if norm_bits == 8 else []
        self.bytes_per_token = codec.code_size - len(self.log_fields)  # 2 bytes -> 1 each
        # Values can be summed in the rotated domain only for a single rotated-domain term.
        self.rotated_values = codec.kernel_form() is not None

    def encode(self, x: torch.Tensor) -> Fields:
        c = self.codec.encode(x)
        out = {"payload": c.payload, **c.scalars}
        for k in self.log_fields:
            out[k] = self._log8(out[k])
        return out

    def _codes(self, flat: Fields) -> Codes:
        scalars = {k: v for k, v in flat.items() if k != "payload"}
        for k in self.log_fields:
            scalars[k] = self.unlog8(scalars[k])
        return Codes(flat["payload"], scalars, self.codec.params)

    def multiplier_field(self) -> str | None:
        form = self.codec.kernel_form()
        return None if form is None else form.multiplier_field

    def step_side(self, device: torch.device) -> ops.KVSide | None:
        """The codec's ``kernel_form`` parts where its multiplier is a stored field (8-bit
        coded norms through their table)."""
        form = self.codec.kernel_form()
        if form is None or form.multiplier_field is None:
            return None
        rot = self.codec.query_rotation(device)
        table = None
        if form.multiplier_field in self.log_fields:
            table = self.unlog8(torch.arange(256, dtype=torch.uint8)).float().to(device)
        return ops.KVSide(rot if rot is not None else _CodecRotation(self.codec),
                          self.codec.centroids_on(device), form.bits, norm_table=table)

    def decode(self, f: Fields) -> torch.Tensor:
        lead, flat = _flat(f)
        if not len(flat["payload"]):
            return torch.zeros((*lead, self.dim), dtype=torch.float32,
                               device=flat["payload"].device)
        return self.codec.decode(self._codes(flat)).reshape(*lead, self.dim)

    def scores(self, q: torch.Tensor, f: Fields) -> torch.Tensor:
        lead, flat = _flat(f)
        B, H, M, d = q.shape
        qterms = self.codec.query_terms(q.reshape(-1, d))
        out = None
        for qt, (ct, scale) in zip(qterms, self.codec.code_terms(self._codes(flat)),
                                   strict=True):
            part = (qt.reshape(B, H, M, -1) @ ct.reshape(*lead, -1).transpose(-1, -2))
            part = part * scale.reshape(*lead)[:, :, None, :]
            out = part if out is None else out + part
        return out

    def weighted_sum(self, p: torch.Tensor, f: Fields) -> torch.Tensor:
        if not self.rotated_values:
            return p @ self.decode(f)
        lead, flat = _flat(f)
        [(c, mult)] = self.codec.code_terms(self._codes(flat))
        acc = (p * mult.reshape(*lead)[:, :, None, :]) @ c.reshape(*lead, self.dim)
        # x_hat = Pi^T (m c[idx]) is linear: rotate the weighted sum back once per row.
        return self.codec.unrotate(acc.reshape(-1, self.dim)).reshape(acc.shape)


class BlockVQQuantizer(_LogNorms, KVQuantizer):
    """TurboQuant's rotation with a vector codebook instead of a scalar one (``"turbo-vq"``).

    Rows are rotated as TurboQuant rotates them (a seeded randomized Hadamard rotation), and
    each run of ``block`` consecutive rotated coordinates of the unit row is coded as the
    nearest of 2^(bits * block) points (``sphere_block_codebook``: Lloyd's algorithm for the
    law of those coordinates, fit-free like the scalar Lloyd-Max codebook); the per-row scale
    is the least-squares fit of the chosen points (as ``TurboQuant(scale="fit")``), float16 or
    a log byte. The same bits per coordinate as TurboQuant-mse, a lower error: the cells are no
    longer boxes. Expected squared error of a unit row at head_dim 64 (scalar in brackets):
    1 bit (blocks of 8) 0.326 (0.358), 2 bits (blocks of 4) 0.099 (0.115), 3 bits (pairs)
    0.031 (0.033), 4 bits (pairs) 0.0083 (0.0091). Encoding costs a nearest-point search
    (2^(bits * block) / block distance terms per coordinate: 64 at 2 bits); scoring and the
    value sum work on the rotated-domain points as TurboQuant's do.
    """

    def __init__(self, dim: int, bits: int, seed: int, norm_bits: int = 16):
        self.dim = V.positive_int(dim, "dim", minimum=2)
        self.bits = V.positive_int(bits, "bits", 1, 4)
        self.block = next(b for b in (8, 4, 2, 1) if b * self.bits <= 8 and self.dim % b == 0)
        cb = sphere_block_codebook(self.dim, self.bits, self.block)
        self.points = torch.from_numpy(cb.points)  # (K, block) float32, unit-row scale
        self.expected_mse = cb.mse
        self.nblocks = self.dim // self.block
        self.code_bits = self.bits * self.block
        self._rot = make_rotation("hadamard", self.dim, V.seed(seed))
        self.norm_bits = V.choice(norm_bits, "norm_bits", (8, 16))
        self.bytes_per_token = ops.row_bytes(self.nblocks, self.code_bits) + (
            1 if self.norm_bits == 8 else 2)

    def _points(self, device) -> torch.Tensor:
        if self.points.device != torch.device(device):
            self.points = self.points.to(device)
        return self.points

    def encode(self, x: torch.Tensor) -> Fields:
        n = x.shape[0]
        y = self._rot.apply(x.float().contiguous())
        nrm = torch.linalg.vector_norm(y, dim=1)
        u = y / torch.where(nrm > 0, nrm, torch.ones_like(nrm))[:, None]
        P = self._points(x.device)
        blocks = u.reshape(n * self.nblocks, self.block)
        idx = (-2.0 * blocks @ P.T + (P * P).sum(1)[None]).argmin(1).reshape(n, self.nblocks)
        c = P[idx].reshape(n, self.dim)
        fit = (y * c).sum(1) / (c * c).sum(1).clamp_min(1e-30)  # 0 for a zero row
        out = {"payload": ops.pack_bits(idx.to(torch.uint8), self.code_bits)}
        out["fit"] = (self._log8(fit) if self.norm_bits == 8
                      else store_norm(fit, torch.float16, "fit", "norm_bits"))
        return out

    def _terms(self, flat: Fields) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, d) chosen points in the rotated domain and (n,) float32 scales."""
        n = flat["payload"].shape[0]
        P = self._points(flat["payload"].device)
        idx = ops.unpack_bits(flat["payload"], self.nblocks, self.code_bits).long()
        fit = flat["fit"]
        fit = (self.unlog8(fit) if self.norm_bits == 8 else fit).float()
        return P[idx].reshape(n, self.dim), fit

    def decode(self, f: Fields) -> torch.Tensor:
        lead, flat = _flat(f)
        if not len(flat["payload"]):
            return torch.zeros((*lead, self.dim), dtype=torch.float32,
                               device=flat["payload"].device)
        c, fit = self._terms(flat)
        return self._rot.inverse((c * fit[:, None]).contiguous()).reshape(*lead, self.dim)

    def scores(self, q: torch.Tensor, f: Fields) -> torch.Tensor:
        lead, flat = _flat(f)
        B, H, M, d = q.shape
        qr = self._rot.apply(q.reshape(-1, d).float().contiguous()).reshape(B, H, M, d)
        c, fit = self._terms(flat)
        return (qr @ c.reshape(*lead, d).transpose(-1, -2)) * fit.reshape(*lead)[:, :, None, :]

    def weighted_sum(self, p: torch.Tensor, f: Fields) -> torch.Tensor:
        lead, flat = _flat(f)
        c, fit = self._terms(flat)
        acc = (p * fit.reshape(*lead)[:, :, None, :]) @ c.reshape(*lead, self.dim)
        # x_hat = Pi^T (m c) is linear: rotate the weighted sum back once per row
        return self._rot.inverse(acc.reshape(-1, self.dim).contiguous()).reshape(acc.shape)


class TokenQuantizer(KVQuantizer):
    """Per-token asymmetric min-max quantization in groups of ``group`` channels (the QJL
    paper's value quantizer; KIVI's value side; the "per-token b-bit g32" baseline).
    Stores b bits per element plus a float16 scale and minimum per group."""

    def __init__(self, dim: int, bits: int, group: int | None = None):
        self.dim = V.positive_int(dim, "dim")
        self.bits = V.positive_int(bits, "bits", 1, 8)
        self.group = V.positive_int(group, "group")
        if self.dim % self.group:
            raise ValueError(f"group must divide the head dimension {self.dim}, got {group}")
        self.ngroups = self.dim // self.group
        self.bytes_per_token = ops.row_bytes(self.dim, self.bits) + 4 * self.ngroups

    def encode(self, x: torch.Tensor) -> Fields:
        n = x.shape[0]
        g = x.reshape(n, self.ngroups, self.group)
        lo = g.amin(-1).to(torch.float16)
        hi = g.amax(-1).to(torch.float16)
        levels = (1 << self.bits) - 1
        scale = ((hi.float() - lo.float()) / levels).to(torch.float16)
        s = scale.float().clamp_min(torch.finfo(torch.float16).tiny)
        idx = torch.round((g - lo.float()[..., None]) / s[..., None]).clamp_(0, levels)
        payload = ops.pack_bits(idx.reshape(n, self.dim).to(torch.uint8), self.bits)
        return {"payload": payload, "scale": scale, "minimum": lo}

    def decode(self, f: Fields) -> torch.Tensor:
        lead, flat = _flat(f)
        n = flat["payload"].shape[0]
        idx = ops.unpack_bits(flat["payload"], self.dim, self.bits).float()
        x = (idx.reshape(n, self.ngroups, self.group) * flat["scale"].float()[..., None]
             + flat["minimum"].float()[..., None])
        return x.reshape(*lead, self.dim)


class ChannelSplit(KVQuantizer):
    """Mixed widths over a channel split: per head, ``count`` outlier channels go to one
    quantizer and the rest to another (QJL paper Section 4.1; TurboQuant's 2.5 / 3.5-bit
    settings). The channel sets are data (picked from the prefill by ``set_channels``); the
    quantizers stay fit-free. The index sets cost nothing per token (one small table per head).
    """

    def __init__(self, dim: int, count: int, outer: KVQuantizer, inner: KVQuantizer):
        self.dim = dim
        self.count = count
        self.outer, self.inner = outer, inner
        self.bytes_per_token = outer.bytes_per_token + inner.bytes_per_token
        self.channels: torch.Tensor | None = None  # (H, count) outlier channel ids, sorted
        self._order: torch.Tensor | None = None    # (H, d): outliers first, then the rest

    def set_channels(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Pick per head the ``count`` channels of largest mean square. x: (B, H, T, d);
        weights: (B, 1, T, 1) per-token weights of the mean (None: all 1)."""
        energy = _mean_bt(x.float() ** 2, weights)  # (H, d)
        top = torch.topk(energy, self.count, dim=-1).indices.sort(-1).values
        rest = torch.ones_like(energy, dtype=torch.bool).scatter_(-1, top, False)
        others = torch.arange(self.dim, device=x.device).expand_as(energy)[rest]
        self.channels = top
        self._order = torch.cat([top, others.reshape(energy.shape[0], -1)], dim=-1)

    def side_bytes(self) -> int:
        held = [t for t in (self.channels, self._order) if t is not None]
        return (sum(t.numel() * t.element_size() for t in held) + self.outer.side_bytes()
                + self.inner.side_bytes())

    def _permute(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, d) -> channels reordered per head (outliers first)."""
        idx = self._order.to(x.device)[None, :, None, :].expand(x.shape)
        return torch.gather(x, -1, idx)

    def encode_heads(self, x: torch.Tensor) -> Fields:
        """x (B, H, T, d) float32 -> fields (B, H, T, *) (this quantizer needs the head axis)."""
        if self._order is None:
            raise RuntimeError("ChannelSplit.set_channels must run before encoding")
        B, H, T, d = x.shape
        xp = self._permute(x)
        fo = self.outer.encode(xp[..., : self.count].reshape(-1, self.count))
        fi = self.inner.encode(xp[..., self.count:].reshape(-1, d - self.count))
        f = {f"o.{k}": v for k, v in fo.items()} | {f"i.{k}": v for k, v in fi.items()}
        f["payload"] = torch.empty((B * H * T, 0), dtype=torch.uint8, device=x.device)
        return {k: v.reshape(B, H, T, *v.shape[1:]) for k, v in f.items()}

    @staticmethod
    def _sub(f: Fields, tag: str) -> Fields:
        return {k[2:]: v for k, v in f.items() if k.startswith(tag)}

    def decode(self, f: Fields) -> torch.Tensor:
        xo = self.outer.decode(self._sub(f, "o."))
        xi = self.inner.decode(self._sub(f, "i."))
        xp = torch.cat([xo, xi], dim=-1)
        out = torch.empty_like(xp)
        idx = self._order.to(xp.device)[None, :, None, :].expand(xp.shape)
        return out.scatter_(-1, idx, xp)

    def scores(self, q: torch.Tensor, f: Fields) -> torch.Tensor:
        qp = self._permute(q)
        return (self.outer.scores(qp[..., : self.count].contiguous(), self._sub(f, "o."))
                + self.inner.scores(qp[..., self.count:].contiguous(), self._sub(f, "i.")))


class ChannelScale(KVQuantizer):
    """Per-head channel scaling in front of a key quantizer, calibrated once at prefill.

    Keys are coded as k / s and queries scored as q * s (so <q s, k / s> = <q, k> exactly).
    A rotation-based quantizer spreads its error evenly over the coded vector, so the score
    error has variance ~ D ||k / s||^2 ||q s||^2 / d; over per-channel mean squares K_i (keys)
    and Q_i (queries) that is minimal at s_i^2 = sqrt(K_i / Q_i) (Cauchy-Schwarz), a gain of
    (sum K)(sum Q) / (sum sqrt(K Q))^2 over s = 1. Without query statistics (values, and the
    decode-then-SDPA path) queries are taken as isotropic. The scale is a d-vector per head
    (counted in memory), the codec itself stays fit-free.

    ``rope_pairs=True`` (keys) respects rotary embeddings: RoPE turns each channel pair
    (i, i + d/2) by an angle that grows with the position, so what the prefill shows of one
    channel of a pair is not what later positions hold. Statistics measured at the prefill
    carry over only where they do not depend on the angle: the scale is tied within a pair
    (the pair's energy K_i + K_{i+d/2} is rotation invariant), and a pair's mean is subtracted
    only if it did not turn during the calibration tokens (the means of their two halves differ
    by less than ``stable`` of its energy, i.e. by less than ~0.3 rad): the slow, low-frequency
    pairs, whose large mean stays put over the whole context. A mid-frequency pair's mean
    measured over 256 prefill tokens has rotated away a few hundred tokens later, and
    subtracting it then adds energy instead of removing it. Over the 2,048 tokens after a
    256-token prefill (GPL-2 / sed FAQ) this cuts the expected squared score error of the
    per-channel calibration by 14 % / 21 % on SmolLM2-135M and 39 % / 40 % on Gemma 3 270M.
    """

    def __init__(self, inner: KVQuantizer, max_ratio: float = 16.0, rope_pairs: bool = False,
                 stable: float = 0.1):
        self.inner = inner
        self.dim = inner.dim
        self.bytes_per_token = inner.bytes_per_token
        self.max_ratio = max_ratio
        self.rope_pairs = rope_pairs and self.dim % 2 == 0
        self.stable = stable
        self.scale: torch.Tensor | None = None  # (H, d)

    def _tie(self, v: torch.Tensor) -> torch.Tensor:
        """Sum over each RoPE pair (i, i + d/2), repeated for both channels (identity if off)."""
        if not self.rope_pairs:
            return v
        h = self.dim // 2
        p = v[..., :h] + v[..., h:]
        return torch.cat([p, p], dim=-1)

    def calibrate(self, k: torch.Tensor, q_energy: torch.Tensor | None,
                  weights: torch.Tensor | None = None) -> None:
        """k: (B, H, T, d) keys; q_energy: (H, d) mean squared query per channel, or None;
        weights: (B, 1, T, 1) per-token weights of the statistics (a left-padded batch's pad
        tokens 0; None: all 1)."""
        x = k.float()
        w = weights
        mean = _mean_bt(x, w)  # (H, d)
        if self.rope_pairs:
            T = x.shape[2]
            if T >= 4:
                h = T // 2
                first = _mean_bt(x[:, :, :h], None if w is None else w[:, :, :h])
                second = _mean_bt(x[:, :, h:], None if w is None else w[:, :, h:])
                keep = self._tie((first - second) ** 2) < self.stable * self._tie(mean ** 2)
                mean = mean * keep
            else:  # too few tokens to tell a still pair from a turning one
                mean = torch.zeros_like(mean)
        self.mean = mean
        kk = self._tie(_mean_bt((x - mean[None, :, None, :]) ** 2, w)).clamp_min(1e-12)
        qq = (self._tie(q_energy.float()).clamp_min(1e-12) if q_energy is not None
              else torch.ones_like(kk))
        s = (kk / qq) ** 0.25
        s = s / torch.exp(torch.log(s).mean(-1, keepdim=True))  # geometric mean 1
        lim = math.sqrt(self.max_ratio)
        self.scale = s.clamp(1.0 / lim, lim)

    def side_bytes(self) -> int:
        own = 0 if self.scale is None else (self.mean.numel() * self.mean.element_size()
                                            + self.scale.numel() * self.scale.element_size())
        return own + self.inner.side_bytes()

    def stats(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, scale) of the channels, shaped to broadcast over (B, H, T, d) on ``device``."""
        return (self.mean.to(device)[None, :, None, :], self.scale.to(device)[None, :, None, :])

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """(x - mu) / s: what the inner quantizer codes."""
        mu, s = self.stats(x.device)
        return (x - mu) / s

    def encode_heads(self, x: torch.Tensor) -> Fields:
        return self.inner.encode_heads(self.transform(x))

    def decode(self, f: Fields) -> torch.Tensor:
        mu, s = self.stats(f["payload"].device)
        return self.inner.decode(f) * s + mu

    def step_side(self, device: torch.device) -> ops.KVSide | None:
        side = self.inner.step_side(device)
        if side is None or self.scale is None:
            return None
        return dataclasses.replace(side, mu=self.mean.to(device), sc=self.scale.to(device))

    def multiplier_field(self) -> str | None:
        return self.inner.multiplier_field()

    def scores(self, q: torch.Tensor, f: Fields) -> torch.Tensor:
        mu, s = self.stats(q.device)
        # <q, k> = <q, mu> + <q s, (k - mu) / s>: the first term is exact.
        return self.inner.scores(q * s, f) + (q * mu).sum(-1, keepdim=True)

    def weighted_sum(self, p: torch.Tensor, f: Fields) -> torch.Tensor:
        mu, s = self.stats(p.device)
        # sum_t p_t (s (x) y_t + mu) = s (x) sum_t p_t y_t + mu sum_t p_t
        return self.inner.weighted_sum(p, f) * s + p.sum(-1, keepdim=True) * mu


class Float16Quantizer(KVQuantizer):
    """No quantization: rows stored as float16 (token selection alone, e.g. BalanceKV)."""

    def __init__(self, dim: int):
        self.dim = dim
        self.bytes_per_token = 2 * dim

    def encode(self, x: torch.Tensor) -> Fields:
        if bool((x.abs() > 65504.0).any()):
            raise ValueError("keys/values must fit in float16 (|x| <= 65504) for codec 'fp16'")
        return {"payload": torch.empty((x.shape[0], 0), dtype=torch.uint8, device=x.device),
                "x": x.to(torch.float16)}

    def decode(self, f: Fields) -> torch.Tensor:
        return f["x"].float()


def make_quantizer(kind: str, dim: int, bits: float, *, seed: int, role: str,
                   outlier_channels: int = 0, outlier_bits: int | None = None,
                   group: int | None = None, norm_bits: int = 16) -> KVQuantizer:
    """Build the quantizer for ``role`` ('keys' or 'values') from a short spec.

    kind: ``"turbo"`` (TurboQuant mse), ``"turbo-vq"`` (its rotation with a vector codebook,
    ``BlockVQQuantizer``), ``"turbo-prod"`` (TurboQuant prod, keys only),
    ``"qjl"`` (keys only; ``bits`` sign bits per coordinate, m = bits * d), ``"token"``
    (per-token min-max, groups of ``group``), ``"fp16"`` (no quantization: for token selection
    alone; ``bits`` is ignored). ``outlier_channels`` > 0 splits off that many
    channels per head, coded with ``outlier_bits`` (default bits + 1) by the same kind.
    ``norm_bits``: 16 (float16 norms) or 8 (log-coded, see ``CodecQuantizer``).
    """
    if group is None:  # default: groups of 32 channels, or the largest divisor of d below
        group = math.gcd(32, dim)
    kind = V.choice(kind, f"{role[:-1]}_codec",
                    ("turbo", "turbo-vq", "turbo-prod", "qjl", "token", "fp16"))
    if kind == "fp16":
        return Float16Quantizer(dim)
    if role == "values" and kind in ("turbo-prod", "qjl"):
        raise ValueError(f"value_codec must be 'turbo', 'turbo-vq' or 'token' (values need a "
                         f"reconstruction, not an inner-product estimator), got {kind!r}")
    if outlier_channels:
        oc = V.positive_int(outlier_channels, "outlier_channels", 1, dim - 2)
        ob = outlier_bits if outlier_bits is not None else int(bits) + 1
        outer = make_quantizer(kind, oc, ob, seed=seed + 7919, role=role, group=oc,
                               norm_bits=norm_bits)
        inner = make_quantizer(kind, dim - oc, bits, seed=seed, role=role,
                               group=math.gcd(group, dim - oc), norm_bits=norm_bits)
        return ChannelSplit(dim, oc, outer, inner)
    if not float(bits).is_integer():
        raise ValueError(f"{role[:-1]}_bits must be an integer without a channel split, got {bits} "
                         f"(fractional widths come from outlier_channels + outlier_bits)")
    bits = int(bits)
    if kind == "turbo-vq":
        if bits > 4:
            raise ValueError(f"{role[:-1]}_bits must be 1..4 for 'turbo-vq', got {bits}")
        return BlockVQQuantizer(dim, bits, seed, norm_bits)
    if kind == "turbo":
        # the least-squares scale of the chosen centroids instead of the norm: same bytes,
        # never a larger error per token (the attention error it saves: docs/kv-benchmarks.md)
        return CodecQuantizer(TurboQuant(dim, bits, "mse", seed, norm_dtype="float16",
                                         scale="fit"), norm_bits)
    if kind == "turbo-prod":
        if bits < 2:
            raise ValueError(f"key_bits must be >= 2 for 'turbo-prod' (b-1 mse bits + 1 QJL "
                             f"bit; 1 bit would be pure QJL: use 'qjl'), got {bits}")
        return CodecQuantizer(TurboQuant(dim, bits, "prod", seed, norm_dtype="float16"),
                              norm_bits)
    if kind == "qjl":
        return CodecQuantizer(QJL(dim, bits * dim, seed, norm_dtype="float16"), norm_bits)
    return TokenQuantizer(dim, bits, group)
