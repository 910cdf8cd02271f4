"""Methods of a frozen dataclass compiled by ``jax.jit`` with the instance static and with the
instance's XLA options (its ``compiler_options``: ``(name, value)`` pairs).

Why: jit fixes its options when it wraps a function, but an option can depend on the
parameters a program serves. A W8A8 target on CPU needs XLA's loop emitters for its verify
rows to keep their 1-token step's bits inside a loop
(:func:`jspec.invariant_attention.compiler_options`); without them the serving engine's
speculative output parted from plain decoding (stories260K: tokens, and 0.09 in a
logprob). Every program over one target takes the same options (the engine's
:class:`jspec.engine.programs.Programs`, its prompt :class:`jspec.scoring.Scorer`), so that
its logprobs agree wherever they are computed. So each method keeps one jitted function per
distinct set of options, made on first use; equal instances share it and its compiled
programs, as a plain ``jax.jit`` with ``self`` static would.
"""

from __future__ import annotations

import functools

import jax

from jspec.invariant_attention import compiler_options


class CompiledMethod:
    """``fn`` jitted with ``self`` and ``static`` static and ``donate`` donated. Through an
    instance it is the bound jitted method; through the class, ``Cls.name(obj, ...)`` and
    ``Cls.name.trace(obj, ...)`` (ahead-of-time: ``.lower().compile()``) take ``obj``'s
    options too."""

    def __init__(self, fn, static: tuple[str, ...], donate: tuple[str, ...]):
        self.fn, self.static, self.donate = fn, ("self", *static), donate
        self.by_options: dict = {}
        functools.update_wrapper(self, fn)

    def jitted(self, options: tuple = ()):
        f = self.by_options.get(options)
        if f is None:
            f = jax.jit(self.fn, static_argnames=self.static, donate_argnames=self.donate,
                        compiler_options=dict(options) or None)
            self.by_options[options] = f
        return f

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return self.jitted(obj.compiler_options).__get__(obj, owner)

    def __call__(self, obj, *args, **kwargs):
        return self.jitted(obj.compiler_options)(obj, *args, **kwargs)

    def trace(self, obj, *args, **kwargs):
        return self.jitted(obj.compiler_options).trace(obj, *args, **kwargs)


def compiled(static: tuple[str, ...] = (), donate: tuple[str, ...] = ()):
    """Decorate a method as a :class:`CompiledMethod`."""
    return lambda fn: CompiledMethod(fn, tuple(static), tuple(donate))


def options_for(params) -> tuple:
    """The XLA options of a program over ``params``
    (:func:`jspec.invariant_attention.compiler_options`) as the hashable pairs an instance
    keeps; ``()``: XLA's defaults."""
    return tuple(sorted((compiler_options(params) or {}).items()))
