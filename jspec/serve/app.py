"""The FastAPI application: routes, the API key, and the engine's lifetime.

Routes are thin: each parses its body (:mod:`jspec.serve.protocol`), hands it to the module
that serves it (:mod:`~jspec.serve.completions`, :mod:`~jspec.serve.chat`) or answers from
the tokenizer, and returns JSON. The engine warms in the background after the server starts
(``/health`` is 503 until it is warm, then 200) and stops with the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from jspec.serve import chat, completions, errors
from jspec.serve.context import Served
from jspec.serve.errors import APIError
from jspec.serve.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

# Open without the key: a load balancer's or supervisor's liveness probe carries none.
OPEN_PATHS = {"/health"}


class KeyCheck:
    """``Authorization: Bearer KEY`` on every path but :data:`OPEN_PATHS`, checked before the
    body is read (a 401 comes first). A plain ASGI middleware: starlette's ``@middleware``
    wraps ``receive``, and a handler behind it no longer sees its client disconnect."""

    def __init__(self, app, key: str):
        self.app, self.want = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.want):
                err = APIError("invalid or missing API key (Authorization: Bearer KEY)", 401,
                               code="invalid_api_key")
                return await errors.response(err)(scope, receive, send)
        await self.app(scope, receive, send)


def make_app(s: Served) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        task = asyncio.create_task(s.bridge.bring_up())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.to_thread(s.bridge.stop)

    app = FastAPI(title="jspec", lifespan=lifespan)
    app.state.served = s
    errors.install(app)
    if s.api_key is not None:
        app.add_middleware(KeyCheck, key=s.api_key)

    @app.get("/health")
    async def health():
        if s.bridge.ready:
            return {"status": "ok"}
        why = s.bridge.failed or "warming up: compiling the engine's programs"
        return errors.response(APIError(why, 503))

    @app.get("/load")
    async def load():
        """vLLM's server load (requests admitted or waiting, not yet finished), the slots,
        and how the requests served so far finished (``cancelled``: clients gone)."""
        return {"server_load": s.bridge.live, "slots": s.engine.slots,
                "finished": dict(s.bridge.finished)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": s.model, "object": "model", "created": s.created, "owned_by": "jspec",
             "root": s.model, "parent": None, **s.limits()}]}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await completions.create(s, body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatRequest, request: Request):
        return await chat.create(s, body, request)

    _tokenizer_routes(app, s)

    @app.exception_handler(404)
    async def _not_found(request: Request, _exc):
        return JSONResponse(errors.body(f"no route {request.method} {request.url.path}", 404),
                            status_code=404)

    return app


def _tokenizer_routes(app: FastAPI, s: Served) -> None:
    """vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` (lm-eval's remote
    tokenizer reads them)."""
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        s.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give a prompt or messages (exactly one)")
        if body.messages is not None:
            from jspec import messages as chat_messages
            try:
                ids = chat_messages.render(s.engine.target, body.messages,
                                           add_generation_prompt=body.add_generation_prompt)
            except ValueError as e:
                raise APIError(str(e), param="messages") from e
        else:
            ids = s.tokens.encode(body.prompt, special=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": s.limits()["max_model_len"]}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        s.check_model(body.model)
        ids = s.tokens.check_ids(body.tokens)
        return {"prompt": s.tokens.decode(ids)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {**s.tokens.info(), "model_max_length": s.limits()["max_model_len"]}
