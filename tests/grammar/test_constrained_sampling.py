"""Sampling under a grammar stays lossless: on a small random target (vocabulary 16, with a
tokenizer whose pieces make the grammar's allowed set change from token to token), plain and
speculative sampling's distribution over the first 3 tokens matches the masked target's
distribution (each step's logits masked by that prefix's grammar state, then the sampling
filters), enumerated exactly."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jspec
from jspec import kv_cache as kvc
from jspec.drafters import random_drafter
from jspec.grammar import compile_format
from jspec.grammar.device import FORBIDDEN
from jspec.llama import Llama, init_params
from jspec.sampling import SamplingConfig, target_probs
from jspec.spec_config import SpecConfig
from jspec.tokenizer import Llama2cTokenizer

V = 16
ROWS = 10_000
PROMPT = [1, 5, 9]
SAMPLING = dict(temperature=0.9, top_k=12)
PIECES = [b"<unk>", b"<s>", b"</s>", b"a", b"b", b"ab", b"ba", b"aba", b"bab", b"c", b"abab",
          b"x", b"y", b"bb", b"aa", b"z"]
# One of a, b, aa, bb, then "x", then letters, then "c": which tokens are allowed depends on
# where the text is, the second token is forced (the only one allowed: the speculative path
# drafts it for free, force_tree), and 3 tokens never complete it.
FORMAT = {"type": "regex", "regex": "(a|b|aa|bb)x[abyz]+c"}


@pytest.fixture(scope="module")
def target():
    cfg = jspec.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.key(7))
    params["embed_tokens"]["embedding"] = params["embed_tokens"]["embedding"] * 6
    return jspec.Target(cfg, params, Llama2cTokenizer(PIECES, [0.0] * V))


@pytest.fixture(scope="module")
def exact(target):
    """P(x1, x2, x3 | prompt) under the grammar and the sampling filters, by enumeration."""
    auto = compile_format(FORMAT, target.tokenizer, V, [2])
    pairs = np.array(list(itertools.product(range(V), repeat=2)), np.int32)
    seqs = np.concatenate([np.tile(PROMPT, (len(pairs), 1)), pairs], 1)
    B, T = seqs.shape
    cache = kvc.init_cache(2, 2, 8, kvc.allocate_page_table([T] * B, 8, B), B, 8)
    model = Llama(target.config)
    h, _, _ = model.apply({"params": target.params}, jnp.asarray(seqs),
                          jnp.broadcast_to(jnp.arange(T), (B, T)), cache)
    logits = np.asarray(model.apply({"params": target.params}, h, method=Llama.logits))
    s1 = np.array([auto.step(auto.initial, x) for x in range(V)])
    s2 = np.array([[auto.step(s1[a], b) for b in range(V)] for a in range(V)])
    n = len(PROMPT)

    def probs(lg, state):
        lg = np.where(auto.allowed(state), lg, FORBIDDEN)
        return np.asarray(target_probs(jnp.asarray(lg), SamplingConfig(**SAMPLING)), np.float64)

    p1 = probs(logits[0, n - 1], auto.initial)
    p2 = np.stack([probs(logits[a * V, n], s1[a]) for a in range(V)])
    p3 = np.stack([probs(logits[a * V + b, n + 1], s2[a, b])
                   for a in range(V) for b in range(V)]).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def pvalue(tokens, exact):
    counts = np.zeros(V ** 3)
    np.add.at(counts, np.ravel_multi_index(np.asarray(tokens).T, (V, V, V)), 1)
    e = exact.ravel() * len(tokens)
    assert counts[e == 0].sum() == 0, "sampled a sequence the grammar or the target forbids"
    big = e >= 5
    rest = ~big & (e > 0)
    obs = np.append(counts[big], counts[rest].sum()) if rest.any() else counts[big]
    exp = np.append(e[big], e[rest].sum()) if rest.any() else e[big]
    return stats.chisquare(obs, exp / exp.sum() * obs.sum()).pvalue, int(big.sum())


def sample(target, drafter=None, spec=None, seed=0):
    res = jspec.generate(target, [PROMPT] * ROWS, max_new_tokens=3, stop_ids=[2], seed=seed,
                         drafter=drafter, spec=spec, page_size=8, response_format=FORMAT,
                         **SAMPLING)
    return np.array(res.tokens), res


# About 40 s apiece here: speculation (what could go wrong) by default, plain with -m slow.
@pytest.mark.parametrize("spec", [pytest.param(None, marks=pytest.mark.slow), SpecConfig(3, 4, 8)],
                         ids=["plain", "tree"])
def test_constrained_sampling_matches_the_masked_target(target, exact, spec):
    drafter = None if spec is None else random_drafter("eagle1", target.config, jax.random.key(2))
    toks, res = sample(target, drafter, spec, seed=1)
    p, cells = pvalue(toks, exact)
    assert cells > 20 and p > 1e-3, (p, cells)
    after = np.isin(toks[:, 0], [13, 14])                # "bb", "aa": then "x" is forced
    assert after.sum() > 100 and (toks[after, 1] == 11).all()
    if drafter is not None:     # drafts really accepted, or this only tests plain sampling
        hist = np.sum([s["accept_hist"] for s in res.stats], 0)
        assert hist[2:].sum() > 1000, hist
