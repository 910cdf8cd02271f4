"""Shape-annotated state fields, checkable at run time.

A field declared ``tokens: Int["B max_new"]`` documents its shape where it is
declared, and :func:`check_shapes` verifies a concrete state against it (tests
call it on every state the driver produces), binding each named dimension once.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated

import jax


class _Dims:
    def __init__(self, dtype_kind: str):
        self.kind = dtype_kind

    def __getitem__(self, dims: str):
        return Annotated[jax.Array, (self.kind, tuple(dims.split()))]


SHARED_DIMS = ("B",)

Int = _Dims("int")
Float = _Dims("float")
Bool = _Dims("bool")
Key = _Dims("key")


def check_shapes(obj, dims: dict[str, int] | None = None) -> dict[str, int]:
    """Check every annotated array field of a dataclass; returns the bound dims."""
    dims = dict(dims or {})
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        meta = getattr(hints.get(f.name), "__metadata__", None)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            # A nested state has its own dims (a drafter's cache has other L, H ...);
            # only the batch is shared with the enclosing state.
            inner = check_shapes(value, {k: dims[k] for k in SHARED_DIMS if k in dims})
            dims.update({k: inner[k] for k in SHARED_DIMS if k in inner})
        if not meta:
            continue
        kind, names = meta[0]
        shape = tuple(value.shape)
        if len(shape) != len(names):
            raise AssertionError(f"{type(obj).__name__}.{f.name}: shape {shape} is not [{' '.join(names)}]")
        for n, s in zip(names, shape):
            if n.isdigit():
                bound = int(n)
            else:
                bound = dims.setdefault(n, s)
            if bound != s:
                raise AssertionError(f"{type(obj).__name__}.{f.name}: dim {n}={s}, expected {bound}")
        if kind == "key":
            ok = jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)
        else:
            dk = value.dtype.kind
            ok = {"int": dk in "iu", "float": dk == "f" or value.dtype.name == "bfloat16",
                  "bool": dk == "b"}[kind]
        if not ok:
            raise AssertionError(f"{type(obj).__name__}.{f.name}: dtype {value.dtype} is not {kind}")
    return dims
