"""``python -m jspec demo``: its flags, and which demo they ask for (the chat demo,
:mod:`jspec.demo_chat`, or the shipped code model's, :mod:`jspec.demo`)."""

from __future__ import annotations

import argparse
import sys

from jspec.args import add_kernels_arg, add_quantize_arg
from jspec.shipped import DRAFTER_ORDER


def add_args(p: argparse.ArgumentParser) -> None:
    chat = p.add_argument_group("the chat demo (the default): SmolLM2 answers, plain vs speculative")
    chat.add_argument("--chat-model", default="smollm2",
                      help="an instruct model with a chat template: a fetchable name or a path "
                           "(default: smollm2, fetched on first use)")
    chat.add_argument("--message", default=None, help="the user's message (default: an "
                      "editing request, where n-gram drafting pays; see docs/chat.md)")
    chat.add_argument("--spec-steps", type=int, default=None,
                      help="n-gram chain length (default: 6)")
    code = p.add_argument_group("the shipped-model demo (any of these flags selects it): the "
                                "6.7M code model and its trained drafters, calibrated")
    code.add_argument("--model", default=None,
                      help="'default' (checkpoints/default/target) or a path")
    code.add_argument("--prompt", default=None, help="default: 'import os\\n' for the shipped "
                      "model (it writes Python), 'Once upon a time' otherwise")
    code.add_argument("--drafter", default=None, choices=DRAFTER_ORDER,
                      help="calibrate this shipped drafter only (default: all of them)")
    code.add_argument("--extra-drafter", action="append", default=[], metavar="NAME=DIR",
                      help="also calibrate the drafter saved in DIR under NAME (repeatable): "
                      "e.g. your own head beside the shipped one, before and after in one run")
    code.add_argument("--recalibrate", action="store_true",
                      help="measure the drafter/tree pick again instead of reading the stored one")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: 256 for the chat demo, 128 for the shipped model")
    p.add_argument("--repeats", type=int, default=3,
                   help="warm plain/speculative pairs timed; the best of each is reported")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                   help="do not keep compiled programs in ~/.cache/jspec/xla")
    add_kernels_arg(p)
    add_quantize_arg(p)


def run(args) -> int:
    """The chat demo (:mod:`jspec.demo_chat`), or the shipped model's (:mod:`jspec.demo`) when
    one of its flags is given or SmolLM2 cannot be fetched (no network on a first run)."""
    from jspec import demo
    if (args.max_new_tokens is not None and args.max_new_tokens < 1) or args.repeats < 1:
        raise ValueError("--max-new-tokens and --repeats must be >= 1")
    if args.spec_steps is not None and args.spec_steps < 1:
        raise ValueError("--spec-steps must be >= 1")
    shipped = (args.model or args.prompt or args.drafter or args.extra_drafter
               or args.recalibrate)
    if not shipped:
        from jspec import demo_chat
        from jspec.fetch import FetchError, resolve_model
        try:
            model = resolve_model(args.chat_model)
        except FetchError as e:
            print(f"note: cannot fetch {args.chat_model} ({e}); running the shipped 6.7M "
                  "model's demo instead", file=sys.stderr)
        else:
            return demo_chat.run(model, args.message, args.max_new_tokens or 256,
                                 steps=args.spec_steps or demo_chat.CHAIN, repeats=args.repeats,
                                 kernels=args.kernels, compile_cache=args.compile_cache,
                                 quantize=args.quantize)
    if args.quantize:
        raise ValueError("--quantize applies to the chat demo (SmolLM2); the shipped 6.7M "
                         "model's demo runs its float weights")
    model = None if args.model in (None, "default") else args.model
    return demo.run(model, args.prompt, args.max_new_tokens or 128, recalibrate=args.recalibrate,
                    repeats=args.repeats, drafter_kind=args.drafter, kernels=args.kernels,
                    compile_cache=args.compile_cache,
                    extra_drafters=demo.parse_extra(args.extra_drafter))
