"""The engine's logprobs: each request gets the target's logprobs of its own tokens (the
teacher-forced forward's, within 1e-4), cut to the k it asked for, streamed with its deltas
and whole in its completion, whatever its slot and neighbours (ragged prompts and limits,
requests with and without logprobs side by side), plain and speculative; prompt logprobs
(echo) are the same forward's, first entry None; bad asks are refused up front."""

import json

import jax
import pytest

from jspec.checkpoint import load_target
from jspec.drafters import ngram_drafter, random_drafter
from jspec.engine import Engine, Request
from jspec.scoring import teacher_forced
from jspec.spec_config import SpecConfig

from helpers.logprob_checks import assert_target_logprobs

LIMITS = [13, 17, 5, 9]
ASK = [4, 2, None, 0]                 # per request: logprobs k (None: none)


@pytest.fixture(scope="module")
def stories(stories_dir):
    target = load_target(stories_dir)
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    prompts = [c["prompt_token_ids"] for c in cases[:4]]
    return target, prompts


def _requests(prompts, echo=(False, False, False, True)):
    return [Request(p, LIMITS[i], stop_ids=[], id=i, logprobs=ASK[i], prompt_logprobs=echo[i])
            for i, p in enumerate(prompts)]


def _check(target, prompts, deltas):
    done = {d.index: d.completion for d in deltas if d.done}
    assert sorted(done) == list(range(len(prompts)))
    for i, c in done.items():
        streamed = [d for d in deltas if d.index == i]
        if ASK[i] is None:
            assert c.logprobs is None and all(d.logprobs is None for d in streamed)
            continue
        for d in streamed:                       # aligned with each delta's tokens
            assert [e.token for e in d.logprobs] == d.tokens
        assert [e for d in streamed for e in d.logprobs] == c.logprobs
        assert_target_logprobs(target, [prompts[i]], [c.tokens], [c.logprobs], k=ASK[i])
    return done


CASES = [("plain", None), ("eagle3", None), ("eagle3", SpecConfig.chain(3)), ("ngram", None),
         pytest.param("mtp", None, marks=pytest.mark.slow),
         pytest.param("medusa", None, marks=pytest.mark.slow),
         pytest.param("dflash", SpecConfig(4, 2, 6), marks=pytest.mark.slow),
         pytest.param("model", None, marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind,spec", CASES)
def test_requests_get_the_targets_logprobs(stories, kind, spec):
    target, prompts = stories
    drafter = None if kind == "plain" else ngram_drafter(target.config) if kind == "ngram" \
        else random_drafter(kind, target.config, jax.random.key(7),
                            **({"num_heads": 4} if kind == "medusa" else {}))
    # Two slots for four requests: rows are refilled, chunks are short (several deltas each).
    eng = Engine(target, drafter, slots=2, spec=spec, max_new_tokens=20, chunk=2, logprobs_k=4)
    done = _check(target, prompts, list(eng.stream(_requests(prompts))))
    ref = teacher_forced(target, prompts[3], 0)
    assert done[3].prompt_logprobs[0] is None and len(ref) == len(done[3].prompt_logprobs)
    for a, b in zip(done[3].prompt_logprobs[1:], ref[1:]):
        assert a.token == b.token and abs(a.logprob - b.logprob) <= 1e-4 and a.top == []
    assert all(done[i].prompt_logprobs is None for i in (0, 1, 2))
    assert eng.pages.free == eng.pages.num_pages
    if kind == "ngram":         # it accepts drafts here: accepted nodes and bonus covered
        assert max(c.stats["mean_accept_len"] for c in done.values()) > 1.2


def test_reading_past_the_window(stories):
    """A delta with more new tokens than the read-back window holds (module doc of
    jspec.engine.logprob_host) is read from the whole buffer, the same entries."""
    target, prompts = stories
    eng = Engine(target, slots=2, max_new_tokens=20, chunk=4, logprobs_k=4)
    eng._lp.reader.width = 2
    _check(target, prompts, list(eng.stream(_requests(prompts))))


def test_score_equals_the_teacher_forced_forward(stories):
    target, prompts = stories
    eng = Engine(target, slots=1, max_new_tokens=8, prompt_bucket=8)      # logprobs_k off
    for ids in (prompts[0], prompts[1][:3] + prompts[0], prompts[0][:1]):
        got, ref = eng.score(ids, 20), teacher_forced(target, ids, 20)
        assert got[0] is None and ref[0] is None and len(got) == len(ids)
        for a, b in zip(got[1:], ref[1:]):
            assert a.token == b.token and abs(a.logprob - b.logprob) <= 1e-4
            assert len(a.top) == 20
            assert max(abs(x[1] - y[1]) for x, y in zip(a.top, b.top)) <= 1e-4
    # An echo request with logprobs asked for is refused without logprobs_k; echo alone is not.
    out = eng.generate([Request(prompts[0], 3, stop_ids=[], prompt_logprobs=True)])[0]
    assert len(out.prompt_logprobs) == len(prompts[0]) and out.logprobs is None
    with pytest.raises(ValueError):
        eng.score([], 0)
    with pytest.raises(ValueError):
        eng.score([1, 2], 21)


def test_bad_asks_are_refused(stories):
    target, prompts = stories
    off = Engine(target, slots=1, max_new_tokens=8)
    assert off.logprobs_k is None
    with pytest.raises(ValueError, match="logprobs_k"):
        off.check(Request(prompts[0], 4, logprobs=0))
    on = Engine(target, slots=1, max_new_tokens=8, logprobs_k=3)
    on.check(Request(prompts[0], 4, logprobs=3))
    for bad in (4, -1, 2.5):
        with pytest.raises(ValueError, match="logprobs"):
            on.check(Request(prompts[0], 4, logprobs=bad))
    with pytest.raises(ValueError, match="logprobs_k"):
        Engine(target, slots=1, max_new_tokens=8, logprobs_k=21)


def test_off_keeps_no_buffers(stories):
    target, _ = stories
    eng = Engine(target, slots=2, max_new_tokens=8)
    eng.warm(longest_prompt=16)
    assert eng.state.core.logprobs is None
    on = Engine(target, slots=2, max_new_tokens=8, logprobs_k=2)
    on.warm(longest_prompt=16)
    assert on.state.core.logprobs.top.shape[::2] == (2, 2)
