"""``python -m jspec serve --model smollm2`` (the real model users start with) driven by the
official ``openai`` client, and logprobs on SmolLM2 exact under speculation. Slow: a
SmolLM2 server warms (about a minute here), and one subprocess runs every decoding path.

* ``tests/helpers/smollm2_logprobs.py`` (XLA's full optimisation): for plain decoding, a
  random EAGLE-3 head (chain), n-gram lookup and an oracle (chain and tree: accepted drafts and
  bonus tokens at every offset), greedy with ``logprobs=5`` on three chat prompts, ragged:
  the tokens equal plain decoding's, every logprob and top-5 set equals a teacher-forced
  forward within 1e-4, and ``Engine.score`` (echo) equals it too.
* The server (n-gram speculation, its chat template from the GGUF): chat answers, streamed
  and not, are the greedy tokens' text; their logprobs (``top_logprobs=5``) and echo's
  prompt logprobs equal that same teacher-forced forward.

The model comes from ``python -m jspec models fetch smollm2``; without it the module skips.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from helpers import serve_process, xla_env  # noqa: E402

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).parents[1] / "data" / "smollm2_golden.json"
K = 5
TOL = 1e-4


def _gguf() -> Path:
    from jspec.fetch import FetchError, fetch
    try:
        return fetch("smollm2")
    except FetchError as e:
        pytest.skip(f"SmolLM2 not cached and cannot be fetched: {e}")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-lp") / "logprobs.json"
    script = Path(__file__).parents[1] / "helpers" / "smollm2_logprobs.py"
    p = subprocess.run([sys.executable, str(script), str(_gguf()), str(GOLDEN), str(out)],
                       env=xla_env.full_optimisation(), capture_output=True, text=True,
                       timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def client(ref, tmp_path_factory):
    """Started after ``ref`` has run, so the two never share the CPUs."""
    log = tmp_path_factory.mktemp("serve-smollm2") / "server.log"
    s = serve_process.start(["--model", "smollm2", "--drafter", "ngram", "--slots", "2",
                             "--max-tokens", "32", "--max-prompt-tokens", "128",
                             "--max-logprobs", str(K)], log, env=xla_env.full_optimisation())
    yield openai.OpenAI(base_url=s.base + "/v1", api_key="-", max_retries=0, timeout=300)
    serve_process.stop(s)


@pytest.mark.parametrize("path", ["plain", "eagle3-random-chain", "ngram", "oracle-chain",
                                  "oracle-tree"])
def test_engine_logprobs_equal_teacher_forced(ref, path):
    r = ref["paths"][path]
    assert r["error"] is None, r["error"]
    assert r["tokens_equal_plain"]
    assert r["max_logprob_diff"] <= TOL and r["max_top_diff"] <= TOL, r
    if path.startswith("oracle"):        # accepted drafts of several lengths, bonus after each
        assert sum(1 for n in r["accept_hist"][2:] if n) >= 3, r["accept_hist"]


def test_echo_scoring_equals_teacher_forced(ref):
    assert ref["score_max_logprob_diff"] <= TOL


def _assert_entries(got, want):
    """The server's chat logprobs (objects) against the teacher-forced entries."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.token == w["token"]
        assert abs(g.logprob - w["logprob"]) <= TOL, (g, w)
        assert [t.token for t in g.top_logprobs] == [t for t, _ in w["top"]]
        assert max(abs(t.logprob - v) for t, (_, v) in zip(g.top_logprobs, w["top"])) <= TOL


@pytest.mark.parametrize("row", [0, 1, 2])
def test_chat_answer_and_logprobs(client, ref, row):
    """The answer ends at ``<|im_end|>`` (the template's stop; its logprob is the last entry,
    its text not in the content) or at ``max_tokens``."""
    r = ref["rows"][row]
    n = 20
    out = client.chat.completions.create(model="smollm2", messages=r["messages"],
                                         max_tokens=n, temperature=0, logprobs=True,
                                         top_logprobs=K)
    c, = out.choices
    want = r["logprobs"][len(r["prompt_ids"]):][:n]
    names = [w["token"] for w in want]
    if "<|im_end|>" in names:
        want = want[:names.index("<|im_end|>") + 1]
        assert c.finish_reason == "stop"
        assert c.message.content == "".join(names[:len(want) - 1])
    else:
        assert c.finish_reason == "length" and c.message.content == "".join(names)
    assert out.usage.prompt_tokens == len(r["prompt_ids"])
    assert out.usage.completion_tokens == len(want)
    _assert_entries(c.logprobs.content, want)
    streamed = client.chat.completions.create(model="smollm2", messages=r["messages"],
                                              max_tokens=n, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed
                   if ch.choices) == c.message.content


def test_echo_prompt_logprobs(client, ref):
    r = ref["rows"][1]
    out = client.completions.create(model="smollm2", prompt=r["prompt_ids"], max_tokens=1,
                                    temperature=0, echo=True, logprobs=K)
    lp = out.choices[0].logprobs
    P = len(r["prompt_ids"])
    assert lp.token_logprobs[0] is None
    want = r["logprobs"][1:P + 1]
    for got, w in zip(lp.token_logprobs[1:], want):
        assert abs(got - w["logprob"]) <= TOL
    assert lp.tokens[P] == r["logprobs"][P]["token"]
