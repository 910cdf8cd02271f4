"""Prompt lookup (jspec.drafters.ngram): what it proposes, and that generation with it is
exactly plain decoding (greedy here; sampling in test_spec_sampling.py)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.checkpoint import load_target
from jspec.drafters import NGram, ngram_drafter
from jspec.spec_config import SpecConfig, SpecConfigError


def state_of(rows, lens):
    m = NGram(50)
    st = m.init_state(len(rows), jnp.zeros((len(rows), 4), jnp.int32), 8, 8)
    width = max(map(len, rows))
    seq = jnp.array([r + [0] * (width - len(r)) for r in rows])
    return m, m.prefill({}, None, st, None, seq, jnp.array(lens))


def test_proposes_the_continuation_of_the_latest_longest_match():
    m, st = state_of([[1, 2, 3, 4, 1, 2, 3], [7, 8, 9, 7, 8, 10, 7, 8]], [7, 8])
    root = st.history[jnp.arange(2), st.length - 1]
    chain = m.propose({}, None, st, root, SpecConfig.chain(4))
    assert chain.tokens[0].tolist() == [3, 4, 1, 2, 3]
    assert chain.tokens[1, :4].tolist() == [8, 10, 7, 8]      # "7 8" last seen before 10
    tree = m.propose({}, None, st, root, SpecConfig(3, 2, 5))
    # Row 1: a second branch from the older match of "7 8" (next token 9), under the root.
    assert tree.tokens[1].tolist() == [8, 10, 7, 8, 9] and tree.parents[1, 4] == 0
    # Appending the accepted tokens moves the history on.
    st2 = m.extend({}, None, st, None, jnp.array([[4, 1, 0], [10, 0, 0]]), jnp.array([2, 1]))
    assert st2.length.tolist() == [9, 9] and st2.history[0, 7:9].tolist() == [4, 1]


@pytest.fixture(scope="module")
def stories(stories_dir):
    target = load_target(stories_dir)
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    return target, [c["prompt_token_ids"] for c in cases[:4]]


@pytest.mark.parametrize("spec", [SpecConfig.chain(4), SpecConfig(4, 3, 10)], ids=["chain", "tree"])
def test_greedy_identical_to_plain(stories, spec):
    target, prompts = stories
    limits = [60, 17, 33, 25]
    plain = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[])
    res = jspec.generate(target, prompts, max_new_tokens=limits, stop_ids=[],
                         drafter=ngram_drafter(target.config), spec=spec)
    assert res.tokens == plain.tokens
    assert sum(np.sum([s["accept_hist"] for s in res.stats], 0)[2:]) > 0   # drafts accepted


def test_refuses_impossible_knobs_before_compiling(stories):
    target, prompts = stories
    with pytest.raises(SpecConfigError, match="ngram tree"):
        jspec.generate(target, prompts[:1], drafter=ngram_drafter(target.config),
                       spec=SpecConfig(2, 4, 12))
    with pytest.raises(ValueError, match="min_n"):
        ngram_drafter(target.config, 3, 2)


@pytest.mark.slow
def test_repetitive_prompt_on_the_shipped_model_accepts_three_tokens_per_verify():
    """Prompt lookup pays where text repeats: a list of similar entries on the shipped model
    (measured 3.1 tokens per verify for chain(4), 3.6 for chain(6); plain decoding's tokens)."""
    from pathlib import Path
    target = load_target(Path(__file__).parents[2] / "checkpoints/default/target")
    prompt = "NAMES = [\n" + "".join(f"    'name_{i}',\n" for i in range(8))
    plain = jspec.generate(target, [prompt], max_new_tokens=96)
    res = jspec.generate(target, [prompt], max_new_tokens=96, drafter=ngram_drafter(target.config),
                         spec=SpecConfig.chain(4))
    assert res.tokens == plain.tokens
    s = res.stats[0]
    assert s["new_tokens"] / s["iterations"] >= 3.0, s
