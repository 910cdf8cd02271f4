"""Helpers shared by every checkpoint format: the error type, expected shapes, casting.

Every loader checks tensors against :func:`jspec.llama.abstract_params` one at a time,
so a bad checkpoint fails naming the tensor before the whole file has been read.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ConfigError, LlamaConfig
from jspec.llama import abstract_params

Path_ = tuple[str, ...]
# ``progress(iterable, total=n)`` -> iterable; ``tqdm`` has this signature.
Progress = Callable[..., Iterable]


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor, has one of the wrong shape, or is malformed."""


def read_json(f: str | os.PathLike) -> Any:
    """A checkpoint's JSON file (config, index, metadata); a missing or malformed one is a
    :class:`CheckpointError` naming it, not a bare ``JSONDecodeError``."""
    try:
        with open(f) as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: cannot read ({e})") from e


def with_dtype(cfg: LlamaConfig, dtype) -> LlamaConfig:
    """``cfg`` with its parameter dtype overridden (``None`` keeps the checkpoint's)."""
    if dtype is None:
        return cfg
    try:
        name = jnp.dtype(dtype).name
    except TypeError as e:
        raise ConfigError(f"dtype={dtype!r} is not a dtype") from e
    return cfg.replace(dtype=name)


def expected_shapes(cfg: LlamaConfig) -> dict[Path_, tuple[int, ...]]:
    """Flat ``{param path: shape}`` of the tree ``init_params(cfg)`` would build."""
    tree = nn.unbox(abstract_params(cfg))
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def path_str(path: Path_) -> str:
    return "/".join(path)


def check_shape(name: str, expected, actual) -> None:
    if tuple(expected) != tuple(actual):
        raise CheckpointError(
            f"tensor {name!r} has shape {tuple(actual)}, expected {tuple(expected)}")


def to_param(arr: np.ndarray, dtype: str) -> jax.Array:
    # Cast on the host (ml_dtypes handles bf16) so only the final dtype reaches the device.
    return jnp.asarray(np.asarray(arr).astype(dtype, copy=False))


def unflatten(flat: dict[Path_, Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = v
    return out


def flatten(params) -> dict[Path_, Any]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {tuple(k.key for k in path): leaf for path, leaf in flat}


def no_progress(it, total=None, **_):
    return it
