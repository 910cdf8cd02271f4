"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Clients (the ``openai`` package, lm-evaluation-harness) read the status to pick an exception
class (400 ``BadRequestError``, 401 ``AuthenticationError``) and show ``message``. Every
refusal of bad input is a 400, FastAPI's own request validation included (it answers 422
by default, which the ``openai`` client reports as an unprocessable entity, not bad input).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         503: "service_unavailable", 500: "internal_server_error"}


class APIError(Exception):
    """A refusal with its status; ``param`` names the offending field when there is one."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


def body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def response(err: APIError) -> JSONResponse:
    return JSONResponse(body(err.message, err.status, err.param, err.code), status_code=err.status)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's first complaint as one line, and the field it names (``messages.0.role``)."""
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None          # the request's field; the rest is inside it
    fields = {tuple(x.get("loc", ()))[1:2] for x in errs}
    if len(errs) > 1 and len(fields) == 1:   # one field failing every type a union allows
        return f"{param}: {_value(e)} is none of the types it may be", param
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}{more}", param


def _value(e: dict) -> str:
    r = repr(e.get("input"))
    return r if len(r) <= 60 else r[:57] + "..."


def install(app) -> None:
    """Register the handlers that turn refusals into OpenAI's error JSON."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return response(exc)

    @app.exception_handler(ConnectionAbortedError)
    async def _gone(_: Request, exc: ConnectionAbortedError):
        # The client left while its request ran (it was cancelled): nobody reads this
        # answer; 499 is nginx's "client closed request", for the access log.
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        msg, param = validation_message(exc)
        return response(APIError(msg, 400, param))
