"""jspec's own checkpoint directory: ``jspec_config.json`` + Orbax params + tokenizer file.

An HF tokenizer's chat template and special tokens are written beside its ``tokenizer.json``
(``chat_template.jinja``, ``tokenizer_config.json``) by its ``save`` and read back by its loader.

The directory is assembled in a hidden sibling and renamed into place, so a reader never
sees a half-written checkpoint and a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jspec.checkpoint.common import (CheckpointError, Progress, check_shape, expected_shapes,
                                     flatten, no_progress, path_str, read_json, to_param,
                                     unflatten, with_dtype)
from jspec.config import LlamaConfig
from jspec.target import Target, param_shardings
from jspec.tokenizer import load_tokenizer

CONFIG_FILE = "jspec_config.json"
FORMAT = "jspec-orbax"
VERSION = 1
PARAMS_DIR = "params"


def save_orbax(target: Target, path: str | os.PathLike, overwrite: bool = False) -> None:
    write_checkpoint(target, path, target.params, overwrite)


def write_checkpoint(target: Target, path: str | os.PathLike, params, overwrite: bool = False,
                     info: dict | None = None) -> None:
    """The checkpoint directory of ``target`` with ``params`` as its Orbax tree (a float
    target's own, or a quantized one's stored arrays) and ``info`` added to ``jspec``."""
    with atomic_dir(path, overwrite) as tmp:
        tok = target.tokenizer
        tok_name = tok.filename if tok is not None and hasattr(tok, "save") else None
        meta = target.config.to_hf()
        meta["jspec"] = {"format": FORMAT, "version": VERSION, "params": PARAMS_DIR,
                         "tokenizer": tok_name,
                         "tokenizer_bos_id": tok.bos_id if tok_name is not None else None,
                         **(info or {})}
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        if tok_name is not None:
            tok.save(tmp / tok_name)
        ckptr = ocp.PyTreeCheckpointer()
        ckptr.save(tmp / PARAMS_DIR, params)
        ckptr.close()


def saved_tokenizer(d: Path, info: dict, cfg: LlamaConfig):
    """The tokenizer a checkpoint directory holds, or None."""
    if not info.get("tokenizer"):
        return None
    return load_tokenizer(d / info["tokenizer"], bos_id=info.get("tokenizer_bos_id"),
                          eos_ids=cfg.eos_token_ids)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False):
    """Yield a hidden sibling directory of ``path`` to fill; when the block ends without an
    error it replaces ``path`` (:func:`move_into_place`), otherwise it is removed, so
    ``path`` is never half written. An existing ``path`` needs ``overwrite``."""
    dst = Path(path).absolute()
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists (pass overwrite=True to replace it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        yield tmp
        move_into_place(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_into_place(tmp: Path, dst: Path) -> None:
    # A directory cannot be os.replace'd onto a non-empty one: park the old one first so
    # dst is always either the old checkpoint or the new one.
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
    try:
        os.replace(tmp, dst)
    except BaseException:
        if old is not None:
            os.replace(old, dst)
        raise
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def read_meta(path: str | os.PathLike, config_file: str = CONFIG_FILE, fmt: str = FORMAT,
              version: int = VERSION, what: str = "jspec Orbax checkpoint") -> dict:
    """The checkpoint's JSON metadata, checked for jspec's ``format`` and ``version`` (a
    target's by default; drafters pass their own file and format)."""
    f = Path(path) / config_file
    meta = read_json(f)
    info = meta.get("jspec") if isinstance(meta, dict) else None
    if not isinstance(info, dict) or info.get("format") != fmt:
        raise CheckpointError(f"{f}: not a {what} (no jspec.format={fmt!r})")
    if info.get("version") != version:
        raise CheckpointError(f"{f}: jspec.version={info.get('version')!r}, this build reads "
                              f"version {version}")
    return meta


# Orbax and tensorstore report a damaged params directory (a file deleted or cut short) as a
# bare AttributeError/ValueError from deep inside, or as metadata that is silently None. Every
# read of one goes through stored_tensors or _restore, which say which checkpoint is at fault.
def _unreadable(pdir: Path, cause) -> CheckpointError:
    return CheckpointError(f"{pdir}: unreadable Orbax checkpoint ({cause}; was a file deleted "
                           "or cut short?)")


def stored_tensors(ckptr, pdir: Path) -> dict:
    """Flat ``{path: array metadata}`` of the PyTree checkpoint in ``pdir``, from its metadata
    alone (no tensor data is read)."""
    try:
        item = ckptr.metadata(pdir).item_metadata
    except Exception as e:
        raise _unreadable(pdir, f"reading its metadata: {e}") from e
    if item is None:      # Orbax logs a metadata file it cannot parse and returns none
        raise _unreadable(pdir, "no _METADATA file" if not (pdir / "_METADATA").is_file()
                          else "Orbax could not read its metadata")
    return flatten(item.tree)


def _restore(ckptr, pdir: Path, args) -> dict:
    try:
        return flatten(ckptr.restore(pdir, args=ocp.args.PyTreeRestore(restore_args=args)))
    except Exception as e:   # tensorstore's message names the tensor and the byte range
        raise _unreadable(pdir, f"reading its tensors: {e}") from e
    finally:
        ckptr.close()


def restore_numpy(ckptr, pdir, paths) -> dict:
    """Restore the flat ``paths`` of a PyTree checkpoint as host numpy arrays, so the saved
    sharding/topology never matters; closes ``ckptr``."""
    args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                  unflatten({p: 0 for p in paths}))
    return _restore(ckptr, pdir, args)


def restore_sharded(ckptr, pdir, shardings: dict, dtypes: dict) -> dict:
    """Restore the flat paths of ``shardings`` straight into those shardings (Orbax reads the
    blocks this process's devices hold), cast to ``dtypes[path]``; closes ``ckptr``."""
    args = unflatten({p: ocp.ArrayRestoreArgs(sharding=sh, dtype=jnp.dtype(dtypes[p]))
                      for p, sh in shardings.items()})
    return _restore(ckptr, pdir, args)


def load_orbax(path: str | os.PathLike, dtype=None, progress: Progress | None = None,
               mesh=None) -> Target:
    """``mesh``: restore every parameter straight into its sharding on the mesh (Orbax reads
    the blocks each process's devices hold), not whole on the host."""
    d = Path(path).absolute()
    meta = read_meta(d)
    info = meta["jspec"]
    cfg = with_dtype(LlamaConfig.from_hf(meta), dtype)
    shapes = expected_shapes(cfg)
    ckptr = ocp.PyTreeCheckpointer()
    pdir = d / info.get("params", PARAMS_DIR)
    stored = stored_tensors(ckptr, pdir)
    # Shapes come from metadata, so a mismatch is reported before any array is read.
    for p, shape in shapes.items():
        if p not in stored:
            raise CheckpointError(f"checkpoint is missing tensor {path_str(p)!r} "
                                  f"(expected shape {shape})")
        check_shape(path_str(p), shape, stored[p].shape)
    extra = sorted(path_str(p) for p in stored if p not in shapes)
    if extra:
        raise CheckpointError(f"checkpoint has tensors the config does not: {extra[:5]}")
    if mesh is not None:
        sh = flatten(param_shardings(cfg, mesh))
        flat = restore_sharded(ckptr, pdir, {p: sh[p] for p in stored},
                               {p: cfg.dtype for p in stored})
    else:
        raw = restore_numpy(ckptr, pdir, stored)
        flat = {p: to_param(raw[p], cfg.dtype)
                for p in (progress or no_progress)(list(shapes), total=len(shapes))}
    return Target(cfg, unflatten(flat), saved_tokenizer(d, info, cfg))
