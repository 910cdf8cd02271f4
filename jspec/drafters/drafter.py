"""The :class:`Drafter` value (architecture + params) and drafters made in memory."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax

from jspec.config import LlamaConfig
from jspec.drafters import registry
# Importing a kind's file registers it (jspec.drafters.registry); the order is the listing order.
from jspec.drafters import eagle3, eagle1, mtp, medusa, dflash, ngram, oracle, draft_model  # noqa: F401
from jspec.sharding import boxed_shardings
from jspec.spec_config import SpecConfig
from jspec.tree.calibration import model_of


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

    def shardings(self, target_cfg: LlamaConfig, mesh):
        """NamedShardings for :attr:`params` (checkpoint or serving layout), from the logical
        axes the module's layers declare (:func:`jspec.sharding.boxed_shardings`): its LM head
        over the vocabulary, attention over heads, MLP over ``model``; maps and tables without
        axes (``d2t``, a calibration model) replicated."""
        boxed = jax.eval_shape(lambda k: self.module.init_params(k, target_cfg),
                               jax.random.key(0))
        return boxed_shardings(boxed, self.params, mesh,
                               out_major=getattr(self.module, "out_major", False))

    def placed(self, target_cfg: LlamaConfig, mesh) -> "Drafter":
        """The drafter with its params placed on ``mesh`` (:meth:`shardings`)."""
        params = jax.device_put(nn.unbox(self.params), self.shardings(target_cfg, mesh))
        return Drafter(self.module, params, source=self.source)

    def on_mesh(self, target_cfg: LlamaConfig, mesh) -> "Drafter":
        """:attr:`serving` :meth:`placed` on ``mesh``, made once per mesh and kept, so
        repeated ``generate`` calls do not copy the drafter again."""
        placed = self.__dict__.setdefault("_on_mesh", {})
        if mesh not in placed:
            placed[mesh] = self.serving.placed(target_cfg, mesh)
        return placed[mesh]

    @property
    def default_spec(self) -> SpecConfig | None:
        """The kind's default tree (its registry entry), under calibrated node selection
        when the drafter carries a calibration model (``jspec_calibration.json``, see
        :mod:`jspec.tree.calibration`): it drafts the same number of nodes at the same cost
        and measured +17-20% more tokens per verify teacher forced on the shipped model's
        EAGLE-3 (checkpoints/README.md)."""
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
