"""A 16-token target small enough to enumerate: the exact distribution of its first 3
sampled tokens, against which the sampling tests run a chi-square test."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

import jspec
from jspec import kv_cache as kvc
from jspec.llama import forward, init_params, logits
from jspec.serving_layout import pack_params

V = 16
PROMPT = [1, 5, 9]
SAMPLING = dict(temperature=0.9, top_k=12)


def sharp_target(tokenizer=None) -> jspec.Target:
    cfg = jspec.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.key(7))
    # Sharpen the tied embedding so next-token distributions are far from uniform.
    params["embed_tokens"]["embedding"] = params["embed_tokens"]["embedding"] * 6
    return jspec.Target(cfg, params, tokenizer)


def pair_logits(target) -> np.ndarray:
    """``[V * V, T, V]`` logits of ``PROMPT + (x1, x2)`` for every pair, row ``x1 * V + x2``."""
    c = target.config
    pairs = np.array(list(itertools.product(range(V), repeat=2)), np.int32)
    seqs = jnp.asarray(np.concatenate([np.tile(PROMPT, (len(pairs), 1)), pairs], 1))
    B, T = seqs.shape
    cache = kvc.init_cache(2, 2, 8, kvc.allocate_page_table([T] * B, 8, B), B, 8)
    params = pack_params(c, target.params)
    h, _, _ = forward(c, params, seqs, jnp.broadcast_to(jnp.arange(T), (B, T)), cache)
    return np.asarray(logits(c, params, h))


def joint(p1, p2, p3) -> np.ndarray:
    """``P(x1, x2, x3)`` from ``p1 [V]``, ``p2 [V(x1), V]`` and ``p3 [V, V, V]``."""
    return p1[:, None, None] * p2[:, :, None] * p3


def pvalue(tokens, exact) -> tuple[float, int]:
    """Chi-square p-value of the sampled ``tokens [rows, 3]`` against ``exact``, and the number
    of cells expected 5 times or more (the rest pooled into one); a sequence of probability 0
    fails at once."""
    counts = np.zeros(V ** 3)
    np.add.at(counts, np.ravel_multi_index(np.asarray(tokens).T, (V, V, V)), 1)
    e = exact.ravel() * len(tokens)
    assert counts[e == 0].sum() == 0, "sampled a sequence the target (or grammar) forbids"
    big = e >= 5
    rest = ~big & (e > 0)
    obs = np.append(counts[big], counts[rest].sum()) if rest.any() else counts[big]
    exp = np.append(e[big], e[rest].sum()) if rest.any() else e[big]
    return stats.chisquare(obs, exp / exp.sum() * obs.sum()).pvalue, int(big.sum())
