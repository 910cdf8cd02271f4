"""The compiled decoders of bucketed ``generate`` calls (:class:`jspec.plan.Plan`), one per
decoder and argument shapes, kept for the process: a call in a bucket already compiled runs
at once. A compile is logged at INFO on the ``jspec`` logger, with its shapes and seconds
(jax's persistent cache, :mod:`jspec.compile_cache`, makes a program another process
compiled quick to load). ``jax.clear_caches`` does not reach these; :func:`clear` does.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time

import jax

log = logging.getLogger("jspec")

_COMPILED: dict = {}


def get(decoder, args: tuple, kwargs: dict, what: str, options: dict | None = None):
    """``decoder.run`` compiled for ``args`` and its runtime keyword arguments ``kwargs``
    (sampling settings ``rows``, ``grammar``); ``what`` names it in the log (``plain decoding
    (greedy) for batch 4, ...``); ``options``: XLA options for this compile (None: XLA's
    defaults)."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    sig = (decoder, tree, tuple((x.shape, str(x.dtype)) for x in leaves))
    exe = _COMPILED.get(sig)
    if exe is None:
        log.info("compiling %s ...", what)
        t0 = time.perf_counter()
        exe = decoder.run.trace(decoder, *args, **kwargs).lower().compile(
            compiler_options=options)
        log.info("compiled %s in %.1f s", what, time.perf_counter() - t0)
        _COMPILED[sig] = exe
    return exe


def count() -> int:
    """How many decoders are compiled and kept."""
    return len(_COMPILED)


def clear() -> None:
    """Drop every kept decoder."""
    _COMPILED.clear()


def clear_all() -> None:
    """jax's caches and these: the next call traces anew (what a trace-time setting, like
    :func:`jspec.platform.target_platform`'s, needs)."""
    jax.clear_caches()
    clear()


@contextlib.contextmanager
def trace_setting(var: contextvars.ContextVar, value):
    """``var`` set to ``value`` for the programs traced inside (a trace-time choice such as
    the target platform or the CPU products), with every trace cache cleared on entry and
    exit: jax's caches are keyed on functions and shapes, not on such settings, so no program
    traced under one setting is reused under another."""
    clear_all()
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
        clear_all()
