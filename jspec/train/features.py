"""Target features cached to disk, and the EAGLE-3 draft vocabulary.

For every sequence the target runs once (a full causal prefill through ``Llama.apply`` with
a fresh KV cache) and we keep, per position:

- ``hidden [T, H]``: the final post-norm hidden state (EAGLE-1, MTP, Medusa read it);
- ``aux [T, 3H]``: the residual streams *entering* the three ``aux_layers``, concatenated
  (EAGLE-3's input; same convention as :mod:`jspec.llama` / :mod:`jspec.drafters.eagle3`);
- ``topk_vals / topk_ids [T, k]``: the target's logits' top-k (all logits when k >= V).

Shards are ``.npz`` files (``shard_00000.npz`` ...) of sequences padded to one length,
plus ``meta.json`` (aux layers, k, vocab, counts). :func:`load_features` concatenates them.

``d2t`` (a draft -> target offset map, for every drafter kind with a draft vocabulary)
comes from token frequencies (:func:`token_frequencies` here, then
:func:`jspec.drafters.vocab.build_d2t`, re-exported): the ``Vd`` most frequent target tokens,
in increasing id order, form the draft vocabulary and ``d2t[i] = target_id(i) - i``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import kv_cache as kvc
from jspec.drafters.eagle3 import default_aux_layers
from jspec.drafters.vocab import build_d2t, target_to_draft  # noqa: F401  (re-exported)
from jspec.llama import Llama


def aux_layers_for(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default aux layers, spread out when the defaults coincide (small targets:
    a 5-layer model's (2, L//2, L-3) is (2, 2, 2), three copies of one stream)."""
    d = default_aux_layers(num_layers)
    if len(set(d)) == 3 or num_layers < 3:
        return d
    return (1, num_layers // 2, num_layers - 1)


def row_length(lens, multiple: int = 16, length: int | None = None) -> int:
    """``length``, else the longest of ``lens`` rounded up to a multiple of ``multiple``."""
    return length or int(math.ceil(max(lens) / multiple) * multiple)


def pad_sequences(seqs: Sequence[np.ndarray], multiple: int = 16, length: int | None = None):
    """``(tokens [N, T] int32 (0 padded), lens [N])`` with T :func:`row_length`."""
    lens = np.array([len(s) for s in seqs], np.int32)
    T = row_length(lens, multiple, length)
    out = np.zeros((len(seqs), T), np.int32)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s[:T]
    return out, np.minimum(lens, T)


def make_target_pass(cfg, aux_layers: Sequence[int], topk: int, page_size: int = 16):
    """A jitted ``(params, tokens [B, T], segments=None, positions=None) -> (hidden, aux,
    topk_vals, topk_ids)`` prefill; with ``segments`` (a packed row,
    :mod:`jspec.train.packing`) each record attends to itself only, at its own positions."""
    from jspec.train.packing import segment_mask
    aux_layers = tuple(aux_layers)
    model = Llama(cfg)

    @jax.jit
    def run(params, tokens, segments=None, positions=None):
        B, T = tokens.shape
        pages = kvc.pages_needed(T, page_size)
        table = jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages)
        cache = kvc.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, table, B * pages,
                               page_size, cfg.dtype)
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        mask = None
        if segments is not None:
            pos, mask = positions, segment_mask(segments)
        hidden, aux, _ = model.apply({"params": params}, tokens, pos, cache, mask,
                                     aux_layers=aux_layers)
        logits = model.apply({"params": params}, hidden, method=Llama.logits)
        if topk >= cfg.vocab_size:
            vals = logits
            ids = jnp.broadcast_to(jnp.arange(cfg.vocab_size, dtype=jnp.int32), logits.shape)
        else:
            vals, ids = jax.lax.top_k(logits, topk)
        aux = jnp.concatenate(aux, -1) if aux else jnp.zeros((B, T, 0), hidden.dtype)
        return hidden, aux, vals, ids.astype(jnp.int32)

    return run


def compute_features(target, seqs: Sequence[np.ndarray], out_dir, *, aux_layers=None,
                     topk: int = 16, batch_size: int = 32, shard_size: int = 512,
                     prompt_lens: Sequence[int] | None = None, progress: bool = True) -> Path:
    """Run the target over ``seqs`` and write feature shards to ``out_dir``."""
    from tqdm import tqdm

    cfg = target.config
    aux_layers = tuple(aux_layers) if aux_layers is not None else aux_layers_for(cfg.num_layers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokens, lens = pad_sequences(seqs)
    N, T = tokens.shape
    run = make_target_pass(cfg, aux_layers, topk)
    k = min(topk, cfg.vocab_size)
    pl = np.zeros(N, np.int32) if prompt_lens is None else np.asarray(prompt_lens, np.int32)
    nshards = math.ceil(N / shard_size)
    bar = tqdm(total=N, desc="features", disable=not progress, dynamic_ncols=True)
    for s in range(nshards):
        lo, hi = s * shard_size, min(N, (s + 1) * shard_size)
        parts = []
        for b in range(lo, hi, batch_size):
            tb = tokens[b:min(hi, b + batch_size)]
            n = len(tb)
            if n < batch_size:           # one compiled shape
                tb = np.concatenate([tb, np.zeros((batch_size - n, T), np.int32)])
            res = jax.device_get(run(target.params, jnp.asarray(tb)))
            parts.append([x[:n] for x in res])
            bar.update(n)
        hidden, aux, vals, ids = (np.concatenate(p) for p in zip(*parts))
        np.savez(out / f"shard_{s:05d}.npz", tokens=tokens[lo:hi], lens=lens[lo:hi],
                 prompt_lens=pl[lo:hi], hidden=hidden, aux=aux,
                 topk_vals=vals.astype(np.float32), topk_ids=ids.astype(np.int32))
    bar.close()
    meta = {"num_sequences": int(N), "seq_len": int(T), "aux_layers": list(aux_layers),
            "topk": int(k), "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_shards": nshards}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return out


def load_features(feat_dir) -> dict:
    """All shards concatenated: ``tokens, lens, prompt_lens, hidden, aux, topk_vals, topk_ids``
    plus ``meta``."""
    d = Path(feat_dir)
    meta = json.loads((d / "meta.json").read_text())
    shards = [np.load(d / f"shard_{s:05d}.npz") for s in range(meta["num_shards"])]
    out = {k: np.concatenate([z[k] for z in shards]) for k in shards[0].files}
    out["meta"] = meta
    return out


# ------------------------------------------------------------------ draft vocabulary
def token_frequencies(tokens: np.ndarray, lens: np.ndarray, vocab_size: int) -> np.ndarray:
    """Counts of each target id over the real (unpadded) positions."""
    mask = np.arange(tokens.shape[1])[None] < lens[:, None]
    return np.bincount(tokens[mask].ravel(), minlength=vocab_size)[:vocab_size]
