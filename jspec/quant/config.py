"""What a quantized target is asked for: the mode, as the API and the CLI spell it, and what
it covers. Checked before any weight is read, so a typo costs nothing."""

from __future__ import annotations

import dataclasses

# int8: int8 weights, float activations (the weight is dequantized into the product).
# w8a8: int8 weights and int8 activations with one dynamic scale per token (integer
#       accumulation; per-token scales keep every row's result independent of the others).
# fp8:  float8 e4m3 weights (native products on H100/H200; storage-only on TPUs before v7).
# bf16: bfloat16 weights, activations in the model's dtype (float32): half fp32's bytes, read
#       as stored by the few-row CPU kernel (jspec.quant.product). Unlike load_target(dtype=
#       "bfloat16"), nothing else runs in bf16 (XLA:CPU converts bf16 ops one by one).
MODES = ("int8", "w8a8", "fp8", "bf16")


class QuantizeError(ValueError):
    """A quantization request that cannot be honoured (unknown mode, bad tile...)."""


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """``mode``: one of :data:`MODES`. ``tile``: inputs per weight scale (``None``: one
    scale per output channel). ``lm_head``: quantize the LM head too (by default the
    embedding, the LM head and the norms stay in float: the head decides every token, and
    its error is the one acceptance and logprobs see first)."""
    mode: str
    tile: int | None = None
    lm_head: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise QuantizeError(f"quantize={self.mode!r}: expected one of {', '.join(MODES)}")
        if self.tile is not None and (not isinstance(self.tile, int) or self.tile < 1):
            raise QuantizeError(f"quantize tile={self.tile!r}: expected a positive integer")
        if self.mode == "bf16" and self.tile is not None:
            raise QuantizeError("quantize='bf16' has no scales to tile (tile must be None)")

    @property
    def activations(self) -> bool:
        return self.mode == "w8a8"


def as_quant_config(q) -> QuantConfig | None:
    """``None``, a mode name (``"int8"``, ``"w8a8"``, ``"fp8"``) or a :class:`QuantConfig`."""
    if q is None or isinstance(q, QuantConfig):
        return q
    if isinstance(q, str):
        return QuantConfig(q.strip().lower())
    raise QuantizeError(f"quantize={q!r}: expected a mode name ({', '.join(MODES)}) "
                        "or a QuantConfig")


def check_tile(qc: QuantConfig, in_features: int, what: str) -> None:
    if qc.tile is not None and in_features % qc.tile:
        raise QuantizeError(f"quantize tile={qc.tile}: {what} has {in_features} inputs, "
                            "not a multiple of the tile")
