"""The target model as a value: configuration, parameters and (optional) tokenizer."""

from __future__ import annotations

import dataclasses
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
    """A loaded Llama target. ``params`` is the Flax parameter tree (unboxed arrays)."""

    config: LlamaConfig
    params: Any
    tokenizer: Tokenizer | None = None

    @property
    def module(self) -> Llama:
        return Llama(self.config)
