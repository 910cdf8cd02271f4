"""``POST /v1/chat/completions``: the messages through the target's chat template (the
engine's ``Request(messages=...)``, which also stops the reply at the end of turn), one
choice. Streaming sends ``role: assistant`` first, then content deltas, then a chunk with
the finish reason, then ``[DONE]``.
"""

from __future__ import annotations

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from jspec import messages as chat_messages
from jspec.grammar import GrammarError
from jspec.serve import errors, responses as R
from jspec.serve.context import Served
from jspec.serve.errors import APIError
from jspec.serve.protocol import ChatRequest


def _prepare(s: Served, body: ChatRequest):
    body.refuse_unsupported()
    s.check_model(body.model)
    k = body.k()
    s.check_logprobs(k, "top_logprobs")
    s.check_max_tokens(body.limit, "max_completion_tokens" if body.max_completion_tokens
                       is not None else "max_tokens")
    msgs = body.chat()
    cid = s.bridge.new_id("chatcmpl")
    if body.add_generation_prompt:
        src = {"messages": msgs}
    else:                       # rendered here: the engine's messages path adds the prompt
        try:
            ids = chat_messages.render(s.engine.target, msgs, add_generation_prompt=False)
        except ValueError as e:
            raise APIError(str(e), param="messages") from e
        src = {"prompt": ids, "stop_ids": chat_messages.stop_ids(s.engine.target)}
    req = s.request(body, f"{cid}-0", max_new_tokens=body.limit, logprobs=k,
                    response_format=body.grammar(), **src)
    if req.response_format is not None:      # a bad grammar is the request's fault: a 400
        try:
            s.engine.check(req)
        except GrammarError as e:
            raise APIError(str(e), param="response_format") from e
    return cid, k, req


async def create(s: Served, body: ChatRequest, http: HTTPRequest):
    cid, k, req = _prepare(s, body)
    job = s.bridge.submit([req], stream=body.stream)
    if body.stream:
        return StreamingResponse(_stream(s, body, http, job, cid, k),
                                 media_type="text/event-stream")
    c = None
    try:
        while not job.finished:
            _, d = await job.next(http.is_disconnected)
            if d.done:
                c = d.completion
    finally:
        job.cancel()                 # a client gone mid-wait frees its slot
    lp = None if k is None else R.chat_logprobs(s.tokens, c.tokens, c.logprobs or [])
    return {**R.head(cid, "chat.completion", s.model),
            "choices": [R.chat_choice(0, c.text or "", c.finish_reason, lp)],
            "usage": R.usage(len(c.prompt_ids), len(c.tokens))}


async def _stream(s: Served, body: ChatRequest, http, job, cid, k):
    head = R.head(cid, "chat.completion.chunk", s.model)
    chunk = lambda choice: {**head, "choices": [choice]}
    try:
        yield R.sse(chunk(R.chat_delta(0, {"role": "assistant", "content": ""})))
        usage = None
        while not job.finished:
            _, d = await job.next()    # a disconnect cancels this generator
            lp = None
            if k is not None and d.tokens:
                lp = R.chat_logprobs(s.tokens, d.tokens, d.logprobs or [])
            if d.text or lp:
                yield R.sse(chunk(R.chat_delta(0, {"content": d.text or ""}, logprobs=lp)))
            if d.done:
                c = d.completion
                usage = R.usage(len(c.prompt_ids), len(c.tokens))
                yield R.sse(chunk(R.chat_delta(0, {}, c.finish_reason)))
        if body.include_usage:
            yield R.sse({**head, "choices": [], "usage": usage})
        yield R.sse("[DONE]")
    except APIError as e:            # after the headers: the error is the stream's last event
        yield R.sse(errors.body(e.message, e.status, e.param, e.code))
        yield R.sse("[DONE]")
    finally:
        job.cancel()                 # a client gone mid-stream frees its slot
