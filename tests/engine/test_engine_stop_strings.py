"""Stop strings in the engine, on a tiny random target with a character tokenizer (every
token one character, so a stop string of several characters spans tokens): a match ends
the request with finish_reason "stop", its text cut before the string and its tokens kept
up to the one that completed it; the slot is freed though its device row never stopped, and
the requests after it (and beside it) come out as without it; the streamed text joins to
the completion's text (a held-back start is never streamed, then retracted)."""

import threading

import jax
import pytest

from helpers.chat_targets import chat_target
from jspec import decode
from jspec.drafters import random_drafter
from jspec.engine import Engine, Request

# The tiny random model repeats itself: "mememe...", "-'dcdc...", "3 3 3...", "dcdc...",
# "meme...", "45meme...". Per request: a string spanning tokens; one never completing (its
# "d" is held back, then streamed: "#" never comes); none; two where the later-starting
# "cdc" completes first; one of two; one across the "5m" boundary.
PROMPTS = ["once upon a time", "the cat sat", "hello there, ", "a b c", "why? because", "xyz"]
STOPS = [["emem"], ["d#"], None, ["dcdcd", "cdc"], ["zzz", "e"], ["5me"]]
LIMIT = 24


@pytest.fixture(scope="module")
def target():
    return chat_target(template=None)


@pytest.fixture(scope="module")
def ref(target):
    """Every prompt's greedy continuation, to its limit (no stop ids)."""
    eng = Engine(target, slots=2, max_new_tokens=LIMIT, chunk=3)
    return eng.generate([Request(p, LIMIT, stop_ids=[]) for p in PROMPTS])


def expected(tok, tokens, stops):
    """The first k tokens whose text holds a stop string, and that text cut before it."""
    for k in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:k])
        ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
        if ends:
            return tokens[:k], text[:min(ends)[1]]
    return tokens, tok.decode(tokens)


def run(eng, reqs, live: bool):
    """Each request's (done delta, its deltas), through stream() or the live loop."""
    deltas = {}
    if not live:
        for d in eng.stream(reqs):
            deltas.setdefault(d.id, []).append(d)
        return deltas
    all_done = threading.Event()

    def on_delta(d):
        deltas.setdefault(d.id, []).append(d)
        if sum(x[-1].done for x in deltas.values()) == len(reqs):
            all_done.set()

    eng.start(on_delta)
    for r in reqs:
        eng.submit(r)
    assert all_done.wait(300)
    eng.stop()
    return deltas


@pytest.mark.parametrize("kind,live", [("plain", False), ("eagle3", False), ("eagle3", True)])
def test_stop_strings_cut_the_text_and_free_the_slot(target, ref, kind, live):
    drafter = None if kind == "plain" else random_drafter("eagle3", target.config,
                                                          jax.random.key(7))
    eng = Engine(target, drafter, slots=2, max_new_tokens=LIMIT, chunk=3)
    eng.warm(longest_prompt=max(len(target.tokenizer.encode(p)) for p in PROMPTS))
    before = dict(decode.TRACE_COUNTS)
    stops = STOPS
    reqs = [Request(p, LIMIT, stop_ids=[], stop=s, id=i) for i, (p, s) in
            enumerate(zip(PROMPTS, stops))]
    deltas = run(eng, reqs, live)
    tok = target.tokenizer
    for i, c in enumerate(ref):
        last = deltas[i][-1]
        got = last.completion
        tokens, text = expected(tok, c.tokens, stops[i] or [])
        assert (got.tokens, got.text) == (tokens, text), (i, stops[i], c.text)
        assert last.finish_reason == got.finish_reason == \
            ("stop" if len(tokens) < len(c.tokens) or stops[i] and text != c.text else "length")
        assert "".join(d.text for d in deltas[i]) == got.text          # never retracted
        assert sum((d.tokens for d in deltas[i]), []) == got.tokens
    # The cases do what they say (the model's text is as the comment on STOPS has it).
    cut = {i: (len(deltas[i][-1].completion.tokens), deltas[i][-1].completion.text)
           for i in range(len(PROMPTS))}
    assert cut == {0: (5, "m"), 1: (LIMIT, ref[1].text), 2: (LIMIT, ref[2].text), 3: (4, "d"),
                   4: (2, "m"), 5: (4, "4")}
    assert eng.live == 0 and eng.pages.free == eng.pages.num_pages
    assert dict(decode.TRACE_COUNTS) == before


def test_finish_reasons_of_stop_ids_and_length(target, ref):
    eng = Engine(target, slots=2, max_new_tokens=LIMIT, chunk=3)
    stop_id = ref[1].tokens[2]                      # "d", first at 2 in "-'dcdc..."
    assert stop_id not in ref[1].tokens[:2]
    out = eng.generate([Request(PROMPTS[1], LIMIT, stop_ids=[stop_id]),
                        Request(PROMPTS[0], 5, stop_ids=[])])
    assert out[0].finish_reason == "stop" and out[0].tokens == ref[1].tokens[:3]
    assert out[1].finish_reason == "length" and out[1].tokens == ref[0].tokens[:5]


def test_bad_stop_strings_are_refused_before_anything_runs(target):
    eng = Engine(target, slots=1, max_new_tokens=8)
    for bad in ([""], ["ok", ""], [3]):
        with pytest.raises(ValueError, match="stop string"):
            eng.check(Request("hi", stop=bad))
        with pytest.raises(ValueError, match="stop string"):
            eng.submit(Request("hi", stop=bad))
    assert eng.live == 0 and eng.state is None          # nothing queued, nothing compiled
