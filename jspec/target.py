"""The target model as a value: configuration, parameters and (optional) tokenizer."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, Sequence

from jspec.config import LlamaConfig
from jspec.llama import Llama


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
        from jspec.sharding import pack_for_serving
        return pack_for_serving(self.config, self.params)

    @property
    def module(self) -> Llama:
        return Llama(self.config)
