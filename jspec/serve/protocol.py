"""The request bodies the server reads, as pydantic models, and the checks that need no engine.

Types are strict where a lax coercion would hide a client's bug (``"max_tokens": "5"``,
``"prompt": 5``); a value of the wrong type is a 400 (:mod:`jspec.serve.errors`). Fields
OpenAI defines that jspec does not serve (``n > 1``, ``best_of``, penalties, ``logit_bias``,
``suffix``, tools) are read so they can be refused by name when set, rather than silently
ignored; unknown fields are ignored, as vLLM does, so newer clients keep working.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from jspec.serve.errors import APIError

Number = Union[StrictInt, StrictFloat]
Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
Stop = Union[StrictStr, list[StrictStr], None]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class SamplingFields(_Body):
    """What completions and chat share: the model, sampling, stops, streaming, and the
    OpenAI fields refused when set (:meth:`refuse_unsupported`)."""

    model: StrictStr | None = None
    temperature: Number | None = Field(None, ge=0)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1)          # vLLM's: -1 (or 0) = no top-k filter
    seed: StrictInt | None = None
    stop: Stop = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    user: StrictStr | None = None

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(f"n={self.n}: this server returns one choice per prompt (n=1)",
                           param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(f"{name} is not supported (only 0)", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options needs stream=true", param="stream_options")

    def stops(self) -> list[str] | None:
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not s for s in stops):
            raise APIError("stop strings must not be empty", param="stop")
        return stops or None

    def sampling(self) -> dict:
        """The per-request sampling fields of :class:`jspec.engine.Request` that were given
        (None: the engine's default). vLLM's top_k=-1 is the engine's 0 (no filter)."""
        out = {}
        if self.temperature is not None:
            out["temperature"] = float(self.temperature)
        if self.top_p is not None:
            out["top_p"] = float(self.top_p)
        if self.top_k is not None:
            out["top_k"] = max(0, self.top_k)
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: StrictInt | None = Field(None, ge=0)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0)
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of not in (None, 1):
            raise APIError(f"best_of={self.best_of} is not supported (1)", param="best_of")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")

    def prompts(self) -> list:
        """The prompts, one per choice: strings or lists of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt is empty", param="prompt")
        if isinstance(p[0], int):
            return [p]
        if any(isinstance(x, list) and not x for x in p):
            raise APIError("a prompt of token ids is empty", param="prompt")
        return list(p)


class ChatRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: StrictInt | None = Field(None, ge=0)
    max_completion_tokens: StrictInt | None = Field(None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0)
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    add_generation_prompt: StrictBool = True

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise APIError("tools are not supported", param="tools")
        kind = (self.response_format or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema", "regex", "choice", "grammar"):
            raise APIError(f"response_format type {kind!r} is not supported (text, json_object, "
                           "json_schema; and jspec's regex, choice, grammar)",
                           param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")

    @property
    def limit(self) -> int | None:
        """``max_completion_tokens`` (the current name), else the older ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def grammar(self) -> dict | None:
        """The engine request's ``response_format`` (None for plain text)."""
        fmt = self.response_format
        return None if not fmt or fmt.get("type", "text") == "text" else fmt

    def k(self) -> int | None:
        """Logprobs to return per token: None (none), or the top-k alternatives wanted."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict]:
        """The messages with OpenAI's content parts (``[{"type": "text", "text": ...}]``)
        joined into a string, the form chat templates read; other parts are refused."""
        out = []
        for i, m in enumerate(self.messages):
            c = m.get("content")
            if isinstance(c, list):
                texts = []
                for part in c:
                    if not isinstance(part, dict) or part.get("type") != "text" or \
                            not isinstance(part.get("text"), str):
                        raise APIError(f"messages.{i}.content: only text parts are supported",
                                       param=f"messages.{i}.content")
                    texts.append(part["text"])
                m = {**m, "content": "".join(texts)}
            out.append(m)
        return out


class TokenizeRequest(_Body):
    """vLLM's ``/tokenize``: ``prompt`` (with ``add_special_tokens``, default on: the BOS a
    completion's prompt gets) or ``messages`` (through the chat template)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt]
