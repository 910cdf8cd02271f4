"""Online training: the target's features computed inside the training step.

Offline (:mod:`jspec.train.features`) runs the target once per sequence and caches its final
hidden state, its aux states and its top-k logits to disk: 32,896 bytes a token at
Llama-3-8B (three 4096-wide aux states and the hidden state in bf16, top-16 logits and ids),
6.6 TB for 200M tokens (``python -m jspec.bench train-modes``). Online,
the jitted step runs the same forward (:func:`jspec.train.features.make_target_pass`, forward
only, outputs stop-gradiented) over the batch's tokens and hands the drafter's loss exactly
the batch an offline shard would have given, so the two modes train the same drafter on the
same batches; nothing is written to disk. The aux states are the drafter's own
(``module.target_layers``), not the three a feature cache was made for.
"""

from __future__ import annotations

import functools

import jax

from jspec.train.features import make_target_pass


@functools.lru_cache(maxsize=None)
def _target_pass(cfg, aux_layers: tuple, topk: int):
    return make_target_pass(cfg, aux_layers, topk)


def with_target_features(module, target_cfg, target_params, batch: dict, topk: int) -> dict:
    """``batch`` (``tokens``, ``lens``, ...) plus what :func:`jspec.train.sources.sample_batch`
    takes from an offline cache: ``hidden``, ``feats`` (the drafter's aux states, or the
    hidden state for a drafter that reads none) and the target's ``topk_vals / topk_ids``."""
    aux_layers = tuple(module.target_layers)
    run = _target_pass(target_cfg, aux_layers, topk)
    hidden, aux, vals, ids = jax.lax.stop_gradient(run(target_params, batch["tokens"],
                                                       batch.get("segments"),
                                                       batch.get("positions")))
    return {**batch, "hidden": hidden, "feats": aux if aux_layers else hidden,
            "topk_vals": vals, "topk_ids": ids}
