"""Per-request sampling: temperature, top-k and top-p are runtime values of a slot, so greedy
and sampled requests share one batch and one set of compiled programs. Every request's
tokens equal ``generate`` of it alone with its own settings and seed (greedy: plain greedy
decoding), for plain decoding and an EAGLE-3 tree, whatever its slot and neighbours; a
greedy-only engine traces no sampling; ``jspec run`` serves a mixed file with one engine."""

import argparse
import json

import jax
import pytest

import jspec
from jspec import decode
from jspec.checkpoint import load_target
from jspec.drafters import random_drafter
from jspec.engine import Engine, Request
from jspec.sampling import SamplingConfig
from jspec.spec_config import SpecConfig

# (temperature, top_k, top_p) per request; None: the engine's default (greedy). top_k 300 is
# past the 256 static candidates of a 512-token vocabulary: the exact full-sort fallback.
SETTINGS = [None, (0.8, 0, 1.0), (1.0, 5, 1.0), (0.0, 0, 0.5), (1.2, 0, 0.9), (1.5, 1, 1.0),
            (0.9, 300, 0.95)]
LIMITS = [14, 9, 16, 11, 13, 10, 15]
MIXED = SamplingConfig(per_request=True)


@pytest.fixture(scope="module")
def stories(stories_dir):
    target = load_target(stories_dir)
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    prompts = [c["prompt_token_ids"] for c in cases]
    prompts = (prompts + [p[:4] for p in prompts])[:len(SETTINGS)]
    return target, prompts


def request(prompts, i):
    kw = {} if SETTINGS[i] is None else dict(zip(("temperature", "top_k", "top_p"), SETTINGS[i]))
    return Request(prompts[i], LIMITS[i], seed=50 + i, stop_ids=[], id=i, **kw)


@pytest.fixture(scope="module")
def alone(stories):
    """Each request through ``generate`` alone (a static batch of one) with its own settings
    and seed: the reference every engine must give token for token."""
    target, prompts = stories
    out = {}
    for i, s in enumerate(SETTINGS):
        t, k, p = (0.0, 0, 1.0) if s is None else s
        out[i] = jspec.generate(target, [prompts[i]], max_new_tokens=LIMITS[i], stop_ids=[],
                                temperature=t, top_k=k, top_p=p, seed=50 + i).tokens[0]
    return out


def test_mixed_settings_plain_engine_equal_generate_alone(stories, alone):
    target, prompts = stories
    eng = Engine(target, slots=3, sampling=MIXED, max_new_tokens=16, chunk=3)
    out = eng.generate([request(prompts, i) for i in range(len(SETTINGS))])
    assert {c.id: c.tokens for c in out} == alone
    # The settings matter: the sampled rows are not the greedy ones.
    greedy = jspec.generate(target, prompts[1:3], max_new_tokens=9, stop_ids=[]).tokens
    assert [alone[1][:9], alone[2][:9]] != greedy


def test_mixed_settings_eagle3_tree_equal_generate_alone_whatever_the_neighbours(stories, alone):
    target, prompts = stories
    drafter = random_drafter("eagle3", target.config, jax.random.key(7))
    eng = Engine(target, drafter, slots=3, spec=SpecConfig(4, 3, 6), sampling=MIXED,
                 max_new_tokens=16, chunk=2)
    out = eng.generate([request(prompts, i) for i in (4, 0, 6, 2, 5, 1, 3)], order="arrival")
    assert {c.id: c.tokens for c in out} == alone
    before = dict(decode.TRACE_COUNTS)
    # Other slots, other neighbours (a subset, another order): the same tokens, nothing new
    # compiled.
    few = eng.generate([request(prompts, i) for i in (6, 3, 1)], order="arrival")
    assert {c.id: c.tokens for c in few} == {i: alone[i] for i in (1, 3, 6)}
    assert dict(decode.TRACE_COUNTS) == before


def test_a_request_alone_in_every_slot_gives_the_same_tokens(stories, alone):
    """A sampled request in slot 0, 1 or 2 beside greedy or sampled neighbours."""
    target, prompts = stories
    eng = Engine(target, slots=3, sampling=MIXED, max_new_tokens=16, chunk=4)
    for lead in ([], [0], [0, 2]):
        out = eng.generate([request(prompts, i) for i in lead + [4]], order="arrival")
        assert {c.id: c.tokens for c in out} == {i: alone[i] for i in lead + [4]}


def test_greedy_engine_traces_no_sampling_and_refuses_sampled_requests(stories, alone):
    target, prompts = stories
    eng = Engine(target, slots=2, max_new_tokens=16)
    eng._ensure_state()
    assert eng.state.core.sampling is None                 # no settings kept, none traced
    with pytest.raises(ValueError, match="request 1: temperature=0.8 samples.*per_request"):
        eng.check(request(prompts, 1))
    # Greedy settings are fine on a greedy engine.
    out = eng.generate([request(prompts, i) for i in (0, 3, 5)])
    assert {c.id: c.tokens for c in out} == {i: alone[i] for i in (0, 3, 5)}
    # A sampled default samples every request that gives no settings of its own.
    sampled = Engine(target, slots=2, sampling=SamplingConfig(0.8), max_new_tokens=16)
    r = Request(prompts[1], LIMITS[1], seed=51, stop_ids=[], id=1)
    assert sampled.generate([r])[0].tokens == alone[1]


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -0.5, "temperature must be a number >= 0"),
    ("temperature", float("nan"), "temperature must be a number >= 0"),
    ("top_k", -1, "top_k must be an integer >= 0"),
    ("top_k", 2.5, "top_k must be an integer >= 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_p", "high", r"top_p must be in \(0, 1\]"),
])
def test_bad_sampling_values_are_refused_by_name(stories, field, value, match):
    target, prompts = stories
    eng = Engine(target, slots=1, sampling=MIXED, max_new_tokens=4, max_len=64)
    with pytest.raises(ValueError, match=f"request r7: {match}"):
        eng.check(Request(prompts[0], 2, id="r7", **{field: value}))
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**{field: value})


def test_runner_serves_a_mixed_file_with_one_engine(stories, stories_dir, alone, tmp_path,
                                                    monkeypatch):
    from jspec.engine import runner

    target, prompts = stories
    lines = []
    for i, s in enumerate(SETTINGS):
        rec = {"id": f"r{i}", "prompt_ids": prompts[i], "max_new_tokens": LIMITS[i],
               "seed": 50 + i, "stop": []}
        if s is not None:
            rec.update(temperature=s[0], top_k=s[1], top_p=s[2])
        lines.append(json.dumps(rec))
    lines.append(json.dumps({"id": "bad", "prompt_ids": [1, 2], "top_p": 0}))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    built = []

    class Counted(Engine):
        def __init__(self, *a, **kw):
            built.append(kw["sampling"])
            super().__init__(*a, **kw)

    monkeypatch.setattr("jspec.engine.Engine", Counted)
    p = argparse.ArgumentParser()
    runner.add_args(p)
    args = p.parse_args(["--model", str(stories_dir), "--input", str(src), "--output", str(dst),
                         "--slots", "3", "--chunk", "2", "--kernels", "reference",
                         "--no-progress"])
    assert runner.run(args, target=target) == 0
    assert len(built) == 1 and built[0].may_sample          # one engine for every setting
    got = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert {f"r{i}": got[f"r{i}"]["token_ids"] for i in range(len(SETTINGS))} == \
        {f"r{i}": t for i, t in alone.items()}
    assert "top_p must be in (0, 1]" in got["bad"]["error"]
