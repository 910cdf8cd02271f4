"""The target model as a value: configuration, parameters and (optional) tokenizer."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding

from jspec.config import LlamaConfig
from jspec.llama import Llama, abstract_params
from jspec.serving_layout import pack_for_serving
from jspec.sharding import logical_spec


class Tokenizer(Protocol):
    bos_id: int | None
    eos_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str, bos: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """A loaded Llama target. ``params`` is the Flax parameter tree (unboxed arrays) in
    the checkpoints' layout; :attr:`serving_params` is the packed layout the decoders run."""

    config: LlamaConfig
    params: Any
    tokenizer: Tokenizer | None = None

    @functools.cached_property
    def serving_params(self):
        """The parameters packed for serving (:func:`jspec.serving_layout.pack_params`), computed once
        on first use and placed like ``params`` (same mesh). This is a second copy of the
        weights: a caller short of memory can drop ``params`` after packing, e.g.
        ``Target(cfg, target.serving_params, tok)`` (the decoders accept either layout)."""
        return pack_for_serving(self.config, self.params)

    @property
    def module(self) -> Llama:
        return Llama(self.config)


def param_shardings(cfg: LlamaConfig, mesh: Mesh):
    """A NamedSharding for every parameter, from its logical axis names
    (:func:`jspec.sharding.logical_spec`)."""
    boxed = abstract_params(cfg)
    return jax.tree_util.tree_map(
        lambda b: NamedSharding(mesh, logical_spec(b.names, b.value.shape, mesh)), boxed,
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def shard_target(target: Target, mesh: Mesh) -> Target:
    """The same target with parameters placed on ``mesh``."""
    params = jax.device_put(target.params, param_shardings(target.config, mesh))
    return dataclasses.replace(target, params=params)
