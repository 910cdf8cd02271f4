"""Drafters behind one protocol (:mod:`jspec.drafters.protocol`), one registry entry per kind
(:mod:`jspec.drafters.registry`): EAGLE-3, EAGLE-1, MTP, Medusa, n-gram prompt lookup (no
weights), an independent draft model, and an oracle for tests and benchmarks."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from jspec.config import LlamaConfig
from jspec.drafters import registry
from jspec.drafters.base import DrafterMismatchError
# Importing a kind's file registers it (jspec.drafters.registry); the order is the listing order.
from jspec.drafters.eagle3 import Eagle3, default_aux_layers
from jspec.drafters.eagle1 import Eagle1
from jspec.drafters.mtp import MTP
from jspec.drafters.medusa import Medusa
from jspec.drafters.ngram import NGram
from jspec.drafters.oracle import Oracle
from jspec.drafters.draft_model import DraftModel
from jspec.drafters.hf_layout import draft_layer_config
from jspec.drafters.protocol import DraftModule
from jspec.spec_config import SpecConfig


@dataclasses.dataclass(frozen=True, eq=False)
class Drafter:
    """A drafter: ``module``, its architecture (a hashable object implementing
    :class:`~jspec.drafters.protocol.DraftModule`, such as :class:`Eagle1`), and params;
    ``source``: the checkpoint directory it was loaded from (where ``jspec tune`` stores its
    pick for ``spec="auto"``), None for drafters made in memory."""

    module: Any
    params: Any
    source: str | None = None

    @property
    def kind(self) -> str:
        return self.module.kind

    @property
    def entry(self) -> registry.DrafterKind:
        return registry.kind(self.module.kind)

    @functools.cached_property
    def serving(self) -> "Drafter":
        """The drafter in its serving layout (made once, kept): what :func:`jspec.generate`
        runs."""
        module, params = self.module.serving(self.params)
        return self if module is self.module else Drafter(module, params, source=self.source)

    def on_mesh(self, target_cfg: LlamaConfig, mesh) -> "Drafter":
        """:attr:`serving` placed on ``mesh`` (:func:`jspec.sharding.shard_drafter`), made once
        per mesh and kept, so repeated ``generate`` calls do not copy the drafter again."""
        placed = self.__dict__.setdefault("_on_mesh", {})
        if mesh not in placed:
            from jspec.sharding import shard_drafter
            placed[mesh] = shard_drafter(self.serving, target_cfg, mesh)
        return placed[mesh]

    @property
    def default_spec(self) -> SpecConfig | None:
        """The kind's default tree (its registry entry), under calibrated node selection
        when the drafter carries a calibration model (``jspec_calibration.json``, see
        :mod:`jspec.tree.calibration`): it drafts the same number of nodes at the same cost
        and measured +17-20% more tokens per verify teacher forced on the shipped model's
        EAGLE-3 (checkpoints/README.md)."""
        from jspec.tree.calibration import model_of
        spec = self.entry.default_spec
        if spec is not None and not spec.is_chain and model_of(self) is not None \
                and self.module.has_pool:
            return spec.with_selection("calibrated")
        return spec


def make_drafter(kind: str, target_cfg: LlamaConfig, key=None, *args, **kw) -> Drafter:
    """A drafter made in memory for ``target_cfg`` by its kind's registry entry: random
    weights for a learned kind, the whole drafter for a weightless one (``ngram``)."""
    key = jax.random.key(0) if key is None else key
    module, params = registry.kind(kind).build(target_cfg, key, *args, **kw)
    return Drafter(module, params)


def random_drafter(kind: str, target_cfg: LlamaConfig, key=None, **kw) -> Drafter:
    """A learned drafter with random weights, shaped to fit ``target_cfg`` (tests, benchmarks).

    ``vocab_size=Vd`` (every kind) drafts over a reduced vocabulary: its own ``[H, Vd]``
    head(s) and the identity-prefix map (draft id i -> target id i; install another with
    :func:`jspec.drafters.vocab.set_draft_vocab`). A Medusa drafter with ``Vd < V`` is
    ``truncated`` (a ``token_map``).
    """
    if not registry.kind(kind).needs_weights:
        raise ValueError(f"a {kind} drafter has no weights (use make_drafter)")
    return make_drafter(kind, target_cfg, key, **kw)


def ngram_drafter(target_cfg: LlamaConfig, min_n: int = 1, max_n: int = 4) -> Drafter:
    """Prompt lookup (:class:`NGram`): works with any target, nothing to load."""
    return make_drafter("ngram", target_cfg, None, min_n, max_n)


# Imported last: the checkpoint module needs Drafter defined above.
from jspec.drafters.checkpoint import (detect_drafter_kind, load_drafter, save_drafter,  # noqa: E402
                                       save_hf_drafter)

__all__ = ["Drafter", "DraftModel", "DraftModule", "DrafterMismatchError", "Eagle1", "Eagle3", "MTP", "Medusa",
           "NGram", "Oracle", "ngram_drafter", "make_drafter", "registry",
           "random_drafter", "draft_layer_config", "default_aux_layers",
           "load_drafter", "save_drafter", "save_hf_drafter", "detect_drafter_kind"]
