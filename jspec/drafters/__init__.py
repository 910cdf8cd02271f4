"""Drafters behind one protocol (see :mod:`jspec.drafters.base`): Medusa, EAGLE-1,
EAGLE-3, MTP, n-gram prompt lookup (no weights), and an oracle for tests and benchmarks."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from jspec.config import LlamaConfig
from jspec.drafters.base import DrafterMismatchError
from jspec.drafters.eagle1 import Eagle1
from jspec.drafters.eagle3 import Eagle3, default_aux_layers
from jspec.drafters.medusa import Medusa
from jspec.drafters.mtp import MTP
from jspec.drafters.ngram import NGram
from jspec.drafters.oracle import Oracle
from jspec.spec_config import SpecConfig

DEFAULT_SPECS = {
    "eagle1": SpecConfig(5, 4, 8),
    "eagle3": SpecConfig(5, 4, 8),
    "mtp": SpecConfig.chain(3),
    "medusa": None,                 # Medusa's own 63-node tree
    "oracle": SpecConfig(5, 4, 8),
    "ngram": SpecConfig.chain(4),
}


@dataclasses.dataclass(frozen=True, eq=False)
class Drafter:
    """A drafter: ``module`` (a hashable architecture spec such as :class:`Eagle1`) and params;
    ``source``: the checkpoint directory it was loaded from (where ``jspec tune`` stores its
    pick for ``spec="auto"``), None for drafters made in memory."""

    module: Any
    params: Any
    source: str | None = None

    @property
    def kind(self) -> str:
        return self.module.kind

    @functools.cached_property
    def serving(self) -> "Drafter":
        """The drafter in its serving layout (made once, kept): what :func:`jspec.generate`
        runs. Kinds without one (Medusa, the oracle) are returned as they are."""
        if not hasattr(self.module, "serving"):
            return self
        return Drafter(*self.module.serving(self.params), source=self.source)

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
        """The kind's default tree (:data:`DEFAULT_SPECS`), under calibrated node selection
        when the drafter carries a calibration table (``jspec_calibration.json``, see
        :mod:`jspec.tree.calibration`): it drafts the same number of nodes at the same cost
        and measured +10-13% more tokens per verify on the shipped model's EAGLE-3."""
        from jspec.tree.calibration import table_of
        spec = DEFAULT_SPECS[self.kind]
        if spec is not None and not spec.is_chain and table_of(self) is not None \
                and hasattr(self.module, "draft_pool"):
            return spec.with_selection("calibrated")
        return spec


def ngram_drafter(target_cfg: LlamaConfig, min_n: int = 1, max_n: int = 4) -> Drafter:
    """Prompt lookup (:class:`NGram`): works with any target, nothing to load."""
    return Drafter(NGram(target_cfg.vocab_size, min_n, max_n), {})


def draft_layer_config(target: LlamaConfig, **overrides) -> LlamaConfig:
    """A one-layer decoder config shaped like the target's layers (the usual drafter)."""
    return target.replace(num_layers=1, **overrides)


def random_drafter(kind: str, target_cfg: LlamaConfig, key=None, **kw) -> Drafter:
    """A drafter with random weights, shaped to fit ``target_cfg`` (tests, benchmarks).

    ``vocab_size=Vd`` (every kind) drafts over a reduced vocabulary: its own ``[H, Vd]``
    head(s) and the identity-prefix map (draft id i -> target id i; install another with
    :func:`jspec.drafters.vocab.set_draft_vocab`). A Medusa drafter with ``Vd < V`` is
    ``truncated`` (a ``token_map``).
    """
    key = jax.random.key(0) if key is None else key
    layer = draft_layer_config(target_cfg)
    V = target_cfg.vocab_size
    if kind == "eagle1":
        module = Eagle1(layer, V, **kw)
    elif kind == "eagle3":
        kw.setdefault("aux_layers", default_aux_layers(target_cfg.num_layers))
        module = Eagle3(layer, V, **kw)
    elif kind == "mtp":
        module = MTP(layer, V, **kw)
    elif kind == "medusa":
        kw.setdefault("num_heads", 4)
        kw.setdefault("num_layers", 1)
        if 0 < kw.get("vocab_size", 0) < V:
            kw.setdefault("truncated", True)
        module = Medusa(hidden=target_cfg.hidden_size, target_vocab=V, dtype=target_cfg.dtype, **kw)
    else:
        raise ValueError(f"unknown drafter kind {kind!r} (eagle1, eagle3, mtp, medusa)")
    return Drafter(module, module.init_params(key, target_cfg))


# Imported last: the checkpoint module needs Drafter and draft_layer_config defined above.
from jspec.drafters.checkpoint import (detect_drafter_kind, load_drafter, save_drafter,  # noqa: E402
                                       save_hf_drafter)

__all__ = ["Drafter", "DrafterMismatchError", "Eagle1", "Eagle3", "MTP", "Medusa", "NGram",
           "Oracle", "ngram_drafter",
           "DEFAULT_SPECS", "random_drafter", "draft_layer_config", "default_aux_layers",
           "load_drafter", "save_drafter", "save_hf_drafter", "detect_drafter_kind"]
