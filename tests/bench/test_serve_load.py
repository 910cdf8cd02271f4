"""``python -m jspec.bench serve-load`` (benchmarks/serve_load.py), small: the shipped default
model served with its EAGLE-3 drafter and 8 slots, 8 clients sending 120 mixed requests (a
tenth cancelled mid-stream, a tenth malformed). Every correctness check of the table must
pass: answered exactly once, greedy equal to ``jspec.generate`` alone, malformed ones a 400 in
OpenAI's error shape, the server healthy afterwards. Slow (the server and the engine compile):
run with ``-m slow``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from benchmarks import serve_load  # noqa: E402
from jspec.bench import registry  # noqa: E402


def test_serve_load_is_registered():
    assert registry.find("serve-load") is serve_load.COMMAND


def test_workload_mix():
    items = serve_load.make_workload(200, ["a", "b"], "default", True, 4, 32, 0)
    kinds = [it.kind for it in items]
    assert kinds.count("cancel") == 20 and kinds.count("bad") == 20
    ok = [it for it in items if it.kind == "ok"]
    assert {it.path for it in ok} == {"/v1/completions", "/v1/chat/completions"}
    assert {bool(it.body["stream"]) for it in ok} == {True, False}
    assert {it.greedy for it in ok} == {True, False}
    assert all(4 <= it.body["max_tokens"] <= 32 for it in ok)
    assert all("seed" in it.body for it in ok if not it.greedy)
    assert all(it.body["stream"] for it in items if it.kind == "cancel")
    no_chat = serve_load.make_workload(50, ["a"], "default", False, 4, 32, 0)
    assert all(it.path == "/v1/completions" for it in no_chat if it.kind != "bad")


@pytest.mark.slow
def test_serve_load_small_passes(tmp_path, capsys):
    import argparse
    p = argparse.ArgumentParser()
    serve_load.add_args(p)
    out = tmp_path / "load.json"
    a = p.parse_args(["--clients", "8", "--requests", "120", "--rss-window", "40",
                      "--json", str(out)])
    payload = serve_load.main(a)               # SystemExit(1) on a failed check
    table = capsys.readouterr().out
    assert payload["passed"], table
    checks = {r["check"]: r for r in payload["rows"]}
    for name in ("well-formed answered exactly once", "greedy = jspec.generate alone",
                 "malformed -> 400, OpenAI error shape", "server healthy after the load"):
        assert checks[name]["ok"] is True, table
    assert payload["engine"]["tok_s"] > 0 and payload["server_tok_s"] > 0
    assert payload["ttft_ms"]
    assert json.loads(out.read_text())["passed"]
