"""Drafters behind one protocol (:mod:`jspec.drafters.protocol`), one registry entry per kind
(:mod:`jspec.drafters.registry`): EAGLE-3, EAGLE-1, MTP, Medusa, DFlash (a block drafted in one
parallel forward), n-gram prompt lookup (no weights), an independent draft model, and an oracle
for tests and benchmarks."""

from __future__ import annotations

from jspec.drafters import registry
from jspec.drafters.base import DrafterMismatchError
from jspec.drafters.checkpoint import (detect_drafter_kind, load_drafter, save_drafter,
                                       save_hf_drafter)
from jspec.drafters.dflash import DFlash
from jspec.drafters.draft_model import DraftModel
from jspec.drafters.drafter import Drafter, make_drafter, ngram_drafter, random_drafter
from jspec.drafters.eagle1 import Eagle1
from jspec.drafters.eagle3 import Eagle3, default_aux_layers
from jspec.drafters.hf_layout import draft_layer_config
from jspec.drafters.medusa import Medusa
from jspec.drafters.mtp import MTP
from jspec.drafters.ngram import NGram
from jspec.drafters.oracle import Oracle
from jspec.drafters.protocol import DraftModule

__all__ = ["DFlash", "Drafter", "DraftModel", "DraftModule", "DrafterMismatchError", "Eagle1", "Eagle3",
           "MTP", "Medusa", "NGram", "Oracle", "ngram_drafter", "make_drafter", "registry",
           "random_drafter", "draft_layer_config", "default_aux_layers",
           "load_drafter", "save_drafter", "save_hf_drafter", "detect_drafter_kind"]
