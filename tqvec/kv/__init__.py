"""KV-cache adapter for HuggingFace transformers: keys and values stored as tqvec codes,
attention computed from the codes, optional BalanceKV token selection.

    import tqvec.kv
    cache = tqvec.kv.TurboQuantCache(model.config, key_bits=3, value_bits=3)
    out = model.generate(ids, cache=cache, max_new_tokens=256)
    cache.memory_bytes(), cache.bits_per_element()
    tqvec.kv.cache_memory_bytes(dynamic_cache)   # any transformers cache, to compare

Needs ``transformers >= 5`` (``pip install "tqvec[hf]"``).
"""

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("tqvec.kv needs transformers >= 5: pip install 'tqvec[hf]'") from e

from .attention import ATTENTION_NAME, attend, register
from .balance import BalanceConfig, MergeAndReduce, balance_signs, halve
from .cache import TurboQuantCache
from .layer import LAYER_OPTIONS, CompressedLayer, KVSettings
from .memory import cache_bits_per_element, cache_memory_bytes
from .plan import (
    LayerPlan,
    LayerSample,
    candidate_grid,
    capture_attention_inputs,
    layer_error,
    layer_sensitivity,
    plan_layers,
)
from .quant import ChannelSplit, CodecQuantizer, TokenQuantizer, make_quantizer

__all__ = ["TurboQuantCache", "BalanceConfig", "MergeAndReduce", "balance_signs", "halve",
           "CompressedLayer", "KVSettings", "ChannelSplit", "CodecQuantizer", "TokenQuantizer",
           "make_quantizer", "attend", "register", "ATTENTION_NAME", "LAYER_OPTIONS", "LayerPlan",
           "LayerSample", "capture_attention_inputs", "layer_error", "layer_sensitivity",
           "plan_layers", "candidate_grid", "cache_memory_bytes", "cache_bits_per_element"]
