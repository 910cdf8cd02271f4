"""Damaged inputs and interrupted writes (issue 14's bug classes).

- A corrupt or truncated checkpoint (safetensors, a sharded index missing a shard, an Orbax
  directory with a file deleted or cut short, a config.json that is not JSON, a llama2.c
  ``.bin`` cut short) fails with a jspec error naming the file and what is wrong, never a
  raw safetensors/Orbax/tensorstore exception.
- An interrupted or failed ``python -m jspec.convert`` leaves no DST, no hidden temporary
  beside it, and an existing DST (``--overwrite``) as it was.
- An EAGLE-3 checkpoint whose ``d2t`` is all zeros over a reduced draft vocabulary (the
  peers' "d2t saved as zeros / never filled" bug) is reported on load.

Tiny targets and drafters (helpers.tiny_targets and helpers.drafter_layouts); nothing here
compiles a decoding program.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jspec.checkpoint import (CheckpointError, load_target, save_hf, save_llama2c, save_orbax,
                              state_dict_from_params)
from jspec.checkpoint import orbax_io
from jspec.checkpoint.common import expected_shapes, flatten, unflatten
from jspec.config import ConfigError
from jspec.convert import main as convert_main
from jspec.drafters import Drafter, load_drafter, random_drafter, save_drafter
from jspec.drafters.vocab import set_draft_vocab
from jspec.target import Target

from helpers.drafter_layouts import TCFG, V, eagle3_ckpt, write
from helpers.tiny_targets import l2c_target, tiny_target, tiny_tokenizer


def cut(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:int(len(data) * keep)])


def raises_naming(fn, exc, file, *words):
    """``fn()`` raises ``exc`` whose message names ``file`` (its full path) and every word."""
    with pytest.raises(exc) as e:
        fn()
    msg = str(e.value)
    assert str(file) in msg, msg
    rest = msg.replace(str(file), "")     # tmp_path holds the test's name: "truncated", ...
    for w in words:
        assert w in rest, (w, msg)


# ------------------------------------------------------------------ safetensors
@pytest.fixture
def hf_target(tmp_path):
    save_hf(tiny_target(), tmp_path / "hf")
    return tmp_path / "hf"


@pytest.fixture
def hf_drafter(tmp_path):
    return eagle3_ckpt(tmp_path / "e3")[0]


LOADERS = {"target": load_target, "drafter": lambda p: load_drafter(p, TCFG)}


@pytest.mark.parametrize("what", list(LOADERS))
def test_truncated_safetensors(request, what):
    d = request.getfixturevalue(f"hf_{what}")
    f = d / "model.safetensors"
    size = f.stat().st_size
    cut(f)
    raises_naming(lambda: LOADERS[what](d), CheckpointError, f, "truncated",
                  f"{size // 2} bytes", f"describes {size}")


@pytest.mark.parametrize("what", list(LOADERS))
def test_truncated_inside_the_header(request, what):
    d = request.getfixturevalue(f"hf_{what}")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:40])      # the length and part of the JSON header
    raises_naming(lambda: LOADERS[what](d), CheckpointError, f, "truncated", "40 bytes")


@pytest.mark.parametrize("what", list(LOADERS))
@pytest.mark.parametrize("data", [b"\xff" * 64, b"PK\x03\x04" + b"\0" * 60,
                                  (12).to_bytes(8, "little") + b"{not json!!}"],
                         ids=["huge-header", "zip", "header-not-json"])
def test_garbage_safetensors(request, what, data):
    d = request.getfixturevalue(f"hf_{what}")
    (d / "model.safetensors").write_bytes(data)
    raises_naming(lambda: LOADERS[what](d), CheckpointError, d / "model.safetensors",
                  "not a safetensors file")


def test_missing_shard(tmp_path):
    t = tiny_target()
    sd = state_dict_from_params(t.config, t.params)
    d = write(tmp_path / "t", json.loads(t.config.to_json()), sd, shards=2)
    os.remove(d / "model-00002-of-00002.safetensors")
    raises_naming(lambda: load_target(d), CheckpointError, d / "model.safetensors.index.json",
                  "model-00002-of-00002.safetensors", "does not exist")
    p, tensors = eagle3_ckpt(tmp_path / "e3")
    p = write(tmp_path / "e3s", json.loads((p / "config.json").read_text()), tensors, shards=2)
    os.remove(p / "model-00001-of-00002.safetensors")
    raises_naming(lambda: load_drafter(p, TCFG), CheckpointError,
                  p / "model.safetensors.index.json", "model-00001-of-00002.safetensors")


# ------------------------------------------------------------------ JSON configs
# A target's config.json is read by LlamaConfig (ConfigError), a drafter's by its loader.
@pytest.mark.parametrize("what,exc", [("target", ConfigError), ("drafter", CheckpointError)])
def test_config_not_json(request, what, exc):
    d = request.getfixturevalue(f"hf_{what}")
    (d / "config.json").write_text('{"hidden_size": 16,')
    raises_naming(lambda: LOADERS[what](d), exc, d / "config.json", "not valid JSON")


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json"])
def test_side_json_not_json(tmp_path, name):
    save_hf(tiny_target(tokenizer=tiny_tokenizer()), tmp_path)   # tokenizer_config needs one
    (tmp_path / name).write_text("{eos_token_id: 2}")
    raises_naming(lambda: load_target(tmp_path), CheckpointError, tmp_path / name,
                  "not valid JSON")


# ------------------------------------------------------------------ llama2.c
def test_truncated_llama2c(tmp_path):
    f = tmp_path / "m.bin"
    save_llama2c(l2c_target(True), f)
    size = f.stat().st_size
    cut(f)
    raises_naming(lambda: load_target(f), CheckpointError, f, "truncated", f"{size // 2} bytes",
                  f"implies {size} bytes")


# ------------------------------------------------------------------ Orbax
ORBAX_META = {"target": "jspec_config.json", "drafter": "jspec_drafter.json"}


@pytest.fixture(scope="module")
def orbax_saved(tmp_path_factory):
    """A jspec Orbax target and drafter, saved once; each test damages its own copy."""
    root = tmp_path_factory.mktemp("orbax")
    save_orbax(tiny_target(tied=False), root / "target")
    d = random_drafter("eagle3", TCFG, key=jax.random.key(7), vocab_size=50)
    # A real map (40..89), so the d2t tensor is on disk to be damaged, without the zero-d2t
    # warning on every load.
    save_drafter(Drafter(d.module, set_draft_vocab(d.module, d.params, np.arange(40, 90))),
                 root / "drafter")
    return root


def orbax_copy(orbax_saved, tmp_path, kind) -> Path:
    return Path(shutil.copytree(orbax_saved / kind, tmp_path / kind))


@pytest.mark.parametrize("kind", list(LOADERS))
def test_orbax_meta_not_json(orbax_saved, tmp_path, kind):
    d = orbax_copy(orbax_saved, tmp_path, kind)
    cut(d / ORBAX_META[kind])
    raises_naming(lambda: LOADERS[kind](d), CheckpointError, d / ORBAX_META[kind],
                  "not valid JSON")


@pytest.mark.parametrize("kind", list(LOADERS))
@pytest.mark.parametrize("mode", ["delete", "truncate"])
def test_orbax_metadata_damaged(orbax_saved, tmp_path, kind, mode):
    # Orbax returns no metadata here, which surfaced as AttributeError: 'NoneType' object has
    # no attribute 'tree'.
    d = orbax_copy(orbax_saved, tmp_path, kind)
    f = d / "params" / "_METADATA"
    f.unlink() if mode == "delete" else cut(f)
    cause = "no _METADATA file" if mode == "delete" else "could not read its metadata"
    raises_naming(lambda: LOADERS[kind](d), CheckpointError, d / "params",
                  "unreadable Orbax checkpoint", cause, "deleted or cut short")


@pytest.mark.parametrize("kind", list(LOADERS))
def test_orbax_any_file_damaged(orbax_saved, tmp_path, monkeypatch, kind):
    """Each file of the params directory deleted, then cut to half, one at a time: the load
    gives the saved values (Orbax leaves files it no longer reads) or a CheckpointError naming
    the directory; never a raw tensorstore error ("OUT_OF_RANGE: Error reading ... in OCDBT
    database") and never other values."""
    # The same config ~30 times: its shapes (a flax eval_shape, most of a tiny load) once.
    monkeypatch.setattr(orbax_io, "expected_shapes", functools.lru_cache(orbax_io.expected_shapes))
    load = LOADERS[kind]
    want = _host(load(orbax_saved / kind))
    files = sorted(f.relative_to(orbax_saved / kind)
                   for f in (orbax_saved / kind / "params").rglob("*") if f.is_file())
    failed = set()
    for i, rel in enumerate(files):
        for mode in ("delete", "truncate"):
            d = Path(shutil.copytree(orbax_saved / kind, tmp_path / f"{i}-{mode}"))
            (d / rel).unlink() if mode == "delete" else cut(d / rel)
            try:
                got = _host(load(d))
            except CheckpointError as e:
                assert str(d / "params") in str(e), (rel, mode, str(e))
                assert "unreadable Orbax checkpoint" in str(e), (rel, mode, str(e))
                failed.add(rel)
                continue
            assert got.keys() == want.keys(), (rel, mode)
            for k in want:
                assert got[k].tobytes() == want[k].tobytes(), (rel, mode, k)
    assert {r for r in failed if r.name != "_METADATA"}, "no tensor file was ever read?"


def _host(loaded) -> dict:
    return {k: np.asarray(v) for k, v in flatten(nn.unbox(loaded.params)).items()}


# ------------------------------------------------------------------ interrupted conversion
def _fail_mid_write(monkeypatch, exc, hits):
    """The Orbax save writes the params, then fails before the directory is renamed."""
    save = ocp.PyTreeCheckpointer.save

    def fake(self, *a, **kw):
        save(self, *a, **kw)
        hits.append(1)
        raise exc("simulated failure mid-write")
    monkeypatch.setattr(ocp.PyTreeCheckpointer, "save", fake)


def _old_dst(dst: Path, old: bool) -> list[str]:
    """An existing DST to ``--overwrite`` (the flags for it), or none."""
    if not old:
        return []
    dst.mkdir(exist_ok=True)
    (dst / "old").write_text("old")
    return ["--overwrite"]


def _left_as_it_was(tmp_path, before, dst, old):
    assert sorted(os.listdir(tmp_path)) == before        # no DST, no hidden temporaries
    if old:
        assert os.listdir(dst) == ["old"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("old", [False, True], ids=["new", "overwrite"])
def test_interrupted_target_conversion(tmp_path, monkeypatch, capsys, exc, old):
    save_hf(tiny_target(), tmp_path / "src-hf")
    save_llama2c(l2c_target(True), tmp_path / "src.bin")
    dst = tmp_path / "out"
    for src in (tmp_path / "src-hf", tmp_path / "src.bin"):
        argv = [str(src), str(dst), *_old_dst(dst, old)]
        before = sorted(os.listdir(tmp_path))
        hits = []
        with monkeypatch.context() as m:
            _fail_mid_write(m, exc, hits)
            if exc is KeyboardInterrupt:     # exit 130 and one line, as the drafter command
                assert convert_main(argv) == 130, src
                assert f"interrupted: {dst} left as it was" in capsys.readouterr().err
            else:                            # a bug: its traceback, and still nothing written
                with pytest.raises(RuntimeError, match="simulated"):
                    convert_main(argv)
        assert hits, src
        _left_as_it_was(tmp_path, before, dst, old)
    # Not interrupted, the same conversion replaces DST.
    assert convert_main([str(tmp_path / "src-hf"), str(dst), "--overwrite"]) == 0
    assert (dst / "jspec_config.json").is_file()


# test_convert_drafter interrupts the drafter command (Ctrl-C); here it fails outright.
@pytest.mark.parametrize("old", [False, True], ids=["new", "overwrite"])
def test_failed_drafter_conversion(tmp_path, monkeypatch, old):
    src, _ = eagle3_ckpt(tmp_path / "src")
    target = tmp_path / "target"        # only its config is read
    save_orbax(Target(TCFG, unflatten({p: np.zeros(s, np.float32)
                                       for p, s in expected_shapes(TCFG).items()})), target)
    dst = tmp_path / "out"
    argv = ["drafter", str(src), str(dst), "--target", str(target), *_old_dst(dst, old)]
    before = sorted(os.listdir(tmp_path))
    hits = []
    _fail_mid_write(monkeypatch, RuntimeError, hits)
    with pytest.raises(RuntimeError, match="simulated"):
        convert_main(argv)
    assert hits
    _left_as_it_was(tmp_path, before, dst, old)


# ------------------------------------------------------------------ d2t all zeros
VD = 48


def _d2t_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "jspec" and r.levelno == logging.WARNING and "d2t" in r.getMessage()]


def test_zero_d2t_checkpoint_warns(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="jspec")
    hf, _ = eagle3_ckpt(tmp_path / "hf", Vd=VD, d2t=np.zeros(VD))
    d = load_drafter(hf, TCFG)
    np.testing.assert_array_equal(d.params["d2t"], 0)   # a warning, not a refusal
    (msg,) = _d2t_warnings(caplog)
    for w in (str(hf), "d2t is all zeros", "draft id i proposes target id i",
              f"first {VD} of the target's {V}", "accepts almost nothing",
              "identity-prefix"):
        assert w in msg, (w, msg)
    caplog.clear()
    save_drafter(d, tmp_path / "orbax")                  # jspec's format warns the same
    load_drafter(tmp_path / "orbax", TCFG)
    (msg,) = _d2t_warnings(caplog)
    assert str(tmp_path / "orbax") in msg and "d2t is all zeros" in msg


def test_no_d2t_warning_otherwise(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="jspec")
    load_drafter(eagle3_ckpt(tmp_path / "ranked", Vd=VD)[0], TCFG)   # a real (nonzero) map
    # Vd == V: a zero d2t is the identity over the whole vocabulary (and is dropped).
    load_drafter(eagle3_ckpt(tmp_path / "full", Vd=V, d2t=np.zeros(V))[0], TCFG)
    # random_drafter's identity-prefix map is on purpose; built in memory, never reported.
    d = random_drafter("eagle3", TCFG, key=jax.random.key(3), vocab_size=VD)
    assert not np.asarray(d.params["d2t"]).any()
    assert _d2t_warnings(caplog) == []
