"""The engine taking requests while it runs (:mod:`jspec.engine.live`): requests submitted
from several threads while the loop runs come out as ``generate`` gives them alone (plain
and EAGLE-3), a cancelled request (pending or running) frees its slot and pages and ends
"cancelled" without disturbing its neighbours, the idle loop waits instead of spinning, a
failure in the loop is surfaced, and nothing compiles anew as requests come and go."""

import json
import threading
import time

import jax
import numpy as np
import pytest

import jspec
from jspec import decode
from jspec.checkpoint import load_target
from jspec.drafters import random_drafter
from jspec.engine import Engine, Request

LIMITS = [23, 5, 31, 12, 17, 28]


@pytest.fixture(scope="module")
def stories(stories_dir):
    target = load_target(stories_dir)
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    prompts = [c["prompt_token_ids"] for c in cases]
    prompts = prompts + [prompts[1][:3] + prompts[0][1:4]]          # 6 prompts, ragged
    ref = jspec.generate(target, prompts, max_new_tokens=LIMITS, stop_ids=[]).tokens
    return target, prompts, ref


class Collector:
    """``on_delta``: every delta by request id; ``wait(n)`` for n requests done."""

    def __init__(self):
        self.deltas, self.done = {}, {}
        self.cond = threading.Condition()

    def __call__(self, d):
        with self.cond:
            self.deltas.setdefault(d.id, []).append(d)
            if d.done:
                self.done[d.id] = d
                self.cond.notify_all()

    def wait(self, n, timeout=300):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.done) >= n, timeout), self.done.keys()


def request(prompts, i, **kw):
    return Request(prompts[i], LIMITS[i], stop_ids=[], id=f"r{i}", **kw)


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_threads_submit_while_running_equals_generate(stories, kind):
    target, prompts, ref = stories
    drafter = None if kind == "plain" else random_drafter("eagle3", target.config,
                                                          jax.random.key(7))
    eng = Engine(target, drafter, slots=2, max_new_tokens=32, chunk=4)
    eng.warm(longest_prompt=max(map(len, prompts)))
    before = dict(decode.TRACE_COUNTS)
    got = Collector()
    eng.start(got)
    ids = {}

    def client(which):
        for i in which:
            ids[i] = eng.submit(request(prompts, i))
            time.sleep(0.05)

    threads = [threading.Thread(target=client, args=(w,)) for w in ([0, 3], [1, 4], [2, 5])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got.wait(len(prompts))
    eng.stop()
    assert ids == {i: f"r{i}" for i in range(6)}
    for i in range(6):
        d = got.done[f"r{i}"]
        assert d.completion.tokens == ref[i], i
        assert sum((x.tokens for x in got.deltas[f"r{i}"]), []) == ref[i]   # streamed in full
        assert d.finish_reason == d.completion.finish_reason == "length"
        assert d.completion.stats["latency_s"] >= d.completion.stats["first_token_s"] > 0
    assert eng.live == 0 and eng.pages.free == eng.pages.num_pages
    assert dict(decode.TRACE_COUNTS) == before            # nothing compiled as they came


def test_cancel_pending_and_running_frees_slots_and_pages(stories):
    """Four slots running r0, r1, r2, r5 and r3 pending; on r0's first delta r2 and r5
    (running) and r3 (pending) are cancelled and r4, whose longer need takes the pages
    both cancelled rows gave back, is submitted. Its slot's neighbour in the padded bucket
    is a cancelled row that never stopped on the device: blanked before the next chunk, it
    writes nothing into r4's pages, so r0, r1 and r4 equal generate alone."""
    target, prompts, ref = stories
    eng = Engine(target, slots=4, max_new_tokens=32, chunk=2, page_size=4)
    eng.warm(longest_prompt=max(map(len, prompts)))
    before = dict(decode.TRACE_COUNTS)
    got = Collector()
    fired, stale = [], []

    def on_delta(d):
        got(d)
        if not d.done:
            # Between chunks every free slot's device row holds no pages (a cancelled row
            # was blanked before the chunk), so no padded row can write into another's.
            free = [s for s, lv in enumerate(eng._slots) if lv is None]
            table = np.asarray(eng.state.core.cache.page_table)[free]
            stale.extend(s for s, row in zip(free, table) if (row != eng.pages.num_pages).any())
        if d.id == "r0" and not fired:
            fired.append(1)
            assert [eng.cancel(r) for r in ("r2", "r5", "r3", "nope")] == [True] * 3 + [False]
            eng.submit(request(prompts, 4))

    for i in (0, 1, 2, 5, 3):
        eng.submit(request(prompts, i))
    assert eng.live == 5
    eng.start(on_delta)
    got.wait(6)
    eng.stop()
    assert stale == []
    for i in (0, 1, 4):
        assert got.done[f"r{i}"].completion.tokens == ref[i], i
    for i in (2, 3, 5):
        d = got.done[f"r{i}"]
        assert d.finish_reason == d.completion.finish_reason == "cancelled"
        # What it had streamed before the cancel is its completion's tokens.
        assert d.completion.tokens == sum((x.tokens for x in got.deltas[f"r{i}"]), [])
        assert d.completion.tokens == ref[i][:len(d.completion.tokens)]
    assert got.done["r3"].completion.tokens == []         # pending: dropped, never ran
    assert eng.live == 0 and eng.pages.free == eng.pages.num_pages
    assert dict(decode.TRACE_COUNTS) == before
    assert eng.cancel("r0") is False                       # finished: nothing to cancel


def test_idle_loop_waits_and_validates_at_submit(stories):
    target, prompts, ref = stories
    eng = Engine(target, slots=2, max_new_tokens=8, chunk=4)
    # Refused at once, nothing queued.
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.submit(Request(prompts[0], 9))
    with pytest.raises(ValueError, match="tokenizer|empty stop"):
        eng.submit(Request(prompts[0], 4, stop=[""]))
    assert eng.live == 0
    takes = []
    take = eng._intake.take
    eng._intake.take = lambda idle: takes.append(idle) or take(idle)
    eng.start(Collector())
    time.sleep(0.5)
    assert takes == [True]                   # one wait, no spinning
    assert eng.chunk_log == []
    with pytest.raises(RuntimeError, match="running"):
        list(eng.stream([prompts[0]]))
    with pytest.raises(RuntimeError, match="running"):
        eng.warm()
    with pytest.raises(RuntimeError, match="already running"):
        eng.start(Collector())
    eng.submit(Request(prompts[0], 4, id="a"))
    with pytest.raises(ValueError, match="already pending"):
        eng.submit(Request(prompts[1], 4, id="a"))
    t0 = time.time()
    while eng.live and time.time() - t0 < 120:
        time.sleep(0.05)
    eng.stop()                               # the loop was waiting again: it ends
    assert eng.live == 0 and not eng.running
    # Stopped with a request pending: the next start serves it.
    got = Collector()
    rid = eng.submit(Request(prompts[1], 4, stop_ids=[]))
    eng.start(got)
    got.wait(1)
    eng.stop()
    assert got.done[rid].completion.tokens == ref[1][:4]


def test_a_failure_in_the_loop_is_surfaced(stories):
    target, prompts, _ = stories
    eng = Engine(target, slots=1, max_new_tokens=8, chunk=2)
    got = Collector()

    def on_delta(d):
        got(d)
        if not d.done:
            raise KeyError("client went away")

    eng.submit(Request(prompts[0], 8, stop_ids=[], id="a"))
    eng.submit(Request(prompts[1], 8, stop_ids=[], id="b"))
    eng.start(on_delta)
    got.wait(2)
    with pytest.raises(RuntimeError, match="loop failed") as e:
        eng.stop()
    assert isinstance(e.value.__cause__, KeyError)
    assert {d.finish_reason for d in got.done.values()} == {"error"}
    assert eng.live == 0
    with pytest.raises(RuntimeError, match="loop failed"):
        eng.submit(Request(prompts[0], 4))
