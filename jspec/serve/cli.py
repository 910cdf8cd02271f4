"""``python -m jspec serve``: an OpenAI-compatible HTTP server over one engine.

It binds 127.0.0.1 unless ``--host`` says otherwise (the server has no rate limits, and its
key is optional). The engine is built here, warmed after the server starts (``/health``
turns 200 when it is), and runs on its own thread.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from jspec.args import add_kernels_arg, add_prefill_chunk_arg, add_quantize_arg


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="as for generate: a path, a fetchable name "
                   "(smollm2), or 'default' for the shipped model")
    p.add_argument("--drafter", help="as for generate (a checkpoint, random:KIND, ngram[:..])")
    p.add_argument("--served-model-name", help="the name clients send as 'model' (default: "
                   "--model's fetchable name or 'default' as given, else the model file's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: "
                   "this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (all but /health)")
    p.add_argument("--slots", type=int, help="concurrent requests decoded together (default: "
                   "8 on CPU, 64 on TPU/GPU); more wait")
    p.add_argument("--max-tokens", type=int, default=256, help="the most new tokens a request "
                   "may ask for, and the default when it names none")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="sizes each slot's KV: "
                   "a row holds this many prompt tokens and --max-tokens new ones (default: "
                   "the model's context, at most 4096); a longer prompt is served when it asks "
                   "for fewer new tokens (vLLM's max_model_len, reported by /v1/models)")
    p.add_argument("--max-logprobs", type=int, default=20, help="the most top logprobs a "
                   "request may ask for (0: token logprobs only; -1: no logprobs, none computed)")
    p.add_argument("--chat-template", help="a Jinja chat template (a file, or the template "
                   "itself) replacing the model's, for /v1/chat/completions")
    p.add_argument("--policy", default="fixed", help="'fixed' (the drafter's spec, or --spec) "
                   "or 'auto' (the per-occupancy picks of `python -m jspec tune --occupancy`)")
    p.add_argument("--spec", help="S,K,N tree knobs for --policy fixed (default: the drafter's)")
    p.add_argument("--chunk", type=int, default=8, help="iterations between refills; also how "
                   "often output is streamed and cancellations take effect")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_kernels_arg(p)
    add_quantize_arg(p)
    add_prefill_chunk_arg(p)


def load_model(path: str, quantize=None):
    """``--model``: 'default' is the shipped model; anything else as ``generate`` loads it
    (:func:`jspec.cli.main` has already turned a fetchable name into its path)."""
    import jspec
    from jspec.shipped import default_model
    return jspec.load_target(default_model() if path == "default" else path, quantize=quantize)


def served_names(args) -> tuple[str, ...]:
    """The names a request's 'model' may use: the chosen one first, then --model as given
    (a fetchable name: ``smollm2``), its path, and the model file's name."""
    given = str(getattr(args, "model_as_given", args.model))
    path = str(args.model)
    first = args.served_model_name or (given if given != path or given == "default"
                                       else Path(path).name)
    return tuple(dict.fromkeys([first, given, path, Path(path).name]))


def build(args, target=None):
    """The app and its :class:`jspec.serve.context.Served` for ``args`` (``target``: an
    already loaded one, for tests). Nothing compiles here: the app warms the engine."""
    from jspec.args import load_drafter_arg
    from jspec.engine import Engine
    from jspec.serve.app import make_app
    from jspec.serve.bridge import Bridge
    from jspec.serve.context import Served
    from jspec.serve.tokens import Tokens
    from jspec.sampling import SamplingConfig
    from jspec.spec_config import parse_spec

    target = target if target is not None else load_model(args.model, args.quantize)
    if args.chat_template:
        if target.tokenizer is None:
            raise ValueError("--chat-template needs a model with a tokenizer")
        p = Path(args.chat_template)
        target.tokenizer.chat_template = p.read_text() if p.is_file() else args.chat_template
    drafter = load_drafter_arg(args.drafter, target) if args.drafter else None
    if args.policy not in ("fixed", "auto"):
        raise ValueError(f"--policy {args.policy!r}: 'fixed' or 'auto'")
    spec = parse_spec(args.spec) if args.spec else None
    k = None if args.max_logprobs < 0 else args.max_logprobs
    kw = {} if k is None else {"logprobs_k": k}
    # Per-request sampling: greedy and sampled requests share the compiled programs.
    engine = Engine(target, drafter, slots=args.slots, spec=spec,
                    sampling=SamplingConfig(per_request=True),
                    policy="auto" if args.policy == "auto" else None,
                    max_new_tokens=args.max_tokens, longest_prompt=args.max_prompt_tokens,
                    chunk=args.chunk, kernels=args.kernels, prefill_chunk=args.prefill_chunk,
                    **kw)
    served = Served(Bridge(engine), Tokens(target), served_names(args), max_logprobs=k,
                    api_key=args.api_key)
    return make_app(served), served


def run(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise RuntimeError(f"the server needs the serve extra: pip install 'jspec[serve]' "
                           f"({e})") from e

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app, served = build(args)
    print(f"jspec serve: {served.model!r} on http://{args.host}:{args.port}/v1 (warming up; "
          f"/health turns 200 when ready)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
