"""Sampling from a quantized (int8) target, plain and speculative, has the quantized
target's own distribution: over the first 3 tokens of a vocabulary-16 target, enumerated
exactly from its forward, a chi-square test."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jspec
from jspec import kv_cache as kvc
from jspec.drafters import random_drafter
from jspec.llama import forward, init_params, logits
from jspec.quant import quantize_target
from jspec.sampling import SamplingConfig, target_probs
from jspec.spec_config import SpecConfig

V, ROWS, PROMPT = 16, 20_000, [1, 5, 9]
SAMPLING = dict(temperature=0.9, top_k=12)


@pytest.fixture(scope="module")
def target():
    cfg = jspec.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.key(7))
    params["embed_tokens"]["embedding"] = params["embed_tokens"]["embedding"] * 6
    return quantize_target(jspec.Target(cfg, params), "int8")


@pytest.fixture(scope="module")
def exact(target):
    """P(x1, x2, x3 | prompt) of the quantized target, all 256 (x1, x2) enumerated."""
    c = target.config
    pairs = np.array(list(itertools.product(range(V), repeat=2)), np.int32)
    seqs = jnp.asarray(np.concatenate([np.tile(PROMPT, (len(pairs), 1)), pairs], 1))
    B, T = seqs.shape
    cache = kvc.init_cache(2, 2, 8, kvc.allocate_page_table([T] * B, 8, B), B, 8)
    h, _, _ = forward(c, target.params, seqs, jnp.broadcast_to(jnp.arange(T), (B, T)), cache)
    probs = np.asarray(target_probs(logits(c, target.params, h), SamplingConfig(**SAMPLING)),
                       np.float64)
    p1 = probs[0, len(PROMPT) - 1]
    p2 = probs[::V, len(PROMPT)]
    p3 = probs[:, len(PROMPT) + 1].reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def pvalue(tokens, exact):
    counts = np.zeros(V ** 3)
    np.add.at(counts, np.ravel_multi_index(np.asarray(tokens).T, (V, V, V)), 1)
    e = exact.ravel() * len(tokens)
    assert counts[e == 0].sum() == 0, "sampled a sequence the target cannot produce"
    big = e >= 5
    obs = np.append(counts[big], counts[~big & (e > 0)].sum())
    exp = np.append(e[big], e[~big & (e > 0)].sum())
    return stats.chisquare(obs, exp / exp.sum() * obs.sum()).pvalue, int(big.sum())


# 20,000 rows each (about a minute apiece here), all with -m slow: a quantized target goes
# through the same sampling code as a float one (tests/decode/test_spec_sampling.py runs the
# tree by default); the greedy exactness of every kind runs by default in
# test_quantized_target.py.
@pytest.mark.slow
@pytest.mark.parametrize("spec", [None, SpecConfig(3, 4, 8),
                                  pytest.param(SpecConfig.chain(3), marks=pytest.mark.slow)],
                         ids=["plain", "tree", "chain"])
def test_sampling_matches_the_quantized_target(target, exact, spec):
    drafter = None if spec is None else random_drafter("eagle1", target.config, jax.random.key(2))
    res = jspec.generate(target, [PROMPT] * ROWS, max_new_tokens=3, stop_ids=[], seed=1,
                         drafter=drafter, spec=spec, page_size=8, **SAMPLING)
    p, cells = pvalue(np.array(res.tokens), exact)
    assert cells > 50 and p > 1e-3, (p, cells)
    if spec is not None:       # drafts really accepted, or this only tests plain sampling
        hist = np.sum([s["accept_hist"] for s in res.stats], 0)
        assert hist[2:].sum() > 1000, hist
