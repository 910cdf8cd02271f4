"""Sampling under a grammar stays lossless: on a small random target (vocabulary 16, with a
tokenizer whose pieces make the grammar's allowed set change from token to token), plain and
speculative sampling's distribution over the first 3 tokens matches the masked target's
distribution (each step's logits masked by that prefix's allowed set, then the sampling
filters), enumerated exactly: on the device path (the regex's table) and on the host path (a
context-free grammar's llguidance matcher, asked afresh for every prefix)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.enumerated import PROMPT, SAMPLING, V, joint, pair_logits, pvalue, sharp_target

import jspec
from jspec.drafters import random_drafter
from jspec.grammar import compile_format
from jspec.grammar.device import FORBIDDEN
from jspec.grammar.host import unpack
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
# The host path: the letters after "x" nest (a^n y|z b^n), which no regex holds.
HOST_FORMAT = {"type": "grammar", "grammar": 'start: ("a" | "b" | "aa" | "bb") "x" mid "c"\n'
                                             'mid: "a" mid "b" | "y" | "z"\n'}


@pytest.fixture(scope="module")
def target():
    return sharp_target(Llama2cTokenizer(PIECES, [0.0] * V))


def table_allowed(target, fmt):
    """``allowed(prefix) -> bool [V]`` from the device path's automaton."""
    auto = compile_format(fmt, target.tokenizer, V, [2])

    def allowed(prefix):
        s = auto.initial
        for t in prefix:
            s = auto.step(s, t)
        return auto.allowed(s)
    return allowed


def matcher_allowed(target, fmt):
    """``allowed(prefix) -> bool [V]`` from a fresh llguidance matcher fed the prefix (every
    token allowed after a prefix the grammar refuses: its probability is 0 already)."""
    import llguidance.numpy as lnp
    g = compile_format(fmt, target.tokenizer, V, [2])

    def allowed(prefix):
        m = g.matcher()
        if m.try_consume_tokens(list(prefix)) < len(prefix):
            return np.ones(V, bool)
        bits = lnp.allocate_token_bitmask(1, V)
        lnp.fill_next_token_bitmask(m, bits, 0)
        return np.asarray(unpack(bits[0], V))
    return allowed


def exact_of(target, allowed):
    """P(x1, x2, x3 | prompt) under ``allowed`` and the sampling filters, by enumeration."""
    logits = pair_logits(target)
    n = len(PROMPT)

    def probs(lg, prefix):
        lg = np.where(allowed(prefix), lg, FORBIDDEN)
        return np.asarray(target_probs(jnp.asarray(lg), SamplingConfig(**SAMPLING)), np.float64)

    p1 = probs(logits[0, n - 1], ())
    p2 = np.stack([probs(logits[a * V, n], (a,)) for a in range(V)])
    p3 = np.stack([probs(logits[a * V + b, n + 1], (a, b))
                   for a in range(V) for b in range(V)]).reshape(V, V, V)
    return joint(p1, p2, p3)


@pytest.fixture(scope="module")
def exact(target):
    return exact_of(target, table_allowed(target, FORMAT))


def sample(target, drafter=None, spec=None, seed=0, fmt=FORMAT, rows=ROWS):
    res = jspec.generate(target, [PROMPT] * rows, max_new_tokens=3, stop_ids=[2], seed=seed,
                         drafter=drafter, spec=spec, page_size=8, response_format=fmt,
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


@pytest.mark.slow
@pytest.mark.parametrize("spec", [None, SpecConfig(3, 4, 8)], ids=["plain", "tree"])
def test_host_grammar_sampling_matches_the_masked_target(target, spec):
    """The host path: every verify pass asks the rows' matchers for the tree's masks."""
    drafter = None if spec is None else random_drafter("eagle1", target.config, jax.random.key(2))
    toks, res = sample(target, drafter, spec, seed=2, fmt=HOST_FORMAT)
    p, cells = pvalue(toks, exact_of(target, matcher_allowed(target, HOST_FORMAT)))
    assert cells > 12 and p > 1e-3, (p, cells)      # 18 cells: the grammar forces "x" early
    if drafter is not None:
        hist = np.sum([s["accept_hist"] for s in res.stats], 0)
        assert hist[2:].sum() > 1000, hist
