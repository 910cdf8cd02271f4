"""Benchmarks users run: ``python -m jspec.bench {plain,spec,serve} ...``.

* ``plain`` — end-to-end greedy generation with :func:`jspec.generate`, optionally against
  transformers' ``generate`` on the same weights (speed ratio and token identity).
* ``spec``  — plain decoding, then each drafter as chain and tree (tokens/s, accept length,
  speedup), and ``--simulate`` forced accept lengths against the ideal speedup
  (:mod:`jspec.bench.spec_simulate`, whose micro-benchmarks ``jspec tune`` also runs).
* ``serve`` — a skewed stream of requests: ``generate`` in batches vs the serving engine.

The measurement tools (``forward``, ``anatomy``, ``plan``, ``serve-plan``, ``load``,
``long-run``, ``aot-kernels``, ``kernels``, ``phases``, ``device``) live in the top-level
``benchmarks`` folder of a source checkout, outside the installed package; ``python -m
jspec.bench NAME`` runs them too from the repository root (:mod:`jspec.bench.registry`).

Each sub-benchmark is also a function returning table rows (``run_plain``) so tests and
later benchmarks can call it directly.
"""

from jspec.bench.common import format_table
from jspec.bench.configs import RANDOM_CONFIGS, random_config

__all__ = ["format_table", "RANDOM_CONFIGS", "random_config", "run_plain"]


def run_plain(*args, **kwargs):
    from jspec.bench.plain import run_plain as _run
    return _run(*args, **kwargs)
