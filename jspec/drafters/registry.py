"""One entry per drafter kind: everything outside the drafter's own file needs to know.

Each drafter file registers a :class:`DrafterKind` beside its class. The driver,
:func:`jspec.generate`, training, conversion, tuning and the benchmarks ask this registry
(or the drafter object itself, through :class:`jspec.drafters.protocol.DraftModule`) and
never branch on a kind's name, so a new kind is its own file, its entry and its tests.

What an entry holds:

- ``module``: the architecture class (a frozen dataclass implementing the protocol);
- ``default_spec``: its default tree knobs (None: the drafter's own static tree);
- ``modes``: the shapes the acceptance table and ``jspec.bench spec`` compare
  (``chain`` of the default depth, the ``default`` tree, a ``wide`` tree);
- ``build``: ``(target_cfg, key, *args, **kw) -> (module, params)``, a drafter made in
  memory for a target: random weights for a learned kind (tests, benchmarks, the start of
  training), the whole drafter for a weightless one (``--drafter ngram:1:4`` passes 1, 4);
- ``loss``: ``(family, defaults)`` for :mod:`jspec.train.drafter` (None: not trainable);
- ``load`` / ``from_arg``: how ``load_drafter(..., kind=)`` and ``--drafter KIND:ARGS`` make
  one, for kinds whose checkpoints are not drafter checkpoints (or that have none);
- ``hf``: its published Hugging Face layouts (:class:`jspec.drafters.hf_layout.HFLayout`),
  read and written by :mod:`jspec.drafters.hf_io` (None: jspec's Orbax format only);
- ``features``: what it reads of the target, ``"final"`` (post-norm hidden), ``"aux"``
  (concatenated aux states), ``"tokens"`` (the input ids) or ``"none"``. What exactly, and
  its cache slots, depend on an instance's fields (EAGLE-3's aux layers, the draft model's
  extra slot), so the object computes them (protocol ``features``, ``target_layers``,
  ``cache_slots``); the entry declares the kind's source for listings and documentation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jspec.spec_config import SpecConfig


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    name: str
    module: type
    default_spec: SpecConfig | None
    build: Callable[..., tuple[Any, Any]]
    modes: dict = dataclasses.field(default_factory=dict)
    loss: tuple[str, dict] | None = None
    hf: Any = None                           # jspec.drafters.hf_layout.HFLayout
    features: str = "final"
    needs_weights: bool = True               # False: works with any target, nothing to load
    # ``load_drafter(path, target, kind=KIND)`` for a kind whose checkpoints are not drafter
    # checkpoints (a draft model is a target checkpoint): ``(path, target, dtype) -> (module,
    # params)``.
    load: Callable[..., tuple[Any, Any]] | None = None
    # ``claims(directory) -> bool``: a directory ``load_drafter`` should read with ``load``
    # when no kind is given (a draft model's target checkpoint).
    claims: Callable[[Any], bool] | None = None
    # ``--drafter KIND[:ARGS]``: ``(args, target) -> (module, params)`` (ngram's n, a path).
    from_arg: Callable[[str, Any], tuple[Any, Any]] | None = None
    saveable: bool = True                    # jspec's Orbax drafter format

    @property
    def trainable(self) -> bool:
        return self.loss is not None

    def mode(self, name: str, module=None) -> SpecConfig | None:
        """``modes[name]``; a callable there is given the architecture (Medusa's chain has
        as many steps as it has heads)."""
        if name not in self.modes:
            raise KeyError(f"drafter kind {self.name!r} declares no {name!r} shape (its modes: "
                           f"{sorted(self.modes)})")
        m = self.modes[name]
        return m(module) if callable(m) else m


KINDS: dict[str, DrafterKind] = {}


def register(entry: DrafterKind) -> DrafterKind:
    if entry.name in KINDS and KINDS[entry.name] is not entry:
        raise ValueError(f"drafter kind {entry.name!r} is registered twice")
    KINDS[entry.name] = entry
    return entry


def kind(name: str) -> DrafterKind:
    """The entry for ``name``; a clear error listing the kinds otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown drafter kind {name!r} (one of {', '.join(names())})") from None


def names(where: Callable[[DrafterKind], bool] = lambda k: True) -> tuple[str, ...]:
    return tuple(n for n, k in KINDS.items() if where(k))


def of(drafter_or_module) -> DrafterKind:
    """The entry of a :class:`~jspec.drafters.Drafter` or of its architecture object."""
    m = getattr(drafter_or_module, "module", drafter_or_module)
    return kind(m.kind)
