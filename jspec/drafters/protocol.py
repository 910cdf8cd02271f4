"""The drafter protocol: what the driver, :func:`jspec.generate` and the tools call.

A drafter is a pair (:class:`jspec.drafters.Drafter`): a frozen, hashable *architecture*
object (``Drafter.module``: the network's static fields, a static argument of the compiled
driver) and a parameter pytree. The architecture implements :class:`DraftModule`;
:class:`DraftModuleDefaults` gives the answers most kinds share, so a kind states only how
it differs. Nothing outside a drafter's file asks what kind a drafter is: it asks the
object (this protocol) or its registry entry (:mod:`jspec.drafters.registry`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from jspec.config import LlamaConfig
from jspec.spec_config import SpecConfig
from jspec.tree.build import DraftTree


@runtime_checkable
class DraftModule(Protocol):
    kind: ClassVar[str]

    # ---------------------------------------------------------------- host side
    def validate(self, target_cfg: LlamaConfig, params=None) -> None:
        """Raise :class:`~jspec.drafters.DrafterMismatchError` if it does not fit the target."""

    def check_spec(self, spec: SpecConfig | None) -> None:
        """Raise ``ValueError`` for tree knobs this drafter cannot draft."""

    def tree_shape(self, spec: SpecConfig | None) -> tuple[int, int]:
        """``(S, N)``: the deepest accepted path and the node count it drafts."""

    def cache_slots(self, spec: SpecConfig | None) -> int:
        """KV slots a row's drafter state needs past the target's committed length."""

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The target layers whose input residual it reads (``forward(aux_layers=)``)."""

    @property
    def has_pool(self) -> bool:
        """Whether it drafts an EAGLE-2 candidate pool (``draft_pool``): calibration, the
        tuner's tree grid and ``selection="calibrated"`` need one."""

    def serving(self, params) -> tuple[Any, Any]:
        """``(architecture, params)`` in the layout :func:`jspec.generate` runs."""

    # ------------------------------------------------------------- inside jit
    def features(self, hidden: jax.Array, aux: tuple, tokens: jax.Array) -> jax.Array:
        """What it reads of a target forward, per position ``[B, T, F]``: from the post-norm
        ``hidden``, the ``aux`` states of :attr:`target_layers` and the input ``tokens``."""

    def init_state(self, batch: int, page_table, num_pages: int, page_size: int) -> Any: ...

    # ``kernels``: the attention implementation (a concrete :mod:`jspec.kernels` mode) of a
    # drafter that attends. A run-time choice, not part of the architecture, so it is an
    # argument (static under jit: the decoder's own field) and never a field of this object.
    def prefill(self, params, target, state, feats, next_tokens, lens, *,
                kernels: str = "reference") -> Any: ...

    def propose(self, params, target, state, root, spec: SpecConfig | None, *,
                kernels: str = "reference") -> DraftTree: ...

    def extend(self, params, target, state, feats, next_tokens, n, *,
               kernels: str = "reference") -> Any: ...


class DraftModuleDefaults:
    """Defaults of :class:`DraftModule` that most kinds share: they read the target's
    final hidden state, draft ``spec``'s dynamic tree and need no serving relayout."""

    # Parameters that hold one entry per batch row (a test oracle's planted continuation):
    # such a drafter serves one static batch, not the engine's slots.
    per_row_params: ClassVar[bool] = False

    # A fresh state fed ``extend`` from position 0 ends where ``prefill`` of the same pairs
    # does, so a drafter whose prefill was skipped can be caught up later by extends alone
    # (the serving engine's lazy insert, :meth:`jspec.engine.programs.Programs.sync`).
    prefill_is_extend: ClassVar[bool] = True

    def check_spec(self, spec: SpecConfig | None) -> None:
        if spec is None:
            raise ValueError(f"a {self.kind} drafter needs tree knobs (a SpecConfig)")

    def tree_shape(self, spec: SpecConfig | None) -> tuple[int, int]:
        return spec.num_steps, spec.num_draft_tokens

    @property
    def target_layers(self) -> tuple[int, ...]:
        return ()

    @property
    def has_pool(self) -> bool:
        return False

    def serving(self, params):
        return self, params

    def features(self, hidden, aux, tokens):
        return jnp.concatenate(aux, -1) if aux else hidden
