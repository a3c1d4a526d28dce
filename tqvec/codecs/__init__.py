"""Fit-free codecs: QJL, PolarQuant, TurboQuant (mse / prod), TurboQuant at mixed widths."""

from .base import BLOCK_ROWS, Codec, Codes, codec_from_params, concat_codes
from .mixed import MixedTurboQuant
from .polar import PolarQuant
from .qjl import QJL, top_channels
from .turbo import TurboQuant

__all__ = ["Codec", "Codes", "TurboQuant", "QJL", "PolarQuant", "MixedTurboQuant",
           "codec_from_params", "concat_codes", "top_channels", "BLOCK_ROWS"]
