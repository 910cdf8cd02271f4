"""Sampling under a grammar stays lossless: on a small random target (vocabulary 16, with a
tokenizer whose pieces make the grammar's allowed set change from token to token), plain and
speculative sampling's distribution over the first 3 tokens matches the masked target's
distribution (each step's logits masked by that prefix's grammar state, then the sampling
filters), enumerated exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.enumerated import PROMPT, SAMPLING, V, joint, pair_logits, pvalue, sharp_target

import jspec
from jspec.drafters import random_drafter
from jspec.grammar import compile_format
from jspec.grammar.device import FORBIDDEN
from jspec.sampling import SamplingConfig, target_probs
from jspec.spec_config import SpecConfig
from jspec.tokenizer import Llama2cTokenizer

ROWS = 10_000
PIECES = [b"<unk>", b"<s>", b"</s>", b"a", b"b", b"ab", b"ba", b"aba", b"bab", b"c", b"abab",
          b"x", b"y", b"bb", b"aa", b"z"]
# One of a, b, aa, bb, then "x", then letters, then "c": which tokens are allowed depends on
# where the text is, the second token is forced (the only one allowed: the speculative path
# drafts it for free, force_tree), and 3 tokens never complete it.
FORMAT = {"type": "regex", "regex": "(a|b|aa|bb)x[abyz]+c"}


@pytest.fixture(scope="module")
def target():
    return sharp_target(Llama2cTokenizer(PIECES, [0.0] * V))


@pytest.fixture(scope="module")
def exact(target):
    """P(x1, x2, x3 | prompt) under the grammar and the sampling filters, by enumeration."""
    auto = compile_format(FORMAT, target.tokenizer, V, [2])
    logits = pair_logits(target)
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
    return joint(p1, p2, p3)


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
