"""Hugging Face Llama checkpoints (``config.json`` + safetensors, single file or sharded).

The name mapping is one declarative table; loading walks it, reading each tensor lazily
with ``safe_open`` and checking its shape before the next is read.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jspec.checkpoint.common import (CheckpointError, Progress, check_shape, expected_shapes,
                                     flatten, no_progress, read_json, to_param, unflatten,
                                     with_dtype)
from jspec.config import LlamaConfig
from jspec.target import Target, param_shardings
from jspec.tokenizer import find_tokenizer, load_tokenizer

# (HF tensor name, flax param path, transpose). HF Linear weights are [out, in]; flax
# kernels are [in, out]. ``{i}`` is the layer index.
HF_LLAMA_GLOBAL = (
    ("model.embed_tokens.weight", "embed_tokens/embedding", False),
    ("model.norm.weight", "norm/scale", False),
)
HF_LLAMA_UNTIED = (
    ("lm_head.weight", "lm_head/kernel", True),
)
HF_LLAMA_LAYER = (
    ("model.layers.{i}.input_layernorm.weight", "layers_{i}/input_layernorm/scale", False),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers_{i}/self_attn/q_proj/kernel", True),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers_{i}/self_attn/k_proj/kernel", True),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers_{i}/self_attn/v_proj/kernel", True),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers_{i}/self_attn/o_proj/kernel", True),
    ("model.layers.{i}.post_attention_layernorm.weight",
     "layers_{i}/post_attention_layernorm/scale", False),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers_{i}/mlp/gate_proj/kernel", True),
    ("model.layers.{i}.mlp.up_proj.weight", "layers_{i}/mlp/up_proj/kernel", True),
    ("model.layers.{i}.mlp.down_proj.weight", "layers_{i}/mlp/down_proj/kernel", True),
)


def hf_table(cfg: LlamaConfig) -> list[tuple[str, tuple[str, ...], bool]]:
    """Every tensor this config needs, in file order. A tied config never reads lm_head."""
    rows = list(HF_LLAMA_GLOBAL)
    if not cfg.tie_word_embeddings:
        rows += HF_LLAMA_UNTIED
    out = [(n, tuple(p.split("/")), t) for n, p, t in rows]
    for i in range(cfg.num_layers):
        out += [(n.format(i=i), tuple(p.format(i=i).split("/")), t) for n, p, t in HF_LLAMA_LAYER]
    return out


def params_from_state_dict(cfg: LlamaConfig,
                           get_tensor: Mapping[str, np.ndarray] | Callable[[str], np.ndarray],
                           dtype=None, progress: Progress | None = None):
    """Flax params from HF-named arrays (a mapping, or a function raising KeyError)."""
    cfg = with_dtype(cfg, dtype)
    get = get_tensor.__getitem__ if isinstance(get_tensor, Mapping) else get_tensor
    shapes = expected_shapes(cfg)
    table = hf_table(cfg)
    flat = {}
    for name, path, transpose in (progress or no_progress)(table, total=len(table)):
        try:
            arr = get(name)
        except KeyError:
            raise CheckpointError(f"checkpoint is missing tensor {name!r} "
                                  f"(expected shape {_hf_shape(shapes[path], transpose)})") from None
        arr = np.asarray(arr)
        check_shape(name, _hf_shape(shapes[path], transpose), arr.shape)
        flat[path] = to_param(arr.T if transpose else arr, cfg.dtype)
    return unflatten(flat)


def sharded_params(cfg: LlamaConfig, tensors: "SafetensorsDir", mesh, progress=None):
    """Flax params placed on ``mesh`` (:func:`jspec.target.param_shardings`), each device's
    block read from the safetensors file by slice (``jax.make_array_from_callback``): a
    process reads only what its own devices hold, and the host holds one block at a time, so
    its peak memory stays near its share of the weights."""
    shardings = flatten(param_shardings(cfg, mesh))
    shapes = expected_shapes(cfg)
    flat = {}
    for name, path, transpose in (progress or no_progress)(hf_table(cfg), total=len(shapes)):
        try:
            check_shape(name, _hf_shape(shapes[path], transpose), tensors.shape(name))
        except KeyError:
            raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape "
                                  f"{_hf_shape(shapes[path], transpose)})") from None
        flat[path] = tensors.sharded(name, shardings[path], cfg.dtype, transpose)
    return unflatten(flat)


def state_dict_from_params(cfg: LlamaConfig, params) -> dict[str, np.ndarray]:
    """Inverse of :func:`params_from_state_dict`: HF-named host arrays."""
    flat = flatten(params)
    out = {}
    for name, path, transpose in hf_table(cfg):
        arr = np.asarray(flat[path])
        out[name] = np.ascontiguousarray(arr.T if transpose else arr)
    return out


def _hf_shape(shape, transpose):
    return tuple(reversed(shape)) if transpose else tuple(shape)


class SafetensorsDir(Mapping):
    """Lazy read-only view of a directory's safetensors tensors; open files stay open
    until :meth:`close` so each tensor is one seek, not one file open."""

    def __init__(self, path: str | os.PathLike, any_single_file: bool = False):
        """``any_single_file``: also accept a directory holding exactly one ``*.safetensors``
        under another name (drafters ship e.g. ``medusa_lm_head.safetensors``)."""
        d = Path(path)
        index = d / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = read_json(index)["weight_map"]
            except (KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: malformed index ({e!r})") from e
            self._where = {k: d / v for k, v in weight_map.items()}
            for f in set(self._where.values()):
                if not f.is_file():
                    raise CheckpointError(f"{index} names shard {f.name!r}, which does not exist")
        elif (d / "model.safetensors").is_file():
            self._where = {k: d / "model.safetensors" for k in _keys(d / "model.safetensors")}
        elif any_single_file and len(files := sorted(d.glob("*.safetensors"))) == 1:
            self._where = {k: files[0] for k in _keys(files[0])}
        else:
            raise CheckpointError(f"{d}: no model.safetensors or model.safetensors.index.json"
                                  + (" (nor exactly one *.safetensors file)" if any_single_file else ""))
        self._stack = contextlib.ExitStack()
        self._open: dict[Path, object] = {}

    def _handle(self, name: str):
        file = self._where[name]  # KeyError for a missing tensor, as Mapping requires
        if file not in self._open:
            with _reading(file):
                self._open[file] = self._stack.enter_context(safe_open(file, framework="numpy"))
        return file, self._open[file]

    def __getitem__(self, name: str) -> np.ndarray:
        file, f = self._handle(name)
        with _reading(file, name):   # a corrupt file, or the index named a tensor it lacks
            return f.get_tensor(name)

    def sharded(self, name: str, sharding, dtype, transpose: bool = False) -> jax.Array:
        """Tensor ``name`` (transposed if asked) as a ``dtype`` array placed by ``sharding``,
        each device's block read from the file by slice (``jax.make_array_from_callback``):
        a process reads only what its devices hold, one block at a time."""
        file, f = self._handle(name)
        lazy = f.get_slice(name)
        shape = tuple(lazy.get_shape())
        shape = shape[::-1] if transpose else shape

        def block(index):
            with _reading(file, name):
                arr = lazy[tuple(reversed(index)) if transpose else index]
            return np.asarray(arr.T if transpose else arr).astype(dtype, copy=False)
        return jax.make_array_from_callback(shape, sharding, block)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from its file header, without reading the data."""
        file, f = self._handle(name)
        with _reading(file, name):
            return tuple(f.get_slice(name).get_shape())

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)

    def close(self):
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _keys(file: Path) -> list[str]:
    with _reading(file), safe_open(file, framework="numpy") as f:
        return list(f.keys())


# safetensors' own errors ("incomplete metadata, file not fully covered") name neither the file
# nor the fault. The layout is simple enough to tell: an 8-byte little-endian header length,
# that many bytes of JSON, then the data its offsets describe.
_MAX_HEADER = 100_000_000    # safetensors refuses a longer header


@contextlib.contextmanager
def _reading(file: Path, tensor: str | None = None):
    """Any error reading ``file`` (``tensor`` in it) becomes a :class:`CheckpointError` naming
    the file and, where the bytes show it, what is wrong: truncated, or not safetensors."""
    try:
        yield
    except Exception as e:  # SafetensorError is not a public subclass of anything useful
        what = f"cannot read tensor {tensor!r}" if tensor else "not a readable safetensors file"
        problem = _safetensors_problem(file)
        raise CheckpointError(f"{file}: {what}" + (f": {problem}" if problem else "")
                              + f" ({e})") from e


def _safetensors_problem(file: Path) -> str | None:
    """Why ``file`` is not a whole safetensors file, or None when its layout looks sound."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            header = f.read(min(n, _MAX_HEADER))
    except OSError as e:
        return f"cannot open it ({e})"
    if len(head) < 8:
        return f"truncated: {size} bytes, shorter than the 8-byte header length"
    if n > _MAX_HEADER or not header.startswith(b"{"):
        return (f"not a safetensors file: its first 8 bytes give a header length of {n} "
                f"and the header does not start with '{{'")
    if len(header) < n:
        return f"truncated: {size} bytes, inside its {8 + n}-byte header"
    try:
        entries = json.loads(header)
        end = 8 + n + max((int(v["data_offsets"][1]) for k, v in entries.items()
                           if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "not a safetensors file: its header is not safetensors JSON"
    if size < end:
        return f"truncated: {size} bytes where its header describes {end}"
    return None


def load_hf_config(path: str | os.PathLike, dtype=None) -> LlamaConfig:
    d = Path(path)
    if not (d / "config.json").is_file():
        raise CheckpointError(f"{d}: no config.json")
    cfg = LlamaConfig.from_json_file(d / "config.json")
    gen = d / "generation_config.json"
    if gen.is_file():
        # generate() stops on generation_config's eos list, which may be wider than config's.
        eos = read_json(gen).get("eos_token_id")
        if eos is not None:
            cfg = cfg.replace(eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,))
    return with_dtype(cfg, dtype)


def load_hf(path: str | os.PathLike, dtype=None, progress: Progress | None = None,
            mesh=None) -> Target:
    """Load an HF Llama directory. A ``tokenizer.json`` or ``tok*.bin`` beside it is loaded,
    a ``tokenizer.json`` with the chat template and special tokens of ``chat_template.jinja``
    and ``tokenizer_config.json`` (:func:`jspec.tokenizer.read_chat_files`).
    ``mesh``: read each tensor slice-wise straight into its sharding on the mesh
    (:func:`sharded_params`), never the whole tensor on the host."""
    cfg = load_hf_config(path, dtype)
    with SafetensorsDir(path) as tensors:
        if mesh is not None:
            params = sharded_params(cfg, tensors, mesh, progress)
        else:
            params = params_from_state_dict(cfg, tensors, progress=progress)
    tok_path = find_tokenizer(path)
    tok = None
    if tok_path is not None:
        tok = load_tokenizer(tok_path, bos_id=_explicit_bos(path, cfg), eos_ids=cfg.eos_token_ids)
    return Target(cfg, params, tok)


def _explicit_bos(path, cfg: LlamaConfig) -> int | None:
    """BOS id when ``tokenizer_config.json`` asks for one; otherwise ``None`` lets the
    tokenizer's post-processor decide, as transformers does."""
    tc = Path(path) / "tokenizer_config.json"
    if tc.is_file() and read_json(tc).get("add_bos_token"):
        return cfg.bos_token_id
    return None


def save_hf(target: Target, path: str | os.PathLike) -> None:
    """Write ``config.json`` + ``model.safetensors`` (+ the tokenizer file, if any)."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(target.config.to_json())
    save_file(state_dict_from_params(target.config, target.params), d / "model.safetensors",
              metadata={"format": "pt"})
    if target.tokenizer is not None and hasattr(target.tokenizer, "save"):
        target.tokenizer.save(d / target.tokenizer.filename)
