"""Where a training step's batch comes from.

:class:`ArraySource`: sequences held in memory, either an offline feature cache
(:func:`jspec.train.features.load_features`: tokens with the target's hidden / aux states
and top-k logits) or tokens alone (online training: the target runs inside the step).
Batch ``s`` is drawn from ``default_rng([seed, s])``, so it depends only on the step: a
resumed run sees exactly the batches an uninterrupted one would, and every process of a
multi-host run draws the same global batch and builds only its own devices' rows.

:class:`jspec.train.pipeline.PipelineSource` streams JSONL instead (grain).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jspec.train.features import pad_sequences, row_length
from jspec.train.placement import batch_shardings, place

FEATURE_KEYS = ("hidden", "aux", "topk_vals", "topk_ids")


def feature_key(module) -> str:
    return "aux" if module.target_layers else "hidden"


def token_data(seqs, multiple: int = 16, length: int | None = None,
               pack: bool = False) -> dict:
    """Sequences (regenerated or tokenised) -> the ``tokens / lens`` an online run trains on:
    one per row, or with ``pack`` several per row (:mod:`jspec.train.packing`; rows of
    ``length``, default the longest sequence's)."""
    if pack:
        from jspec.train.packing import pack_sequences
        return pack_sequences(seqs, row_length([len(s) for s in seqs], multiple, length))
    tokens, lens = pad_sequences(seqs, multiple, length)
    return {"tokens": tokens, "lens": lens}


def is_online(data: dict) -> bool:
    return not any(k in data for k in FEATURE_KEYS)


class ArraySource:
    """Batches of ``batch_size`` rows of ``data`` (all leaves share the row axis)."""

    def __init__(self, data: dict, module, batch_size: int, seed: int):
        self.data, self.module, self.batch_size, self.seed = data, module, batch_size, seed

    def batch(self, step: int) -> dict:
        return sample_batch(self.data, self.module, step, self.batch_size, self.seed, host=True)

    def place(self, batch: dict, mesh):
        if mesh is None:
            return {k: jnp.asarray(v) for k, v in batch.items()}
        return place(batch, batch_shardings(batch, mesh))

    # The position is the step itself (nothing else to save).
    def save_args(self):
        return None

    def restore_args(self):
        return None


def sample_batch(data: dict, module, step: int, batch_size: int, seed: int,
                 rows: np.ndarray | None = None, host: bool = False) -> dict:
    """Batch ``step``: rows drawn from ``default_rng([seed, step])`` (resume-exact). From a
    feature cache: ``tokens, lens, feats, hidden, topk_vals, topk_ids``; from tokens alone
    (online): ``tokens, lens`` (and ``loss_mask`` where the data has one)."""
    n = len(data["tokens"]) if rows is None else len(rows)
    pick = np.random.default_rng([seed, step]).choice(n, batch_size, replace=n < batch_size)
    if rows is not None:
        pick = rows[pick]
    keys = [k for k in ("tokens", "lens", "loss_mask", "segments", "positions", "topk_vals",
                        "topk_ids", "hidden") if k in data]
    b = {k: data[k][pick] for k in keys}
    if not is_online(data):
        b["feats"] = data[feature_key(module)][pick]
    b["rng"] = np.array([seed, step], np.uint32)       # the loss's own draws (DFlash anchors)
    return b if host else {k: jnp.asarray(v) for k, v in b.items()}
