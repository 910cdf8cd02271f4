"""Quantized targets (qwix): int8 weight-only, W8A8 and fp8 linear layers.

Quantization lives inside the one product every weight goes through
(:func:`jspec.serving_layout.linear` hands a :class:`QWeight` to
:func:`~jspec.quant.qweight.quantized_linear`); decoding, speculation, the engine and the
server run a quantized target as they run a float one. A loaded target is quantized by
:func:`jspec.checkpoint.quantize.quantize_target` (``load_target(..., quantize=MODE)``).
See docs/quantization.md.
"""

from __future__ import annotations

from jspec.quant.config import MODES, QuantConfig, QuantizeError, as_quant_config
from jspec.quant.pack import (is_quantized, mode_of, quantize_packed, quantize_weight,
                              quantizes_activations)
from jspec.quant.qweight import QWeight, is_qweight, quantized_linear

__all__ = ["MODES", "QuantConfig", "QuantizeError", "QWeight", "as_quant_config", "is_quantized",
           "is_qweight", "mode_of", "quantize_packed", "quantize_weight", "quantized_linear",
           "quantizes_activations"]
