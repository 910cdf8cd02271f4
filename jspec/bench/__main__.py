"""``python -m jspec.bench NAME ...``: one benchmark or measurement tool by name.

``plain``, ``spec`` and ``serve`` are in the package; from a source checkout's root also the
``benchmarks`` folder's tools (``forward``, ``anatomy``, ``plan``, ``serve-plan``, ``load``,
``long-run``, ``aot-kernels``, ``kernels``, ``phases``, ``device``). Each module registers its
own subcommand (:mod:`jspec.bench.registry`).
"""

from __future__ import annotations

import argparse
import sys

from jspec.bench import registry


def build_parser(commands: dict[str, registry.Command]) -> argparse.ArgumentParser:
    """The parser of ``commands`` (every registered one unless told)."""
    p = argparse.ArgumentParser(prog="python -m jspec.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench", required=True, metavar="NAME")
    for cmd in commands.values():
        registry.add_parser(sub, cmd)
    return p


def main(argv=None):
    """Run the command ``argv[0]`` with the rest of ``argv``; returns what it returns. Only
    that command's module is imported (every one for ``--help`` or an unknown name)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    one = registry.find(argv[0]) if argv and not argv[0].startswith("-") else None
    args = build_parser({one.name: one} if one else registry.commands()).parse_args(argv)
    return args.command.main(args)


if __name__ == "__main__":
    main(sys.argv[1:])
