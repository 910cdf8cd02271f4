"""Chat messages in the engine (``Request(messages=...)``) and in ``python -m jspec run``
records: rendered through the chat template at admission, stopped at the end of turn; bad
messages are a request's error, not the stream's crash."""

import argparse
import json

import pytest

from helpers.chat_targets import IM_END, chat_target
from jspec import messages
from jspec.engine import Engine, Request
from jspec.engine import runner

CONV = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def target():
    return chat_target()


def test_messages_serve_as_their_rendered_ids(target):
    eng = Engine(target, slots=2, max_new_tokens=12, longest_prompt=64, chunk=4)
    ids = messages.render(target, CONV)
    a, b = eng.generate([Request(messages=CONV, id="m"),
                         Request(ids, stop_ids=[IM_END], id="p")])
    assert a.prompt_ids == ids and a.tokens == b.tokens and a.id == "m"
    c, = eng.generate([Request(messages=CONV, stop_ids=[])])     # stop_ids still override
    assert len(c.tokens) == 12


@pytest.mark.parametrize("req, match", [
    (Request(), "prompt or messages"),
    (Request([1, 2], messages=CONV), "prompt or messages"),
    (Request(messages="hi"), "list of"),
    (Request(messages=[{"content": "x"}]), "string 'role'"),
])
def test_bad_requests_are_refused(target, req, match):
    eng = Engine(target, slots=1, max_new_tokens=4, longest_prompt=64)
    with pytest.raises(ValueError, match=match):
        eng.check(req)


def test_messages_need_a_template():
    eng = Engine(chat_target(None), slots=1, max_new_tokens=4, longest_prompt=64)
    with pytest.raises(ValueError, match="request 7: .*no chat template"):
        eng.check(Request(messages=CONV, id=7))


def run_args(tmp_path, records):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    p = argparse.ArgumentParser()
    runner.add_args(p)
    return p.parse_args(["--model", "unused", "--input", str(src), "--output", str(out),
                         "--slots", "2", "--max-new-tokens", "10", "--kernels", "reference",
                         "--no-progress"]), out


def test_runner_serves_messages_records(target, tmp_path):
    ids = messages.render(target, CONV)
    args, out = run_args(tmp_path, [
        {"id": "chat", "messages": CONV},
        {"id": "ids", "prompt_ids": ids, "stop": [IM_END]},
        {"id": "both", "messages": CONV, "prompt": "x"},
        {"id": "bad", "messages": [{"role": "user"}]},
        {"id": "str", "messages": "hi"},
    ])
    assert runner.run(args, target=target) == 0
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["chat"]["token_ids"] == recs["ids"]["token_ids"]
    assert recs["chat"]["text"] == recs["ids"]["text"]
    assert "one of 'messages'" in recs["both"]["error"]
    assert "content" in recs["bad"]["error"] and "list of" in recs["str"]["error"]


def test_runner_messages_without_a_template_are_error_records(tmp_path):
    args, out = run_args(tmp_path, [{"id": 1, "messages": CONV}])
    assert runner.run(args, target=chat_target(None)) == 0
    rec, = map(json.loads, out.read_text().splitlines())
    assert "no chat template" in rec["error"]
