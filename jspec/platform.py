"""The platform a program is built for.

Usually ``jax.default_backend()``. A deviceless ahead-of-time compile (``python -m jspec.bench
anatomy --aot v5e``: TPU programs compiled on a CPU host with libtpu) builds for another
platform than the one jax runs on; inside :func:`building_for` the platform-dependent choices
(the CPU product form of :func:`jspec.serving_layout.linear`, the scanned layer stack, the kernels that
``kernels="auto"`` picks) follow the target platform instead of the host's.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

from jspec import executables

PLATFORMS = ("cpu", "gpu", "tpu")
_target: contextvars.ContextVar[str | None] = contextvars.ContextVar("jspec_platform", default=None)


def target_platform() -> str:
    """"cpu", "gpu" or "tpu": the platform programs traced now will run on."""
    return _target.get() or jax.default_backend()


@contextlib.contextmanager
def building_for(platform: str):
    """Trace programs for ``platform`` (see the module docstring).

    jax's trace caches are keyed on functions and shapes, not on this setting, so they are
    cleared on entry and exit: a program traced for one platform is never reused for another.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"platform {platform!r}: choose one of {PLATFORMS}")
    with executables.trace_setting(_target, platform):
        yield
