"""Command-line arguments shared by ``python -m jspec`` subcommands (generate, tune, run) and
the benchmarks: nothing here imports a command, so any command can use it."""

from __future__ import annotations

import argparse


def parse_ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {s!r}")


def add_kernels_arg(p: argparse.ArgumentParser) -> None:
    from jspec.kernels import MODES
    p.add_argument("--kernels", choices=MODES, default="auto",
                   help="attention / verify-walk implementation (default auto: the Pallas "
                        "kernels on TPU/GPU, falling back to the reference with a logged "
                        "warning; the reference on CPU)")


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
