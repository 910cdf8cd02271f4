"""Benchmarks: ``python -m jspec.bench {plain,forward,spec} ...``.

* ``plain``   — end-to-end greedy generation with :func:`jspec.generate`, optionally against
  transformers' ``generate`` on the same weights (speed ratio and token identity).
* ``forward`` — one Llama forward of 1 vs ``block`` tokens against a long KV cache: the
  cost ratio that bounds what speculative decoding can gain on this machine.
* ``spec``    — plain decoding, then each drafter as chain and tree (tokens/s, accept length,
  speedup), and ``--simulate`` forced accept lengths against the ideal speedup.

Each sub-benchmark is also a function returning table rows (``run_plain``,
``run_forward``) so tests and later benchmarks can call it directly.
"""

from jspec.bench.common import format_table
from jspec.bench.configs import RANDOM_CONFIGS, random_config

__all__ = ["format_table", "RANDOM_CONFIGS", "random_config", "run_plain", "run_forward"]


def run_plain(*args, **kwargs):
    from jspec.bench.plain import run_plain as _run
    return _run(*args, **kwargs)


def run_forward(*args, **kwargs):
    from jspec.bench.forward import run_forward as _run
    return _run(*args, **kwargs)
