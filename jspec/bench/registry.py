"""The subcommands of ``python -m jspec.bench``: each benchmark module registers itself.

A module that is a command declares it at module level::

    COMMAND = Command("long-run", "a ~16k-token generation and 200 consecutive calls ...",
                      add_args, main)

``add_args(parser)`` adds its flags, ``main(args)`` runs it on the parsed namespace. A
command lives in the module named after it (``long-run``: ``long_run.py``), in this package
(what users run: ``plain``, ``spec``, ``serve``) or, in a source checkout run from the
repository root, in the top-level ``benchmarks`` package (HLO analysis, the AOT matrix, the
plan, the device script, ...), which the installed wheel does not carry. The dispatch
(:mod:`jspec.bench.__main__`) imports only the command it runs, and every module of both
packages to list them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import pkgutil
import sys
from typing import Any, Callable

PACKAGES = ("jspec.bench", "benchmarks")


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, ``add_args(parser)`` and ``main(args)``
    (``description``: a longer text for its ``--help``, default the one-line help)."""
    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    main: Callable[[argparse.Namespace], Any]
    description: str | None = None


def packages() -> list:
    """``jspec.bench``, and ``benchmarks`` when it is importable and jspec's (it says so with
    ``JSPEC_BENCHMARKS = True``)."""
    out = [importlib.import_module(PACKAGES[0])]
    for name in PACKAGES[1:]:
        if importlib.util.find_spec(name) is not None:
            pkg = importlib.import_module(name)
            if getattr(pkg, "JSPEC_BENCHMARKS", False):
                out.append(pkg)
    return out


def _command_of(module_name: str) -> Command | None:
    cmd = getattr(importlib.import_module(module_name), "COMMAND", None)
    return cmd if isinstance(cmd, Command) else None


def find(name: str) -> Command | None:
    """The command ``name`` from the module named after it, importing no other command."""
    mod = name.replace("-", "_")
    for pkg in packages():
        if any(m.name == mod for m in pkgutil.iter_modules(pkg.__path__)):
            cmd = _command_of(f"{pkg.__name__}.{mod}")
            if cmd is not None and cmd.name == name:
                return cmd
    return None


def commands() -> dict[str, Command]:
    """Every registered command by name (the ``COMMAND`` of each module of the packages)."""
    out: dict[str, Command] = {}
    for pkg in packages():
        for m in pkgutil.iter_modules(pkg.__path__):
            if not m.name.startswith("_"):
                cmd = _command_of(f"{pkg.__name__}.{m.name}")
                if cmd is not None:
                    out.setdefault(cmd.name, cmd)
    return dict(sorted(out.items()))


def add_parser(sub, cmd: Command) -> argparse.ArgumentParser:
    """``cmd``'s subparser (its flags, and ``command`` set to it) under ``sub``."""
    s = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description or cmd.help,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.add_args(s)
    s.set_defaults(command=cmd)
    return s


def run_module(cmd: Command, argv=None):
    """A command run as its own module (``python -m benchmarks.phases ...``): the same flags
    as ``python -m jspec.bench phases ...``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    p = argparse.ArgumentParser(prog=f"python -m {spec.name}" if spec else None,
                                description=cmd.description or cmd.help,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.add_args(p)
    return cmd.main(p.parse_args(argv))
