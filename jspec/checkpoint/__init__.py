"""Checkpoint I/O: Hugging Face safetensors, GGUF, llama2.c ``.bin`` and jspec's Orbax format.

:func:`load_target` picks the reader from what ``path`` looks like.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from jspec.checkpoint.common import CheckpointError, Progress, with_dtype
from jspec.checkpoint.gguf import is_gguf, load_gguf, load_gguf_config
from jspec.checkpoint.hf import (load_hf, load_hf_config, params_from_state_dict, save_hf,
                                 state_dict_from_params)
from jspec.checkpoint.llama2c import load_llama2c, read_header, save_llama2c
from jspec.checkpoint import orbax_io
from jspec.checkpoint.orbax_io import CONFIG_FILE, load_orbax, read_meta
from jspec.checkpoint.orbax_quant import load_quantized_orbax, save_quantized_orbax
from jspec.checkpoint.quantize import quantize_target
from jspec.config import LlamaConfig
from jspec.quant import as_quant_config
from jspec.target import Target, shard_target
from jspec.tokenizer import load_tokenizer

__all__ = ["CheckpointError", "load_target", "load_config", "detect_format", "load_hf", "save_hf",
           "params_from_state_dict", "state_dict_from_params", "load_llama2c", "load_gguf",
           "save_llama2c", "load_orbax", "save_orbax", "quantize_target"]


def detect_format(path: str | os.PathLike) -> str:
    """``"orbax"``, ``"hf"``, ``"gguf"`` or ``"llama2c"``; :class:`CheckpointError` otherwise."""
    p = Path(path)
    if p.is_dir():
        if (p / CONFIG_FILE).is_file():
            return "orbax"
        if (p / "config.json").is_file() and (
                (p / "model.safetensors").is_file()
                or (p / "model.safetensors.index.json").is_file()):
            return "hf"
        raise CheckpointError(
            f"{p}: directory is neither a jspec Orbax checkpoint ({CONFIG_FILE}) nor a "
            "Hugging Face one (config.json + model.safetensors[.index.json])")
    if is_gguf(p):
        return "gguf"
    if p.is_file() and p.suffix == ".gguf":
        return "gguf"      # open_gguf names what is wrong with it
    if p.is_file() and p.suffix == ".bin":
        return "llama2c"
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    raise CheckpointError(f"{p}: unrecognised checkpoint (want a directory, a .gguf or a llama2.c .bin)")


def load_target(path: str | os.PathLike, dtype=None, tokenizer: str | os.PathLike | None = None,
                progress: Progress | None = None, mesh=None, quantize=None) -> Target:
    """Load any supported checkpoint; ``tokenizer`` overrides the one found beside it.
    ``mesh``: parameters are read straight into their shardings on the mesh (HF safetensors
    slice by slice, Orbax by its sharded restore), so each process reads only what its devices
    hold; a llama2.c file is read whole and then placed. ``quantize``: ``"int8"``,
    ``"w8a8"``, ``"fp8"`` or a :class:`jspec.quant.QuantConfig` (:mod:`jspec.quant`); a
    GGUF's Q8_0 / Q4_0 blocks are kept as they are under int8 modes."""
    qc = as_quant_config(quantize)          # a bad mode fails before any weight is read
    fmt = detect_format(path)
    if fmt == "llama2c":
        target = load_llama2c(path, dtype, tokenizer=tokenizer, progress=progress)
        if mesh is not None:
            target = shard_target(target, mesh)
        return quantize_target(target, qc)
    if fmt == "gguf":
        from jspec.checkpoint.gguf_blocks import keeps_blocks, load_gguf_blocks
        target = (load_gguf_blocks(path, qc, dtype, progress, mesh) if keeps_blocks(qc) else
                  load_gguf(path, dtype, progress=progress, mesh=mesh, quantize=qc))
    elif fmt == "orbax" and "quant" in read_meta(path)["jspec"]:
        target = load_quantized_orbax(path, read_meta(path), dtype, mesh, qc)
    else:
        load = {"orbax": load_orbax, "hf": load_hf}[fmt]
        target = quantize_target(load(path, dtype, progress=progress, mesh=mesh), qc)
    if tokenizer is not None:
        cfg = target.config
        tok = load_tokenizer(tokenizer, eos_ids=cfg.eos_token_ids)
        target = dataclasses.replace(target, tokenizer=tok)
    return target


def save_orbax(target: Target, path: str | os.PathLike, overwrite: bool = False) -> None:
    """Write ``target`` as a jspec Orbax checkpoint; a quantized one keeps its quantized
    weights and scales (:mod:`jspec.checkpoint.orbax_quant`)."""
    from jspec.quant import is_quantized
    if is_quantized(target.params):
        save_quantized_orbax(target, path, overwrite)
    else:
        orbax_io.save_orbax(target, path, overwrite)


def load_config(path: str | os.PathLike, dtype=None) -> LlamaConfig:
    """The config :func:`load_target` would give ``path``, without reading any weights (what
    pairing a drafter with a target needs: ``python -m jspec.convert drafter``)."""
    fmt = detect_format(path)
    if fmt == "llama2c":
        return with_dtype(read_header(path)[0], dtype)
    if fmt == "orbax":
        return with_dtype(LlamaConfig.from_hf(read_meta(path)), dtype)
    if fmt == "gguf":
        return load_gguf_config(path, dtype if dtype is not None else "float32")
    return load_hf_config(path, dtype)
