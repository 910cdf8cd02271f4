"""Model configuration: a frozen, hashable description of a Llama-3 target.

It is hashable so it can be a static argument of jitted functions, and it is
built from a Hugging Face ``config.json`` dict with every field checked, so a
bad checkpoint fails here, before anything compiles, with the field named.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


class ConfigError(ValueError):
    """A model configuration field is missing, malformed or unsupported."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE frequencies. ``rope_type`` is ``"default"`` or ``"llama3"``."""

    theta: float = 10000.0
    rope_type: str = "default"
    # llama3 scaling (ignored for "default").
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("default", "llama3"):
            raise ConfigError(
                f"rope_scaling.rope_type={self.rope_type!r} is not supported; "
                "jspec implements 'default' and 'llama3'")
        if self.theta <= 0:
            raise ConfigError(f"rope_theta must be positive, got {self.theta}")
        if self.rope_type == "llama3" and not (
                self.factor > 0 and self.high_freq_factor > self.low_freq_factor > 0
                and self.original_max_position_embeddings > 0):
            raise ConfigError(f"invalid llama3 rope_scaling parameters: {self}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # parameter / activation dtype; softmax and accumulation are fp32.

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"config field {name!r} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype={self.dtype!r} is not supported (float32, bfloat16, float16)")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **kw) -> "LlamaConfig":
        return dataclasses.replace(self, **kw)

    # ---------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf(cls, d: dict[str, Any], dtype: str | None = None) -> "LlamaConfig":
        """Build from a transformers ``LlamaConfig`` dict (v4 or v5 spelling)."""
        def need(key):
            if key not in d:
                raise ConfigError(f"config.json is missing required field {key!r}")
            return d[key]

        mt = d.get("model_type", "llama")
        if mt not in ("llama",):
            raise ConfigError(f"config field 'model_type'={mt!r}: only 'llama' targets are supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config field 'hidden_act'={d['hidden_act']!r}: only 'silu' is supported")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ConfigError(f"config field {flag!r}=True is not supported")
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = d.get("head_dim") or hidden // heads
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        if dtype is None:
            dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
            if dtype not in ("float32", "bfloat16", "float16"):
                dtype = "float32"
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope=rope_from_hf(d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
            dtype=dtype,
        )

    def to_hf(self) -> dict[str, Any]:
        rope_scaling = None
        if self.rope.rope_type == "llama3":
            rope_scaling = {
                "rope_type": "llama3", "factor": self.rope.factor,
                "low_freq_factor": self.rope.low_freq_factor,
                "high_freq_factor": self.rope.high_freq_factor,
                "original_max_position_embeddings": self.rope.original_max_position_embeddings,
            }
        eos = list(self.eos_token_ids)
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope.theta,
            "rope_scaling": rope_scaling, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "torch_dtype": self.dtype,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_hf(), indent=1)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike, dtype: str | None = None) -> "LlamaConfig":
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return cls.from_hf(d, dtype=dtype)


def rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings from either spelling.

    transformers <= 4: ``rope_theta`` + ``rope_scaling`` (may be null; key ``type`` or
    ``rope_type``). transformers >= 5: ``rope_parameters`` holding theta and scaling together.
    When both are present, ``rope_parameters`` wins (it is what transformers 5 reads).
    """
    params = d.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"config field 'rope_parameters' must be an object, got {params!r}")
    scaling = params if params is not None else (d.get("rope_scaling") or {})
    if not isinstance(scaling, dict):
        raise ConfigError(f"config field 'rope_scaling' must be an object or null, got {scaling!r}")
    theta = (params or {}).get("rope_theta", d.get("rope_theta", 10000.0))
    rtype = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rtype not in ("default", "llama3"):
        field = "rope_parameters" if params is not None else "rope_scaling"
        raise ConfigError(
            f"config field '{field}.rope_type'={rtype!r} is not supported; "
            "jspec implements 'default' and 'llama3'")
    kw = {}
    if rtype == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings"):
            if k not in scaling:
                raise ConfigError(f"llama3 rope scaling is missing field {k!r}")
            kw[k] = scaling[k]
    return RopeConfig(theta=float(theta), rope_type=rtype, **kw)
