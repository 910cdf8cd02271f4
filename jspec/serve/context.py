"""What every route needs: the bridge to the engine, the tokenizer, the served model's names
and limits; and the one place an API request becomes :class:`jspec.engine.Request` s."""

from __future__ import annotations

import dataclasses
import secrets
import time

from jspec.engine import Request
from jspec.serve.bridge import Bridge
from jspec.serve.errors import APIError
from jspec.serve.protocol import SamplingFields
from jspec.serve.tokens import Tokens


@dataclasses.dataclass
class Served:
    bridge: Bridge
    tokens: Tokens
    names: tuple[str, ...]             # names[0] is what responses and /v1/models say
    max_logprobs: int | None = None    # None: the engine computes no logprobs
    api_key: str | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def engine(self):
        return self.bridge.engine

    @property
    def model(self) -> str:
        return self.names[0]

    def limits(self) -> dict:
        """The engine's limits as clients see them: the longest prompt, the most new tokens,
        and vLLM's ``max_model_len`` (prompt and output together, as one row holds them)."""
        e = self.engine
        prompt = e.prompt_buckets[-1]
        return {"max_model_len": e.max_len - e.overshoot, "max_prompt_tokens": prompt,
                "max_tokens": e.max_new_tokens}

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(f"model {name!r} is not served here; this server serves "
                           f"{self.model!r}", param="model", code="model_not_found")

    def check_max_tokens(self, n: int | None, param: str) -> None:
        cap = self.engine.max_new_tokens
        if n is not None and n > cap:
            raise APIError(f"{param}={n}: at most {cap} (the server's --max-tokens)",
                           param=param)

    def check_logprobs(self, k: int | None, param: str) -> None:
        if k is None:
            return
        if self.max_logprobs is None:
            raise APIError("this server returns no logprobs (start it with --max-logprobs K)",
                           param=param)
        if k > self.max_logprobs:
            raise APIError(f"{param}={k}: at most {self.max_logprobs} (the server's "
                           f"--max-logprobs)", param=param)

    def request(self, body: SamplingFields, id_: str, *, logprobs: int | None = None,
                prompt_logprobs: bool = False, **kw) -> Request:
        """An engine request with ``body``'s sampling, seed and stops. A sampled request
        without a seed gets a fresh one (OpenAI's requests differ unless seeded); a greedy
        one's seed is unused."""
        extra = body.sampling()
        stops = body.stops()
        if stops:
            extra["stop"] = stops
        if logprobs is not None:
            extra["logprobs"] = int(logprobs)
        if prompt_logprobs:
            extra["prompt_logprobs"] = True
        seed = body.seed if body.seed is not None else secrets.randbelow(2 ** 31)
        return Request(id=id_, seed=seed, **kw, **extra)
