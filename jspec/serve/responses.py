"""Engine output as OpenAI JSON: completion and chat objects, their streamed chunks, usage,
and logprobs in the two formats (the legacy completions one lm-eval reads, and chat's).

Logprob values are the engine's (:mod:`jspec.logprobs`: the target's raw distribution);
nothing here computes any. ``-inf`` is not JSON, so it is sent as -9999.0 (vLLM's choice).
"""

from __future__ import annotations

import json
import math
import time

FLOOR = -9999.0


def _lp(x: float) -> float:
    x = float(x)
    return FLOOR if math.isinf(x) or math.isnan(x) else x


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def head(id_: str, obj: str, model: str, created: int | None = None) -> dict:
    return {"id": id_, "object": obj, "created": int(created or time.time()), "model": model}


# ---------------------------------------------------------------- logprobs
class Legacy:
    """The completions format, built up token by token: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (``{text: logprob}``, the chosen token always in it, as OpenAI and
    vLLM send it) and ``text_offset`` (each token's start in the returned text: a special
    token, named but not in the text, takes no room)."""

    def __init__(self, tokens, offset: int = 0):
        self.t, self.offset = tokens, offset

    def entries(self, ids, lps) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, e in zip(ids, lps):
            text = self.t.text(int(tid))
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += self.t.width(int(tid))
            if e is None:           # a prompt's first token: nothing before it to score
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top: dict[str, float] = {}
            for i, v in e.top:      # descending: a repeated text keeps its best value
                top.setdefault(self.t.text(int(i)), _lp(v))
            top.setdefault(text, _lp(e.logprob))
            out["token_logprobs"].append(_lp(e.logprob))
            out["top_logprobs"].append(top)
        return out


def merge_legacy(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(tokens, ids, lps) -> list[dict]:
    """Chat's format: per token ``{token, logprob, bytes, top_logprobs: [...]}``."""
    def one(i, v):
        s = tokens.text(int(i))
        return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8"))}

    return [{**one(t, e.logprob), "top_logprobs": [one(i, v) for i, v in e.top]}
            for t, e in zip(ids, lps)]


# ---------------------------------------------------------------- objects
def completion_choice(index: int, text: str, finish: str | None, logprobs) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chat_choice(index: int, text: str, finish: str | None, logprobs) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish}


def chat_delta(index: int, delta: dict, finish: str | None = None, logprobs=None) -> dict:
    return {"index": index, "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish}


def sse(obj) -> str:
    """One server-sent event (``data: {...}``; ``[DONE]`` ends the stream)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"
