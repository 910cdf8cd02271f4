"""``POST /v1/completions``: one engine request per prompt, one choice each.

``echo`` puts the prompt before the text; with ``logprobs`` it asks the engine for the
prompt's logprobs too (the first is null), which is how lm-eval's ``local-completions``
scores a continuation. Streaming sends each delta's text as it is accepted, then ``[DONE]``.
"""

from __future__ import annotations

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from jspec.serve import errors, responses as R
from jspec.serve.context import Served
from jspec.serve.errors import APIError
from jspec.serve.protocol import CompletionRequest


def _prepare(s: Served, body: CompletionRequest):
    body.refuse_unsupported()
    s.check_model(body.model)
    s.check_logprobs(body.logprobs, "logprobs")
    s.check_max_tokens(body.max_tokens, "max_tokens")
    if body.stream and body.echo and body.logprobs is not None:
        # The prompt's logprobs come with the finished completion, after its streamed text.
        raise APIError("echo with logprobs is not streamed; send stream=false", param="echo")
    prompts = body.prompts()
    cid = s.bridge.new_id("cmpl")
    reqs = [s.request(body, f"{cid}-{i}", prompt=p, max_new_tokens=body.max_tokens,
                      logprobs=body.logprobs, prompt_logprobs=body.echo and body.logprobs is not None)
            for i, p in enumerate(prompts)]
    return cid, prompts, reqs


def _prompt_text(s: Served, prompt) -> str:
    return prompt if isinstance(prompt, str) else s.tokens.decode(prompt)


async def create(s: Served, body: CompletionRequest, http: HTTPRequest):
    cid, prompts, reqs = _prepare(s, body)
    job = s.bridge.submit(reqs, stream=body.stream)
    if body.stream:
        return StreamingResponse(_stream(s, body, http, job, cid, prompts),
                                 media_type="text/event-stream")
    done = {}
    try:
        while not job.finished:
            choice, d = await job.next(http.is_disconnected)
            if d.done:
                done[choice] = d.completion
    finally:
        job.cancel()                 # a client gone mid-wait frees its slots
    choices, n_prompt, n_out = [], 0, 0
    for i in range(len(prompts)):
        c = done[i]
        n_prompt, n_out = n_prompt + len(c.prompt_ids), n_out + len(c.tokens)
        head = _prompt_text(s, prompts[i]) if body.echo else ""
        lp = None
        if body.logprobs is not None:
            leg = R.Legacy(s.tokens)
            if body.echo:
                lp = leg.entries(c.prompt_ids, c.prompt_logprobs or [])
            lp = R.merge_legacy(lp, leg.entries(c.tokens, c.logprobs or []))
        choices.append(R.completion_choice(i, head + (c.text or ""), c.finish_reason, lp))
    return {**R.head(cid, "text_completion", s.model), "choices": choices,
            "usage": R.usage(n_prompt, n_out)}


async def _stream(s: Served, body: CompletionRequest, http, job, cid, prompts):
    head = R.head(cid, "text_completion", s.model)
    chunk = lambda choice: {**head, "choices": [choice]}
    legacy = [R.Legacy(s.tokens) for _ in prompts]
    n_prompt = n_out = 0
    try:
        if body.echo:
            for i, p in enumerate(prompts):
                yield R.sse(chunk(R.completion_choice(i, _prompt_text(s, p), None, None)))
        while not job.finished:
            i, d = await job.next()    # a disconnect cancels this generator
            lp = None
            if body.logprobs is not None and d.tokens:
                lp = legacy[i].entries(d.tokens, d.logprobs or [])
            finish = d.completion.finish_reason if d.done else None
            if d.text or lp or finish:
                yield R.sse(chunk(R.completion_choice(i, d.text or "", finish, lp)))
            if d.done:
                n_prompt += len(d.completion.prompt_ids)
                n_out += len(d.completion.tokens)
        if body.include_usage:
            yield R.sse({**head, "choices": [], "usage": R.usage(n_prompt, n_out)})
        yield R.sse("[DONE]")
    except APIError as e:            # after the headers: the error is the stream's last event
        yield R.sse(errors.body(e.message, e.status, e.param, e.code))
        yield R.sse("[DONE]")
    finally:
        job.cancel()                 # a client gone mid-stream frees its slots
