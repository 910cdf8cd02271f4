"""``python -m jspec serve`` on the shipped default model, driven by the official ``openai``
client (and ``httpx`` where the client hides the wire: SSE framing, vLLM's extra routes).

One server for the module (its engine warms once): 2 slots, at most 1024 new tokens (long
enough that a request outlives a disconnect and its detection), prompts
up to 64 tokens, an API key, and a ChatML template (the default model has none). Logprob
values are the engine's (tests/engine); here only their presence and shape are checked."""

from __future__ import annotations

import json
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from helpers import serve_process  # noqa: E402

KEY = "sk-jspec-test"
MODEL = "default"
CAP = 1024
PROMPT = "def main():"
CHAT = [{"role": "user", "content": "Write a function."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    s = serve_process.start(["--model", MODEL, "--slots", "2", "--max-tokens", str(CAP),
                             "--max-prompt-tokens", "64", "--max-logprobs", "5",
                             "--api-key", KEY, "--chat-template", serve_process.CHATML,
                             "--kernels", "reference", "--chunk", "4"], log)
    yield s
    serve_process.stop(s)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def http(server, method, path, headers=None, timeout=120, **kw):
    return httpx.request(method, server.base + path, timeout=timeout,
                         headers={"Authorization": f"Bearer {KEY}", **(headers or {})}, **kw)


def load(server) -> dict:
    return http(server, "GET", "/load").json()

def assert_cancelled_once(server, before: int) -> None:
    """Wait (up to 30 s) until the server is idle with one more cancelled request than
    ``before``, and assert exactly that."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = load(server)
        if state["server_load"] == 0 and state["finished"].get("cancelled", 0) > before:
            break
        time.sleep(0.1)
    assert state["server_load"] == 0 and state["finished"]["cancelled"] == before + 1, state


def test_health_is_503_until_warm_then_200(server):
    assert server.health[0] == 503 and server.health[-1] == 200, server.health
    assert httpx.get(server.base + "/health").status_code == 200    # no key needed


def test_models_lists_the_served_model(client):
    m, = client.models.list().data
    assert m.id == MODEL


def test_completion_streamed_equals_not_streamed(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    c, = full.choices
    assert c.finish_reason == "length" and c.index == 0 and c.text
    assert full.usage.completion_tokens == 24 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    parts, usage, finish = [], None, None
    for ch in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                        temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage = ch.usage
            assert not ch.choices
        for x in ch.choices:
            parts.append(x.text)
            finish = x.finish_reason or finish
    assert "".join(parts) == c.text and finish == "length"
    assert usage.completion_tokens == 24 and usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_streamed_equals_not_streamed(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=20,
                                          temperature=0)
    c, = full.choices
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT,
                                                 max_completion_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == c.finish_reason
    assert all(x.choices[0].finish_reason is None for x in chunks[:-1])
    assert "".join(x.choices[0].delta.content or "" for x in chunks) == c.message.content
    assert full.usage.completion_tokens <= 20


def test_chat_max_tokens_is_the_older_name(client):
    a = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=5,
                                       temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == 5 and a.choices[0].finish_reason == "length"


def test_sse_framing_ends_with_done(server):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "stream": True}
    r = http(server, "POST", "/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["role"] == "assistant"


def test_stop_string_cuts_the_text(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40,
                                     temperature=0).choices[0].text
    stop = text[8:12]                       # a string the greedy text reaches, not at once
    assert stop.strip(), text
    want = text[:text.index(stop)]
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                  stop=[stop, "never-in-the-text"]).choices[0]
    assert c.text == want and c.finish_reason == "stop"
    parts = [x.choices[0] for x in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True)]
    assert "".join(p.text for p in parts) == want and parts[-1].finish_reason == "stop"


def test_several_prompts_are_several_choices(client, server):
    prompts = [PROMPT, "import numpy", "class A:"]
    both = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in both.choices] == [0, 1, 2]
    for p, c in zip(prompts, both.choices):
        alone = client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
        assert c.text == alone.choices[0].text
    # Token ids (what /tokenize gives) serve as the text does, one list or several.
    ids = [http(server, "POST", "/tokenize", json={"prompt": p}).json()["tokens"]
           for p in prompts[:2]]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in both.choices[:2]]
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=6, temperature=0)
    assert one.choices[0].text == both.choices[0].text


def test_sampling_is_seeded(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.95)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, extra_body={"top_k": 0}, **kw).choices[0].text
    assert a == b


def test_completion_logprobs_shape(client):
    k = 3
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=k).choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == c.text and lp.text_offset[0] == 0
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and tok in top and k <= len(top) <= k + 1
        assert v == max(top.values())             # greedy: the token is the argmax


def test_echo_logprobs_score_the_prompt(client):
    """lm-eval's loglikelihood request: echo, logprobs=1, max_tokens=1."""
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                  logprobs=1, echo=True).choices[0]
    lp = c.logprobs
    assert c.text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(lp.text_offset) and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob
        assert t.bytes == list(t.token.encode())


@pytest.mark.parametrize("kw, match", [
    (dict(model="no-such-model"), "not served"),
    (dict(max_tokens=CAP + 1), "max_tokens"),
    (dict(n=2), "n=2"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(logprobs=6), "logprobs"),
    (dict(extra_body={"temperature": "hot"}), "temperature"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[1, 99999]), "99999"),
    (dict(prompt="word " * 1500), "prompt"),              # longer than a row
    (dict(prompt="word " * 100, max_tokens=CAP), "max_new_tokens"),   # with its output
    (dict(stop=[""]), "stop"),
    (dict(logit_bias={"1": 5}), "logit_bias"),
])
def test_bad_completion_requests_are_400(client, kw, match):
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client.completions.create(**kw)
    err = e.value.body
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("kw, match", [
    (dict(messages=[{"content": "no role"}]), "role"),
    (dict(messages="hi"), "messages"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=9), "top_logprobs"),
    (dict(max_completion_tokens=CAP + 1), "max_completion_tokens"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "integer", "multipleOf": 3}}}), "multipleOf"),
    (dict(response_format={"type": "grammar", "grammar": "start: no_such_rule"}), "bad grammar"),
])
def test_bad_chat_requests_are_400(client, kw, match):
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(**kw)


def test_malformed_json_is_400(server):
    r = http(server, "POST", "/v1/completions", content=b"{not json",
             headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_wrong_or_missing_key_is_401(server):
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    r = httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server.base + "/v1/completions", content=b"{not json")   # the key first
    assert r.status_code == 401


def wait_idle(server) -> dict:
    """The server's load once nothing runs (a request an earlier test left may still be
    finishing on a loaded machine), waiting up to 30 s."""
    deadline = time.monotonic() + 30
    while (state := load(server))["server_load"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state["server_load"] == 0, state
    return state


def test_disconnect_mid_stream_frees_the_slot(server):
    before = wait_idle(server)["finished"].get("cancelled", 0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": CAP, "stream": True,
            "stop": "never-in-the-text", "temperature": 0}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
        state = load(server)
        assert state["server_load"] == 1, (state, first[-300:])
    assert_cancelled_once(server, before)      # closed: the engine cancels at a chunk boundary


def test_disconnect_while_waiting_frees_the_slot(server):
    """A non-streamed request whose client goes away is cancelled too: the request is sent
    on a bare socket, which is closed once the engine holds the request."""
    before = wait_idle(server)["finished"].get("cancelled", 0)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": CAP, "temperature": 0,
                       "stop": "never-in-the-text"}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while load(server)["server_load"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert_cancelled_once(server, before)


def test_echo_streams_the_prompt_first(client):
    parts = [x.choices[0].text for x in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True)]
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                     echo=True).choices[0].text
    assert parts[0] == PROMPT and "".join(parts) == full


def test_tokenize_detokenize_round_trip(server):
    text = "def f(x):\n    return x + 1"
    r = http(server, "POST", "/tokenize", json={"prompt": text}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] > 64
    plain = http(server, "POST", "/tokenize",
                 json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert r["tokens"][1:] == plain                   # the BOS a completion's prompt gets
    assert http(server, "POST", "/detokenize", json={"tokens": r["tokens"]}).json() == \
        {"prompt": text}
    chat = http(server, "POST", "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > 0


def test_tokenizer_info_serves_lm_eval(server):
    info = http(server, "GET", "/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert info["chat_template"] == serve_process.CHATML
    eos = http(server, "POST", "/tokenize",
               json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == [1]                       # lm-eval finds the EOS id this way


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_parses_and_validates(client, stream):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "n": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}},
              "required": ["answer", "n"]}
    kw = dict(model=MODEL, messages=CHAT, max_tokens=48, response_format={
        "type": "json_schema", "json_schema": {"name": "reply", "schema": schema}})
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kw) if c.choices)
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


def test_response_format_grammar_follows_the_grammar(client):
    """A context-free grammar (jspec's ``{"type": "grammar"}``, the host path)."""
    lark = 'start: "(" inner ")"\ninner: "x" | "(" inner ")"\n'
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                       response_format={"type": "grammar", "grammar": lark})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        depth = len(text) // 2
        assert depth >= 1 and text == "(" * depth + "x" + ")" * depth, text
    else:
        assert set(text) <= set("(x)"), text
