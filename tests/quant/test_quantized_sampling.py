"""Sampling from a quantized (int8, bf16) target, plain and speculative, has the quantized
target's own distribution: over the first 3 tokens of a vocabulary-16 target, enumerated
exactly from its forward, a chi-square test."""

import jax
import numpy as np
import pytest
from helpers.enumerated import PROMPT, SAMPLING, V, joint, pair_logits, pvalue, sharp_target

import jspec
from jspec.drafters import random_drafter
from jspec.checkpoint import quantize_target
from jspec.sampling import SamplingConfig, target_probs
from jspec.spec_config import SpecConfig

ROWS = 20_000


@pytest.fixture(scope="module", params=["int8", "bf16"])
def target(request):
    return quantize_target(sharp_target(), request.param)


@pytest.fixture(scope="module")
def exact(target):
    """P(x1, x2, x3 | prompt) of the quantized target, all 256 (x1, x2) enumerated."""
    probs = np.asarray(target_probs(pair_logits(target), SamplingConfig(**SAMPLING)), np.float64)
    n = len(PROMPT)
    return joint(probs[0, n - 1], probs[::V, n], probs[:, n + 1].reshape(V, V, V))


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
