"""What a drafter kind's published Hugging Face layout is made of, and the helpers its
reader shares with the other kinds' (config fields, the tensor directory).

A kind describes its layout with an :class:`HFLayout` in its own file (see
:mod:`jspec.drafters.registry`); :mod:`jspec.drafters.hf_io` does the reading, checking
and writing for every kind alike.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jspec.checkpoint.common import CheckpointError, read_json
from jspec.checkpoint.hf import SafetensorsDir
from jspec.config import ConfigError, LlamaConfig, rope_from_hf

Row = tuple[str, tuple[str, ...], bool]   # (HF name, param path, transpose [out,in] -> [in,out])


@dataclasses.dataclass(frozen=True)
class HFLayout:
    """A kind's HF layouts (e.g. Medusa's ``fasterdecoding`` and ``vllm``).

    - ``detect_keys(keys) -> bool``: these tensor names are this kind's;
    - ``detect_config(cfg) -> bool``: else, the ``config.json`` says so;
    - ``read(cfg, tensors, target, dtype, **options) -> (module, extra params, layout)``:
      the architecture from the config and the tensor headers, plus the index maps;
    - ``table(module, layout, num_target_layers) -> [Row]``: every tensor of the tree
      ``module.init_params`` builds, except ``optional`` ones;
    - ``write_config(module, layout, num_target_layers) -> dict``: ``config.json``
      (raises ``ValueError`` for a drafter the layout cannot hold);
    - ``write_layout(module, layout) -> layout``: the default (and checked) layout to write;
    - ``layouts``: the names of its layouts, where it has several (``write_layout`` picks);
    - ``priority``: detection order (lower first), for layouts whose keys overlap.
    """
    detect_keys: Callable[[set], bool]
    detect_config: Callable[[dict], bool]
    read: Callable[..., tuple[Any, dict, str | None]]
    table: Callable[..., list]
    write_config: Callable[..., dict]
    write_layout: Callable[[Any, str | None], str | None] = lambda module, layout: layout
    layouts: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    optional: frozenset = frozenset()
    priority: int = 50


# Rows every Llama-style decoder layer has, relative to the layer's prefix.
ATTN = tuple((f"self_attn.{p}_proj.weight", f"self_attn/{p}_proj/kernel", True) for p in "qkvo")
MLP = tuple((f"mlp.{p}_proj.weight", f"mlp/{p}_proj/kernel", True) for p in ("gate", "up", "down"))
POST_NORM = (("post_attention_layernorm.weight", "post_attention_layernorm/scale", False),)


def rows(table, name_prefix: str = "", path_prefix: str = "net") -> list[Row]:
    """``(name, "a/b/c", t)`` -> ``(prefix + name, (path_prefix, "a", "b", "c"), t)``."""
    return [(name_prefix + n, tuple(f"{path_prefix}/{p}".split("/")), t) for n, p, t in table]


class Tensors(SafetensorsDir):
    """:class:`SafetensorsDir` seen through a name prefix (e.g. ``"model."`` when a
    drafter's tensors were saved under a wrapper module)."""

    def __init__(self, d: Path):
        super().__init__(d, any_single_file=True)
        self.prefix = ""

    def keys(self) -> list[str]:
        n = len(self.prefix)
        return [k[n:] for k in self._where if k.startswith(self.prefix)]

    def __contains__(self, name) -> bool:
        return self.prefix + name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return super().shape(self.prefix + name)

    def get(self, name: str) -> np.ndarray:
        return self[self.prefix + name]

    def sharded(self, name: str, sharding, dtype, transpose: bool = False):
        return super().sharded(self.prefix + name, sharding, dtype, transpose)

    def shape_or(self, name: str, axis: int, default):
        return self.shape(name)[axis] if name in self else default


# ------------------------------------------------------------- config fields
def read_config(d: Path, alt: str) -> dict:
    f = d / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{d}: no config.json (nor {alt})")
    cfg = read_json(f)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f}: not a JSON object")
    return cfg


def int_field(d: dict, *names, default=None):
    for n in names:
        v = d.get(n)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"drafter config field {n!r} must be an int, got {v!r}")
            return v
    return default


def draft_layer_config(target: LlamaConfig, **overrides) -> LlamaConfig:
    """A one-layer decoder config shaped like the target's layers (the usual drafter)."""
    return target.replace(**{"num_layers": 1, **overrides})


def layer_config(d: dict, target: LlamaConfig, dtype: str, hidden: int | None = None
                 ) -> LlamaConfig:
    """The drafter's one-layer decoder config: its config.json's fields, else the target's."""
    ov: dict[str, Any] = {"dtype": dtype}
    hidden = int_field(d, "hidden_size", default=hidden)
    if hidden is not None:
        ov["hidden_size"] = hidden
    for field, key in (("intermediate_size", "intermediate_size"),
                       ("num_heads", "num_attention_heads"),
                       ("num_kv_heads", "num_key_value_heads"), ("head_dim", "head_dim")):
        v = int_field(d, key)
        if v is not None:
            ov[field] = v
    if "head_dim" not in ov and "num_heads" in ov:
        ov["head_dim"] = ov.get("hidden_size", target.hidden_size) // ov["num_heads"]
    if "num_heads" in ov and "num_kv_heads" not in ov:
        ov["num_kv_heads"] = ov["num_heads"]
    if d.get("rms_norm_eps") is not None:
        ov["rms_norm_eps"] = float(d["rms_norm_eps"])
    if any(d.get(k) is not None for k in ("rope_theta", "rope_scaling", "rope_parameters")):
        ov["rope"] = rope_from_hf(d)
    return draft_layer_config(target, **ov)


def layer_fields(layer: LlamaConfig) -> dict:
    """A decoder layer's fields for a written ``config.json``."""
    d = layer.to_hf()
    return {k: d[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                              "rope_scaling", "torch_dtype")}


def dtype_name(dtype, target: LlamaConfig) -> str:
    if dtype is None:
        return target.dtype
    try:
        return np.dtype(jax.numpy.dtype(dtype)).name
    except TypeError as e:
        raise ConfigError(f"dtype={dtype!r} is not a dtype") from e


def no_draft_vocab(module, kind: str) -> None:
    """Refuse to write a draft-vocabulary head into a layout that has none."""
    if module.vocab_size:
        raise ValueError(f"a draft-vocabulary {kind} drafter (vocab_size={module.vocab_size}) has "
                         "no published layout: save it with save_drafter (jspec's Orbax format)")
