"""tqvec: data-oblivious vector quantization (QJL, PolarQuant, TurboQuant).

>>> import numpy as np, tqvec
>>> x = np.random.default_rng(0).standard_normal((1000, 128)).astype(np.float32)
>>> codec = tqvec.TurboQuant(128, bits=4, seed=0)
>>> codes = codec.encode(x)
>>> x_hat = codec.decode(codes, like=x)
"""

from ._version import __version__
from .codecs import (
    QJL,
    Codec,
    Codes,
    MixedTurboQuant,
    PolarQuant,
    TurboQuant,
    codec_from_params,
    concat_codes,
    top_channels,
)
from .codecs.arrow import codes_from_arrow, codes_to_arrow
from .codecs.storage import load_codes, save_codes
from .errors import BackendUnavailable, FormatError
from .index import (
    FlatIndex,
    GraphIndex,
    IVFIndex,
    PCAIndex,
    index_factory,
    read_index,
    write_index,
)
from .ops import available_backends

__all__ = [
    "__version__",
    "Codec",
    "Codes",
    "TurboQuant",
    "QJL",
    "PolarQuant",
    "MixedTurboQuant",
    "codec_from_params",
    "concat_codes",
    "top_channels",
    "save_codes",
    "load_codes",
    "codes_to_arrow",
    "codes_from_arrow",
    "FormatError",
    "BackendUnavailable",
    "available_backends",
    "FlatIndex",
    "GraphIndex",
    "IVFIndex",
    "PCAIndex",
    "index_factory",
    "read_index",
    "write_index",
]
