"""An OpenAI-compatible HTTP server over the engine: ``python -m jspec serve``.

Thin by design: requests become :class:`jspec.engine.Request` s, deltas become JSON; no
decoding logic lives here. One job per module: :mod:`~jspec.serve.protocol` (request bodies
and their checks), :mod:`~jspec.serve.errors` (OpenAI's error JSON), :mod:`~jspec.serve.bridge`
(the engine's thread to the event loop), :mod:`~jspec.serve.tokens` (ids as text),
:mod:`~jspec.serve.responses` (output JSON and logprob formats),
:mod:`~jspec.serve.completions` and :mod:`~jspec.serve.chat` (the two generation routes),
:mod:`~jspec.serve.app` (the FastAPI app) and :mod:`~jspec.serve.cli` (the command).
Needs the ``serve`` extra (FastAPI, uvicorn).
"""
