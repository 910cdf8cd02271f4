"""End-to-end lossless sampling: on a small random target (vocabulary 16), speculative
sampling's distribution over the first 3 generated tokens matches the target's exact
distribution (enumerated), for a tree and a chain, like plain sampling does."""

import jax
import numpy as np
import pytest
from helpers.enumerated import PROMPT, SAMPLING, V, joint, pair_logits, pvalue, sharp_target

import jspec
from jspec.drafters import random_drafter
from jspec.sampling import SamplingConfig, target_probs
from jspec.spec_config import SpecConfig

ROWS = 20_000


@pytest.fixture(scope="module")
def target():
    return sharp_target()


@pytest.fixture(scope="module")
def exact(target):
    """P(x1, x2, x3 | prompt) under the sampling filters, by enumerating all 256 (x1, x2)."""
    probs = np.asarray(target_probs(pair_logits(target), SamplingConfig(**SAMPLING)), np.float64)
    n = len(PROMPT)
    # rows with x2 = 0 give p(x2 | x1); every row gives p(x3 | x1, x2)
    return joint(probs[0, n - 1], probs[::V, n], probs[:, n + 1].reshape(V, V, V))


def sample(target, drafter=None, spec=None, seed=0):
    res = jspec.generate(target, [PROMPT] * ROWS, max_new_tokens=3, stop_ids=[], seed=seed,
                         drafter=drafter, spec=spec, page_size=8, **SAMPLING)
    return np.array(res.tokens), res


# About 45 s apiece here, so the default run keeps one: EAGLE-1's tree below (the tree rule
# every kind's speculation goes through). Plain sampling, the other kinds and the chain run
# with -m slow, to keep the default run inside CI's 15 minutes.
@pytest.mark.slow
def test_plain_sampling_matches_enumeration(target, exact):
    toks, _ = sample(target)
    p, cells = pvalue(toks, exact)
    assert cells > 50 and p > 1e-3, (p, cells)


# About a minute apiece here: the tree runs by default, the calibrated tree and the chain (a
# tree of one branch) with -m slow, to keep the default run inside CI's time.
@pytest.mark.parametrize("spec", [SpecConfig(3, 4, 8),
                                  pytest.param(SpecConfig(3, 4, 8, "calibrated"),
                                               marks=pytest.mark.slow),
                                  pytest.param(SpecConfig.chain(3), marks=pytest.mark.slow)],
                         ids=["tree", "tree-calibrated", "chain"])
def test_speculative_sampling_matches_enumeration(target, exact, spec, rank_model):
    from jspec.drafters.calibration import attach
    drafter = random_drafter("eagle1", target.config, jax.random.key(2))
    if spec.selection == "calibrated":
        drafter = attach(drafter, rank_model(target.config.vocab_size))
    toks, res = sample(target, drafter, spec, seed=1)
    p, cells = pvalue(toks, exact)
    assert p > 1e-3, (p, cells)
    # Drafts must really be accepted (thousands of times), or this only tests plain sampling.
    hist = np.sum([s["accept_hist"] for s in res.stats], 0)
    assert hist[2:].sum() > 1000, hist


@pytest.mark.slow
def test_ngram_sampling_matches_enumeration(target, exact):
    """Prompt lookup drafts deterministic tokens from the row's own history: the tree rule
    keeps the output distributed exactly as the target's."""
    from jspec.drafters import ngram_drafter
    toks, res = sample(target, ngram_drafter(target.config), SpecConfig(3, 2, 6), seed=2)
    p, cells = pvalue(toks, exact)
    assert p > 1e-3, (p, cells)
    hist = np.sum([s["accept_hist"] for s in res.stats], 0)
    assert hist[2:].sum() > 1000, hist


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SpecConfig(3, 2, 6), SpecConfig.chain(3)],
                         ids=["tree", "chain"])
def test_draft_model_sampling_matches_enumeration(target, exact, spec):
    """An independent draft model (the target's first layer, cut off) drafts from its own
    tokens and KV: the output stays distributed exactly as the target's."""
    from jspec.drafters import Drafter
    from jspec.drafters.draft_model import from_target
    cut = jspec.Target(target.config.replace(num_layers=1),
                       {k: v for k, v in target.params.items() if k != "layers_1"})
    toks, res = sample(target, Drafter(*from_target(cut, target.config)), spec, seed=3)
    p, cells = pvalue(toks, exact)
    assert p > 1e-3, (p, cells)
    hist = np.sum([s["accept_hist"] for s in res.stats], 0)
    assert hist[2:].sum() > 1000, hist


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SpecConfig(3, 4, 8), SpecConfig.chain(3)],
                         ids=["tree", "chain"])
def test_dflash_sampling_matches_enumeration(target, exact, spec):
    """A block drafter's deterministic per-position drafts (top-k of one parallel forward):
    the output stays distributed exactly as the target's. A random head drafts about its
    mask token at every position, whatever its weights, so the mask token is the target's
    likeliest first token: then drafts are accepted often, at every depth."""
    likeliest = int(np.argmax(exact.sum((1, 2))))
    drafter = random_drafter("dflash", target.config, jax.random.key(4), block_size=4,
                             mask_token_id=likeliest)
    toks, res = sample(target, drafter, spec, seed=3)
    p, cells = pvalue(toks, exact)
    assert p > 1e-3, (p, cells)
    hist = np.sum([s["accept_hist"] for s in res.stats], 0)
    assert hist[2:].sum() > 1000, hist
