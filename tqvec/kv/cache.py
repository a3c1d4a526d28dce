"""``TurboQuantCache``: a transformers ``Cache`` whose layers hold tqvec codes."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from transformers.cache_utils import Cache, get_layer_types_and_kwargs

from .. import _validate as V
from . import attention as _attention
from .balance import BalanceConfig
from .layer import LAYER_OPTIONS, CompressedLayer, KVSettings
from .quant import make_quantizer

__all__ = ["TurboQuantCache"]

_SUPPORTED_LAYERS = ("full_attention", "sliding_attention")


_WINDOWED_LAYERS = ("sliding_attention", "chunked_attention", "hybrid_sliding")


def _layer_kwargs(layer_types: list[str], kwargs: list[dict] | dict
                  ) -> tuple[list[str], list[dict]]:
    """transformers' per-layer cache kwargs: a list in newer releases; one dict for every layer
    in older 5.x ones (<= 5.17), whose ``sliding_window`` belongs to the windowed layers only."""
    if isinstance(kwargs, dict):
        kwargs = [kwargs if kind in _WINDOWED_LAYERS else
                  {k: v for k, v in kwargs.items() if k != "sliding_window"}
                  for kind in layer_types]
    return layer_types, kwargs


class TurboQuantCache(Cache):
    """Compressed KV cache: pass it as ``cache`` to ``generate`` or ``forward``.

    Parameters
    ----------
    config: the model's config (``model.config``).
    key_codec: ``"turbo"`` (TurboQuant mse, default; each token's scale is the least-squares
        fit of its centroids, ``TurboQuant(scale="fit")``, the same bytes as the norm and a
        lower attention error), ``"turbo-vq"`` (TurboQuant's rotation with a vector codebook
        over runs of 2-8 coordinates, ``BlockVQQuantizer``: the same bytes, 9-14 % less squared
        error), ``"turbo-prod"`` (TurboQuant prod:
        unbiased scores), ``"qjl"`` (QJL sign sketch, ``key_bits`` sign bits per coordinate) or
        ``"token"`` (per-token min-max in groups of ``group``).
    key_bits, value_bits: bits per coordinate of the codes (norms and scales come on top and are
        counted by ``bits_per_element``).
    value_codec: ``"turbo"`` (TurboQuant mse, default), ``"turbo-vq"`` or ``"token"`` (the QJL
        paper's per-token value quantizer).
    residual_length: most recent tokens kept in full precision (the model's dtype).
    residual_bits: ``None`` (default) holds that window in the model's dtype; ``8`` holds it
        as 8-bit TurboQuant codes (float16 scale; relative error ~0.6 % per vector, 8.25
        bits/element at head_dim 64 against 16), decoded for each attention. Tokens then move
        in blocks: the newest (< 16) stay exact until they fill a block of 16, and the window
        holds residual_length to residual_length + 63 tokens, moved on to the codes 64 at a
        time (16 on sliding-window layers, where a longer window would cost a large share of
        the bytes; a codec call per block instead of per token). A forward's own tokens still
        attend to each other exactly; a token leaving the window is coded from its 8-bit code
        (the 8-bit error, a relative mean square of ~4e-5, adds to the final code's, ~3e-2 at
        3 bits).
    sink_length: first tokens kept in full precision (full-attention layers; default 4: the
        attention sinks of deep layers, ~0.03 bits/element at 2k tokens).
    outlier_channels, outlier_bits: split that many key channels per head (picked at prefill by
        mean square; the low-frequency RoPE pairs) and code them with ``outlier_bits`` (default
        key_bits + 1); e.g. 64-d keys, 16 channels at 4 bits + 48 at 3 bits = 3.25 bits.
    value_outlier_channels: the same split for values (same widths as the keys' split).
    calibrate: at the first flush (after prefill) fix per head a mean key and a per-channel
        scale from the prefill's keys and queries (and a mean/scale for values): keys are coded
        centred and scaled, queries scaled back, <q, mean> added exactly. Costs two d-vectors
        per head; cuts SmolLM2's attention error at 3-bit keys from 0.29 to 0.22. For keys the
        statistics respect RoPE (``ChannelScale(rope_pairs=True)``): scales tied within each
        rotary pair, means kept only for the pairs that do not turn.
    norm_bits: 16 (default) stores each token's norm as float16; 8 stores it as a log2 code in
        1/16-octave steps (<= 2.2 % relative error, added mean square ~1.6e-4 to the codes'
        relative MSE): 0.125 bit/element less at head_dim 64, 0.03 at 256.
    balance: a ``BalanceConfig`` to keep 1 / 2^rounds of the middle tokens (BalanceKV) before
        quantizing them; ``None`` (default) keeps every token.
    seed: fixes every rotation / sketch (per layer, keys and values independent).
    attention: ``"codes"`` (default) computes attention from the codes: it switches
        ``config`` to the ``"tqvec"`` attention implementation, which is SDPA for any other
        cache. ``"decode"`` keeps the model's attention and hands it decoded keys/values
        (the reference path; slower, same numbers up to rounding).
    layer_overrides: per-layer settings, ``{layer index or layer type: {option: value}}``; the
        options are this constructor's per-layer arguments (key_codec, key_bits, value_codec,
        value_bits, residual_length, residual_bits, sink_length, outlier_channels,
        outlier_bits, value_outlier_channels, group, calibrate, balance, norm_bits) and replace
        its values for those layers; a layer type is ``"full_attention"`` or
        ``"sliding_attention"``, and an index's entry applies on top of its type's. E.g.
        Gemma 3: ``{"sliding_attention": {"residual_length": 16}}`` spends fewer bits on the
        window of the 512-token sliding layers. A key matching no layer is an error.
    """

    def __init__(self, config: Any, *, key_codec: str = "turbo", key_bits: float = 3,
                 value_codec: str = "turbo", value_bits: float = 3, residual_length: int = 32,
                 sink_length: int = 4, outlier_channels: int = 0, outlier_bits: int | None = None,
                 value_outlier_channels: int = 0, group: int | None = None,
                 calibrate: bool = True, balance: BalanceConfig | None = None, seed: int = 0,
                 attention: str = "codes", norm_bits: int = 16,
                 residual_bits: int | None = None,
                 layer_overrides: Mapping[int | str, Mapping[str, Any]] | None = None):
        if not hasattr(config, "get_text_config"):
            raise TypeError(f"config must be a transformers PretrainedConfig, got "
                            f"{type(config).__name__}")
        self.attention = V.choice(attention, "attention", ("codes", "decode"))
        text = config.get_text_config(decoder=True)
        self.config = config
        head_dim = config_head_dim(config)
        base = dict(key_codec=key_codec, key_bits=key_bits, value_codec=value_codec,
                    value_bits=value_bits, residual_length=residual_length,
                    sink_length=sink_length, outlier_channels=outlier_channels,
                    outlier_bits=outlier_bits, value_outlier_channels=value_outlier_channels,
                    group=group, calibrate=calibrate, balance=balance, norm_bits=norm_bits,
                    residual_bits=residual_bits)
        seed = V.seed(seed)
        self.settings = layer_settings(base, seed, head_dim, self.attention, "")
        layer_types, layer_kwargs = _layer_kwargs(*get_layer_types_and_kwargs(text))
        for i, kind in enumerate(layer_types):
            if kind not in _SUPPORTED_LAYERS:
                raise ValueError(f"layer {i} has type {kind!r}; the compressed cache supports "
                                 f"{_SUPPORTED_LAYERS}")
        overrides = _check_overrides(layer_overrides, layer_types)
        layers = []
        for i, (kind, kw) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
            mine = {**overrides.get(kind, {}), **overrides.get(i, {})}
            settings = (layer_settings({**base, **mine}, seed, head_dim, self.attention,
                                  f"layer_overrides (layer {i}, {kind}): ")
                        if mine else self.settings)
            layers.append(CompressedLayer(settings, i, kw.get("sliding_window"),
                                          self._codes_attention))
        self.layer_overrides = overrides
        super().__init__(layers=layers)
        self._warned_decode = False
        if self.attention == "codes":
            _attention.register()
            config._attn_implementation = _attention.ATTENTION_NAME

    def _codes_attention(self) -> bool:
        if self.attention != "codes":
            return False
        impl = self.config._attn_implementation
        if impl != _attention.ATTENTION_NAME and not self._warned_decode:
            # correct either way, but decoding every code each step is several times slower
            self._warned_decode = True
            warnings.warn(f"TurboQuantCache(attention='codes') set the model's attention to "
                          f"{_attention.ATTENTION_NAME!r}, and something has set it to {impl!r} "
                          f"since: the cache now decodes its codes at every step (same results, "
                          f"several times slower); set model.config._attn_implementation = "
                          f"{_attention.ATTENTION_NAME!r} again (harmless for other caches)",
                          UserWarning, stacklevel=2)
        return impl == _attention.ATTENTION_NAME

    # -- accounting ----------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes held now: codes, norms/scales, positions, full-precision sink/window/pending
        (the tokens stored; the code buffers' spare capacity, at most a sixteenth of them or 64
        slots, is not counted)."""
        return sum(layer.nbytes() for layer in self.layers)

    def represented_elements(self) -> int:
        """Key + value elements the cache stands for (what a DynamicCache would hold)."""
        return sum(2 * layer.batch * layer.num_heads * layer.head_dim
                   * layer.represented_tokens() for layer in self.layers if layer.is_initialized)

    def bits_per_element(self) -> float:
        """8 * memory_bytes / represented_elements: side information included."""
        n = self.represented_elements()
        if not n:
            raise ValueError("the cache is empty: bits_per_element is undefined")
        return 8.0 * self.memory_bytes() / n

    def __repr__(self) -> str:
        s = self.settings
        return (f"TurboQuantCache(keys={s.key_codec}:{s.key_bits}, values={s.value_codec}:"
                f"{s.value_bits}, residual_length={s.residual_length}, layers={len(self.layers)}"
                + (f", layer_overrides={self.layer_overrides}" if self.layer_overrides else "")
                + ")")


def config_head_dim(config: Any) -> int:
    """The attention head size of a transformers config (its text part for multimodal ones)."""
    text = config.get_text_config(decoder=True)
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def layer_settings(kw: dict, seed: int, head_dim: int, attention: str, where: str) -> KVSettings:
    """Validate one layer's options and build its quantizers once now, so that a bad
    codec/bits/group fails at construction, not in the middle of a forward."""
    balance = kw["balance"]
    if balance is not None and not isinstance(balance, BalanceConfig):
        raise TypeError(f"{where}balance must be a tqvec.kv.BalanceConfig or None, got "
                        f"{type(balance).__name__}")
    if balance is not None and attention != "codes":
        raise ValueError(f"{where}balance needs attention='codes' (its token weights cannot be "
                         "expressed to SDPA)")
    for name in ("residual_length", "sink_length", "outlier_channels", "value_outlier_channels"):
        V.positive_int(kw[name], where + name, 0)
    for name in ("key_bits", "value_bits"):
        b = kw[name]
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 1 <= b <= 8:
            raise ValueError(f"{where}{name} must be a number in 1..8, got {b!r}")
    s = KVSettings(**{**kw, "calibrate": bool(kw["calibrate"]), "seed": seed,
                      "norm_bits": V.choice(kw["norm_bits"], where + "norm_bits", (8, 16)),
                      "residual_bits": V.choice(kw["residual_bits"], where + "residual_bits",
                                                (None, 8))})
    try:
        make_quantizer(s.key_codec, head_dim, s.key_bits, seed=0, role="keys",
                       outlier_channels=s.outlier_channels, outlier_bits=s.outlier_bits,
                       group=s.group, norm_bits=s.norm_bits)
        make_quantizer(s.value_codec, head_dim, s.value_bits, seed=0, role="values",
                       outlier_channels=s.value_outlier_channels, group=s.group,
                       norm_bits=s.norm_bits)
    except (TypeError, ValueError) as e:
        if not where:
            raise
        raise type(e)(f"{where}{e}") from None
    return s


def _check_overrides(overrides: Any, layer_types: list[str]) -> dict[int | str, dict]:
    """``layer_overrides`` -> {layer index or layer type: options}, every key and option
    checked against the model (a key that matches no layer is an error, not a no-op)."""
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise TypeError(f"layer_overrides must be a mapping {{layer index or layer type: "
                        f"{{option: value}}}}, got {type(overrides).__name__}")
    out: dict[int | str, dict] = {}
    for key, opts in overrides.items():
        if isinstance(key, str):
            if key not in layer_types:
                raise ValueError(f"layer_overrides: the model has no {key!r} layers (its layer "
                                 f"types: {sorted(set(layer_types))})")
        elif isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < len(layer_types):
                raise ValueError(f"layer_overrides: layer index {key} is outside "
                                 f"0..{len(layer_types) - 1}")
        else:
            raise TypeError(f"layer_overrides keys must be layer indices (int) or layer types "
                            f"(str), got {type(key).__name__} {key!r}")
        if not isinstance(opts, Mapping):
            raise TypeError(f"layer_overrides[{key!r}] must be a mapping of options, got "
                            f"{type(opts).__name__}")
        unknown = sorted(set(opts) - set(LAYER_OPTIONS))
        if unknown:
            raise TypeError(f"layer_overrides[{key!r}]: unknown option(s) {unknown}; allowed: "
                            f"{list(LAYER_OPTIONS)}")
        out[key] = dict(opts)
    return out
