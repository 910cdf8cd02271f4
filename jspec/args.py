"""Command-line arguments shared by ``python -m jspec`` subcommands (generate, tune, run) and
the benchmarks: nothing here imports a command, so any command can use it."""

from __future__ import annotations

import argparse


def parse_ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {s!r}")


def parse_mesh(text: str) -> tuple[int, int]:
    """``--mesh DATAxMODEL`` -> ``(data, model)``."""
    try:
        data, model = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh wants DATAxMODEL (e.g. 2x4), got {text!r}") from None
    return data, model


def add_process_args(p, distributed_help: str) -> None:
    """The flags that join a multi-host run (:func:`jspec.distributed.join` reads them)."""
    p.add_argument("--distributed", action="store_true", help=distributed_help)
    p.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)


def add_kernels_arg(p: argparse.ArgumentParser) -> None:
    from jspec.kernels import MODES
    p.add_argument("--kernels", choices=MODES, default="auto",
                   help="attention / verify-walk implementation (default auto: the Pallas "
                        "kernels on TPU/GPU, falling back to the reference with a logged "
                        "warning; the reference on CPU)")


def add_quantize_arg(p: argparse.ArgumentParser) -> None:
    from jspec.quant import MODES
    p.add_argument("--quantize", choices=MODES, default=None,
                   help="quantize the target's layer weights at load (jspec.quant): int8 "
                        "(weight-only), w8a8 (int8 weights and activations) or fp8; a GGUF's "
                        "Q8_0/Q4_0 blocks are kept as they are under int8 modes. Default: the "
                        "checkpoint's float weights (the fastest on CPU, docs/quantization.md)")


def add_prefill_chunk_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="C",
                   help="prefill prompts C tokens at a time (default 512; jspec.prefill): "
                        "memory grows with a prompt's length, not its square")


def load_drafter_arg(spec: str, target):
    """A checkpoint directory, ``random:KIND[:DRAFT_VOCAB]`` for random weights, or
    ``KIND[:ARGS]`` for a kind made from arguments (``ngram[:MIN_N:MAX_N]`` prompt lookup,
    ``model:PATH`` an independent draft model; see each kind's registry entry)."""
    from jspec import drafters

    name, _, rest = spec.partition(":")
    entry = drafters.registry.KINDS.get(name)
    if entry is not None and entry.from_arg is not None:
        return drafters.Drafter(*entry.from_arg(rest, target))
    if spec.startswith("random:"):
        kind, *vd = spec.split(":")[1:]
        kw = {"vocab_size": int(vd[0])} if vd else {}
        return drafters.random_drafter(kind, target.config, **kw)
    return drafters.load_drafter(spec, target.config)


def add_response_format_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output (jspec.grammar; one of)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--response-format", metavar="JSON", help="an OpenAI-style response_format "
                   "object, inline or @FILE (json_object, json_schema, regex, choice, grammar)")
    x.add_argument("--json-schema", metavar="FILE", help="a JSON schema file: output validates")
    x.add_argument("--regex", help="output fully matches this regex")
    x.add_argument("--choices", help="comma-separated: output is exactly one of them")
    x.add_argument("--grammar", metavar="FILE", help="a context-free grammar in llguidance's "
                   "Lark dialect: output is a sentence of it (matched on the host)")


def response_format_of(args) -> dict | None:
    """The ``response_format`` the flags of :func:`add_response_format_args` ask for."""
    import json
    from pathlib import Path
    if args.response_format:
        raw = args.response_format
        text = Path(raw[1:]).read_text() if raw.startswith("@") else raw
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--response-format: not JSON ({e})") from None
    if args.json_schema:
        try:
            schema = json.loads(Path(args.json_schema).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema {args.json_schema}: not JSON ({e})") from None
        return {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
    if args.regex:
        return {"type": "regex", "regex": args.regex}
    if args.choices:
        return {"type": "choice", "choices": [c for c in args.choices.split(",") if c]}
    if args.grammar:
        return {"type": "grammar", "grammar": Path(args.grammar).read_text()}
    return None
