"""NaN or inf logits never become tokens (issue 14's bug class): the row stops with
``nonfinite_logits`` where plain decoding would first read a non-finite logit, keeps what it
emitted before, and ``generate`` logs which rows. A drafter's NaN only costs acceptance."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters import Drafter, Oracle, ngram_drafter, random_drafter
from jspec.llama import init_params
from jspec.spec_config import SpecConfig

CFG = jspec.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
PROMPT = [3, 4, 5, 6, 7]
NEW = 24


@pytest.fixture(scope="module")
def poisoned():
    """``(clean, poisoned target, plain tokens, k)``: the poisoned target's embedding row of
    ``t = plain[k]`` is NaN, so the first position that feeds ``t`` yields NaN logits."""
    params = init_params(CFG, jax.random.key(3))
    clean = jspec.Target(CFG, params)
    plain = jspec.generate(clean, [PROMPT], max_new_tokens=NEW, stop_ids=[]).tokens[0]
    k = next(i for i in range(2, NEW) if plain[i] not in PROMPT + plain[:i])
    emb = params["embed_tokens"]["embedding"].at[plain[k]].set(jnp.nan)
    bad = jspec.Target(CFG, {**params, "embed_tokens": {"embedding": emb}})
    return clean, bad, plain, k


def oracle(future_rows):
    fut = np.zeros((1, 128), np.int32)
    fut[0, :len(future_rows)] = future_rows
    return Drafter(Oracle(CFG.vocab_size), {"future": jnp.asarray(fut)})


def drafters(plain):
    return {"plain": (None, None),
            "oracle tree": (oracle(PROMPT + plain + [0] * 8), SpecConfig(4, 2, 8)),
            "oracle chain": (oracle(PROMPT + plain + [0] * 8), SpecConfig.chain(4)),
            "ngram": (ngram_drafter(CFG), SpecConfig.chain(3))}


@pytest.mark.parametrize("how", ["plain", "oracle tree", "oracle chain", "ngram"])
def test_greedy_row_stops_where_plain_decoding_meets_nan(poisoned, how, caplog):
    _, bad, plain, k = poisoned
    drafter, spec = drafters(plain)[how]
    other = [9, 10, 11]      # a second row, stopped only by its own tokens
    clean_other = jspec.generate(poisoned[0], [other], max_new_tokens=NEW, stop_ids=[]).tokens[0]
    assert plain[k] not in other
    j = clean_other.index(plain[k]) if plain[k] in clean_other else None
    with caplog.at_level(logging.WARNING, logger="jspec"):
        res = jspec.generate(bad, [PROMPT, other], max_new_tokens=NEW, stop_ids=[],
                             drafter=drafter, spec=spec)
    # The poisoned token was decided by finite logits, so it is emitted; nothing after it.
    assert res.tokens[0] == plain[:k + 1]
    assert res.stats[0]["stop_reason"] == "nonfinite_logits"
    if j is None:
        assert res.tokens[1] == clean_other and res.stats[1]["stop_reason"] == "max_new_tokens"
        assert "rows [0] stopped early" in caplog.text
    else:
        assert res.tokens[1] == clean_other[:j + 1]
        assert "rows [0, 1] stopped early" in caplog.text
    assert "NaN or inf" in caplog.text


@pytest.mark.slow     # CI time; run with -m slow
def test_nan_in_the_prompt_emits_nothing(poisoned):
    _, bad, plain, k = poisoned
    for drafter, spec in drafters(plain).values():
        res = jspec.generate(bad, [PROMPT + [plain[k]]], max_new_tokens=8, stop_ids=[],
                             drafter=drafter, spec=spec)
        assert res.tokens == [[]] and res.stats[0]["stop_reason"] == "nonfinite_logits"


@pytest.mark.slow     # CI time; run with -m slow
def test_sampled_rows_never_emit_from_nan_logits(poisoned):
    _, bad, plain, k = poisoned
    t = plain[k]
    for drafter, spec in drafters(plain).values():
        res = jspec.generate(bad, [PROMPT] * 4, max_new_tokens=NEW, stop_ids=[], temperature=1.0,
                             seed=5, drafter=drafter, spec=spec)
        for toks, st in zip(res.tokens, res.stats):
            assert all(0 <= x < CFG.vocab_size for x in toks)
            # A row stops right after it emits the poisoned token, and only then.
            assert (t in toks) == (st["stop_reason"] == "nonfinite_logits"), (toks, st)
            assert t not in toks[:-1]


def test_a_nan_drafter_only_costs_acceptance(poisoned):
    clean, _, plain, _ = poisoned
    d = random_drafter("eagle3", CFG, jax.random.key(0))
    d = Drafter(d.module, jax.tree_util.tree_map(
        lambda x: jnp.full_like(x, jnp.nan) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        d.params))
    res = jspec.generate(clean, [PROMPT], max_new_tokens=NEW, stop_ids=[], drafter=d)
    assert res.tokens[0] == plain and res.stats[0]["stop_reason"] == "max_new_tokens"
