"""jax's persistent compilation cache, on by default for every entry point (``import jspec``:
the library, the CLI, the runner, the server, the demo): compiled programs are written to
``$JSPEC_CACHE_DIR/xla`` (default ``~/.cache/jspec/xla``) and a later process with the same
program, jax version, backend and XLA flags reads it instead of compiling.

Opt out with ``JSPEC_COMPILE_CACHE=0`` (or point jax elsewhere first: a cache directory already
set, by ``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``, is left alone). Programs that compile
in under a second are not written (jax's ``jax_persistent_cache_min_compile_time_secs``).

Sharing the directory between the processes of a pod is safe: jax keys each entry by a hash
of the program and everything that shapes its compilation, and writes an entry whole (a
temporary file, then a rename), so a reader sees a complete entry or none.
"""

from __future__ import annotations

import os

import jax

from jspec.cache import cache_dir

ENV = "JSPEC_COMPILE_CACHE"


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def enable(force: bool = False) -> str | None:
    """Turn the cache on (unless opted out, or a directory is already set); returns the
    directory in use, or None."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if not (force or enabled_by_env()):
        return None
    path = str(cache_dir() / "xla")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return path
