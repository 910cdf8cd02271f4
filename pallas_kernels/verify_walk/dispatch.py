"""Entry points: static validation, then the kernel for the backend.

``impl`` picks the implementation explicitly; nothing falls back silently:

- ``"auto"``: the backend of ``jax.default_backend()``: ``tpu`` -> Mosaic kernel,
  ``gpu``/``cuda`` -> Triton kernel, ``cpu`` -> the jnp reference (there is no CPU
  kernel; that is the documented CPU path, not a fallback). Any other backend raises.
- ``"tpu"``, ``"gpu"``: that kernel, whatever the default backend (use it to
  cross-lower with ``jax.jit(f).trace(...).lower(lowering_platforms=(...,))``).
- ``"tpu_interpret"`` / ``"gpu_interpret"``: that kernel in Pallas interpret mode
  (TPU: ``pltpu.InterpretParams()``, which simulates SMEM/VMEM/DMA and raises on
  out-of-bounds reads, or under a device mesh, where its host callbacks cannot run, the
  generic HLO interpreter; GPU: the generic HLO interpreter). For tests on CPU.
- ``"reference"``: the jnp reference.

Validation is static only (shapes, dtypes, sizes). Dynamic preconditions, documented
and not checked: tokens in ``[0, V)``; ``first_child``/``next_sibling`` as built by
:func:`jspec.tree.build.build_tree` (topological order, increasing sibling lists); tree
depth <= ``max_depth``; ``probs`` rows non-negative; uniforms in ``[0, 1)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.verify_walk import kernel as _k
from pallas_kernels.verify_walk import reference as _ref

MAX_NODES = 64            # the packed tree mask and the walk's node width
MAX_DEPTH = 1 << 10
MAX_VOCAB_TPU = 1 << 18   # residual row + scan temporaries (~5 x 4V bytes) in VMEM
MAX_VOCAB_GPU = 1 << 22   # inverse CDF counts and chunk loops stay well inside int32
IMPLS = ("auto", "tpu", "gpu", "tpu_interpret", "gpu_interpret", "reference")


def _resolve(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    if backend == "tpu":
        return "tpu"
    if backend in ("gpu", "cuda"):
        return "gpu"
    if backend == "cpu":
        return "reference"
    raise ValueError(f"verify_walk: no kernel for backend {backend!r}; pass impl= explicitly")


def _check_int_rows(names, arrays, shape=None):
    for name, a in zip(names, arrays):
        if a.ndim != 2:
            raise ValueError(f"{name} must be [B, N], got shape {tuple(a.shape)}")
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
        if shape is None:
            shape = tuple(a.shape)
        elif tuple(a.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {shape} like "
                             f"{names[0]}")
    B, N = shape
    if B < 1:
        raise ValueError(f"batch must be >= 1, got {B}")
    if not 1 <= N <= MAX_NODES:
        raise ValueError(f"verify_walk supports 1 <= N <= {MAX_NODES} tree nodes, got N={N}")
    return B, N


def _check_depth(max_depth):
    if isinstance(max_depth, bool) or not isinstance(max_depth, (int, np.integer)):
        raise ValueError(f"max_depth must be a static int, got {max_depth!r}")
    if not 0 <= max_depth <= MAX_DEPTH:
        raise ValueError(f"max_depth must be in [0, {MAX_DEPTH}], got {max_depth}")
    return int(max_depth)


def validate_greedy(tokens, first_child, next_sibling, target_argmax, max_depth):
    _check_int_rows(("tokens", "first_child", "next_sibling", "target_argmax"),
                    (tokens, first_child, next_sibling, target_argmax))
    return _check_depth(max_depth)


def validate_sample(tokens, first_child, next_sibling, probs, u_accept, u_bonus, max_depth,
                    impl="reference"):
    B, N = _check_int_rows(("tokens", "first_child", "next_sibling"),
                           (tokens, first_child, next_sibling))
    if probs.ndim != 3 or tuple(probs.shape[:2]) != (B, N):
        raise ValueError(f"probs must be [B, N, V] = [{B}, {N}, V], got {tuple(probs.shape)}")
    if probs.dtype != jnp.float32:
        raise ValueError(f"probs must be float32, got {probs.dtype}")
    V = probs.shape[2]
    limit = MAX_VOCAB_TPU if impl.startswith("tpu") else MAX_VOCAB_GPU
    if not 1 <= V <= limit:
        raise ValueError(f"vocabulary size V={V} outside [1, {limit}] for impl {impl!r}")
    if tuple(u_accept.shape) != (B, N) or u_accept.dtype != jnp.float32:
        raise ValueError(f"u_accept must be float32 [{B}, {N}], got {u_accept.dtype} "
                         f"{tuple(u_accept.shape)}")
    if tuple(u_bonus.shape) != (B,) or u_bonus.dtype != jnp.float32:
        raise ValueError(f"u_bonus must be float32 [{B}], got {u_bonus.dtype} "
                         f"{tuple(u_bonus.shape)}")
    return _check_depth(max_depth)


def verify_walk_greedy(tokens, first_child, next_sibling, target_argmax, *, max_depth: int,
                       impl: str = "auto"):
    """Greedy verify walk. int32 ``[B, N]`` inputs.

    Returns ``(accept_index [B, S+1] int32 (-1 padded), accept_len [B], bonus [B])``.
    """
    impl = _resolve(impl)
    S = validate_greedy(tokens, first_child, next_sibling, target_argmax, max_depth)
    args = (tokens, first_child, next_sibling, target_argmax)
    if impl == "reference":
        return _ref.greedy_walk_ref(*args, max_depth=S)
    fn = _k.greedy_walk_tpu if impl.startswith("tpu") else _k.greedy_walk_gpu
    interpret = _interpret(impl)
    return _k.unpack(fn(*args, max_depth=S, interpret=interpret), S)


def verify_walk_sample(tokens, first_child, next_sibling, probs, u_accept, u_bonus, *,
                       max_depth: int, impl: str = "auto"):
    """Tree rejection-sampling verify walk (uniforms passed in, never drawn inside).

    ``probs [B, N, V]`` float32: target distribution after each node; ``u_accept [B, N]``,
    ``u_bonus [B]`` float32 in [0, 1). Returns ``(accept_index, accept_len, bonus)``.
    """
    impl = _resolve(impl)
    S = validate_sample(tokens, first_child, next_sibling, probs, u_accept, u_bonus,
                        max_depth, impl)
    args = (tokens, first_child, next_sibling, probs, u_accept, u_bonus)
    if impl == "reference":
        return _ref.sample_walk_ref(*args, max_depth=S)
    fn = _k.sample_walk_tpu if impl.startswith("tpu") else _k.sample_walk_gpu
    return _k.unpack(fn(*args, max_depth=S, interpret=_interpret(impl)), S)


def _interpret(impl: str):
    if impl == "tpu_interpret":
        # The TPU interpreter simulates memory through host callbacks, which do not run
        # inside a multi-device program; under a mesh the generic interpreter runs the kernel.
        return True if not jax.sharding.get_abstract_mesh().empty else pltpu.InterpretParams()
    return impl == "gpu_interpret"


def from_tree(tree):
    """``DraftTree`` -> the kernels' tree arguments ``(tokens, first_child, next_sibling)``."""
    return tree.tokens, tree.first_child, tree.next_sibling
