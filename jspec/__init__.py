"""jspec: speculative decoding for JAX."""

from jspec import compile_cache as _compile_cache

_compile_cache.enable()        # jax's persistent cache, on by default (JSPEC_COMPILE_CACHE=0: off)

from jspec.config import ConfigError, LlamaConfig, RopeConfig
from jspec.generate import GenerationResult, generate, warmup
# Eager, unlike load_target: importing the submodule jspec.chat later would rebind the
# package's `chat` attribute to the module. It costs nothing (it needs only generate).
from jspec.chat import ChatResult, chat
from jspec.kv_cache import KVCacheExhaustedError
from jspec.sampling import SamplingConfig
from jspec.target import Target

__all__ = ["ChatResult", "ConfigError", "LlamaConfig", "RopeConfig", "GenerationResult",
           "chat", "generate", "warmup",
           "KVCacheExhaustedError", "SamplingConfig", "Target", "load_target"]


def load_target(path, dtype=None, tokenizer=None, mesh=None, quantize=None) -> Target:
    """Load a target from an HF directory, a jspec Orbax directory, a GGUF or a llama2.c
    ``.bin``; with ``mesh``, straight into its shardings; with ``quantize`` (``"int8"``,
    ``"w8a8"``, ``"fp8"``), its layer projections quantized (see
    :func:`jspec.checkpoint.load_target` and :mod:`jspec.quant`)."""
    from jspec.checkpoint import load_target as _load
    return _load(path, dtype=dtype, tokenizer=tokenizer, mesh=mesh, quantize=quantize)
