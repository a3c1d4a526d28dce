"""Memory of any transformers cache, to compare a ``TurboQuantCache`` with the uncompressed
caches (``DynamicCache``, ``StaticCache``, ``QuantizedCache``) on the same prompt."""

from __future__ import annotations

from typing import Any

import torch

from .cache import config_head_dim

__all__ = ["cache_memory_bytes", "cache_bits_per_element"]


def _tensors(x: Any, seen: set[int], depth: int = 0) -> int:
    """Bytes of the tensors in x (a tensor, or lists / tuples / dicts / objects holding them),
    each storage counted once."""
    if isinstance(x, torch.Tensor):
        if not x.numel():
            return 0
        key = x.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return x.untyped_storage().nbytes()
    if depth > 3:
        return 0
    if isinstance(x, (list, tuple)):
        return sum(_tensors(y, seen, depth + 1) for y in x)
    if isinstance(x, dict):
        return sum(_tensors(y, seen, depth + 1) for y in x.values())
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return sum(_tensors(y, seen, depth + 1) for y in vars(x).values())
    return 0


def cache_memory_bytes(cache: Any) -> int:
    """Bytes a cache holds now: ``TurboQuantCache.memory_bytes()`` (codes, scales, the exact
    window and sinks), or for another transformers cache every tensor its layers hold (keys,
    values, a quantized cache's codes and scales; a static cache's whole preallocated
    buffers), each storage once."""
    memory = getattr(cache, "memory_bytes", None)
    if callable(memory):
        return int(memory())
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"cache must be a transformers Cache (with .layers), got "
                        f"{type(cache).__name__}")
    seen: set[int] = set()
    return sum(_tensors(layer, seen) for layer in layers)


def cache_bits_per_element(cache: Any, config: Any, tokens: int, batch: int = 1) -> float:
    """8 cache_memory_bytes / (the key and value elements of ``tokens`` tokens over every
    layer of the model ``config`` describes, times ``batch``): 16 for a bfloat16 or float16
    ``DynamicCache``, 32 for float32; what ``TurboQuantCache.bits_per_element`` reports for
    it. The window and sink tokens count, so the figure falls with the context length."""
    text = config.get_text_config(decoder=True)
    head_dim = config_head_dim(config)
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    elements = 2 * text.num_hidden_layers * kv_heads * head_dim * tokens * batch
    if elements <= 0:
        raise ValueError(f"tokens and batch must be positive, got {tokens}, {batch}")
    return 8.0 * cache_memory_bytes(cache) / elements
