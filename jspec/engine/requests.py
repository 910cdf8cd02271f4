"""What goes into the engine and what comes out: :class:`Request`, :class:`Delta` (streamed
output) and :class:`Completion`."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax

from jspec import messages


@dataclasses.dataclass
class Request:
    """One request. ``prompt``: text (needs a tokenizer) or token ids; or ``messages``
    instead: a chat (``[{"role", "content"}, ...]``) rendered through the target's chat
    template when the request is admitted, its ``stop_ids`` defaulting to the template's
    end-of-turn ids and the EOS (:mod:`jspec.messages`). ``max_new_tokens``:
    None for the engine's default. ``key`` or ``seed`` drives its samples: the key is
    ``jax.random.split(jax.random.key(seed), 1)[0]``, the row key ``generate([prompt],
    seed=seed)`` uses, so a request samples as that call does (plain decoding); with
    neither, seed 0. ``stop_ids``: None for the config's EOS ids. ``id``: anything, handed
    back (default: its position in the stream)."""

    prompt: Any = None
    max_new_tokens: int | None = None
    seed: int | None = None
    key: jax.Array | None = None
    stop_ids: Sequence[int] | None = None
    id: Any = None
    messages: list[dict] | None = None
    # Sampling settings (None: the engine's SamplingConfig), runtime values of the request's
    # slot: temperature 0 (or top_k 1) is greedy, top_k 0 and top_p 1 filter nothing.
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    # Stop strings (any number, multi-token), matched on the host: :mod:`jspec.engine.stop_strings`.
    stop: Sequence[str] | None = None
    # Each generated token's logprob and its top-``logprobs`` alternatives (0..20; at most the
    # engine's ``logprobs_k``) under the target's raw distribution (:mod:`jspec.logprobs`);
    # None: none. ``prompt_logprobs`` (OpenAI's echo): the prompt's too, the first None.
    logprobs: int | None = None
    prompt_logprobs: bool = False
    # Structured output (jspec.grammar): OpenAI's {"type": "json_object"} / {"type":
    # "json_schema", ...}, or {"type": "regex" | "choice", ...}; None: unconstrained.
    response_format: dict | None = None


def prompt_ids(req: Request, target) -> tuple[Request, list[int]]:
    """``(req, its prompt ids)``: text encoded, messages rendered (and their stop ids
    filled in), ids as ints. The one place a request becomes ids."""
    p = req.prompt
    if (p is None) == (req.messages is None):
        raise ValueError(f"request {req.id}: give a prompt or messages (exactly one)")
    if req.messages is not None:
        ids = messages.render(target, req.messages, who=f"request {req.id}")
        if req.stop_ids is None:
            req = dataclasses.replace(req, stop_ids=messages.stop_ids(target))
        return req, ids
    if isinstance(p, str):
        if target.tokenizer is None:
            raise ValueError(f"request {req.id}: a text prompt needs a target with a "
                             f"tokenizer; pass token ids instead")
        return req, target.tokenizer.encode(p)
    return req, [int(t) for t in p]


def row_key(req: Request) -> jax.Array:
    """``[1]``: the request's row key (its ``key``, else from its ``seed``, default 0)."""
    if req.key is not None:
        return jax.numpy.reshape(req.key, (1,))
    return jax.random.split(jax.random.key(0 if req.seed is None else req.seed), 1)


@dataclasses.dataclass
class Completion:
    id: Any
    index: int                       # position in the submitted stream
    prompt_ids: list[int]
    # generated ids: a stop id, when hit, included; on a stop string, up to and including
    # the token that completed it (text: cut before the string; jspec.engine.stop_strings)
    tokens: list[int]
    text: str | None
    stats: dict                      # generate's row stats + latency_s, first_token_s
    # "stop" (a stop id or stop string), "length" (max_new_tokens, or the row's KV room),
    # "cancelled" (Engine.cancel) or "error" (non-finite logits)
    finish_reason: str | None = None
    # jspec.logprobs.TokenLogprob per token of ``tokens`` (Request.logprobs), per prompt token
    # (Request.prompt_logprobs; the first None).
    logprobs: list | None = None
    prompt_logprobs: list | None = None


@dataclasses.dataclass
class Delta:
    """New output of one request: ``tokens`` accepted since its last delta (``text``: their
    decoded text, when the target has a tokenizer). The last delta of a request has
    ``done=True`` and its :class:`Completion`."""

    id: Any
    index: int
    tokens: list[int]
    text: str | None
    done: bool = False
    completion: Completion | None = None
    # on the done delta: the completion's finish_reason; "error" with no completion when the
    # live loop failed (Engine.stop re-raises it)
    finish_reason: str | None = None
    logprobs: list | None = None     # jspec.logprobs.TokenLogprob per token of ``tokens``
