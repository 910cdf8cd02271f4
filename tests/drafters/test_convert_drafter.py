"""``python -m jspec.convert drafter``: every published drafter layout to jspec's Orbax format
and back, checked against the target it is paired with, exact after conversion, and never
half-written.

The CLI runs in-process (``jspec.convert.main(argv)``). The synthetic HF checkpoints, the tiny
target and the plain-decoding reference are test_drafter_checkpoint's (helpers.drafter_layouts),
so the speculative programs compiled here are the ones that module compiles (shared through the
run's cache).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
from safetensors.numpy import load_file

from jspec.checkpoint import load_config, load_target, save_hf, save_llama2c, save_orbax
from jspec.checkpoint.common import expected_shapes, flatten, unflatten
from jspec.convert import main
from jspec.drafters import load_drafter, save_drafter
from jspec.target import Target

from helpers.drafter_layouts import (TCFG, V, assert_exact, dflash_ckpt, eagle1_ckpt, eagle3_ckpt,  # noqa: F401,E501
                                     medusa_fd_ckpt, medusa_vllm_ckpt, mtp_ckpt, plain, target)
from helpers.tiny_targets import l2c_target, tiny_target

# Each layout as test_drafter_checkpoint writes it (same specs, so the same compiled programs).
MAKE = {
    "eagle1": lambda p: eagle1_ckpt(p, True),
    "eagle3": lambda p: eagle3_ckpt(p),
    "mtp": lambda p: mtp_ckpt(p, 1, True),
    "medusa-fasterdecoding": lambda p: medusa_fd_ckpt(p, heads=3, layers=2),
    "medusa-vllm": lambda p: medusa_vllm_ckpt(p, heads=3, layers=2),
    "medusa-vllm-truncated": lambda p: medusa_vllm_ckpt(
        p, Vd=40, token_map=np.sort(np.random.default_rng(3).choice(V, 40, replace=False))),
    "dflash": lambda p: dflash_ckpt(p),
}
KIND = {"medusa-fasterdecoding": "medusa", "medusa-vllm": "medusa",
        "medusa-vllm-truncated": "medusa"}
# What the loaders read past, so a written checkpoint does not hold it: the target's
# embeddings stored beside a drafter, EAGLE-3's t2d (unused at inference).
IGNORED = {"eagle1": {"embed_tokens.weight"}, "eagle3": {"embed_tokens.weight", "t2d"},
           "mtp": {"model.embed_tokens.weight",
                   f"model.layers.{TCFG.num_layers}.embed_tokens.weight"}}
# The HF layout to write back (jspec's Orbax format does not record Medusa's).
BACK = {"medusa-vllm": ["--layout", "vllm"], "medusa-vllm-truncated": ["--layout", "vllm"]}


def convert(*args) -> int:
    return main(["drafter", *map(str, args)])


def last_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The target's checkpoint (only its config is read: random numpy weights, no flax init)."""
    d = tmp_path_factory.mktemp("target") / "target"
    rng = np.random.default_rng(0)
    save_orbax(Target(TCFG, unflatten({p: rng.standard_normal(s).astype(np.float32)
                                       for p, s in expected_shapes(TCFG).items()})), d)
    return d


def assert_same_params(a, b):
    fa, fb = flatten(a.params), flatten(b.params)
    assert fa.keys() == fb.keys()
    for k in fa:
        x, y = np.asarray(fa[k]), np.asarray(fb[k])
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), k


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("layout", list(MAKE))
def test_hf_orbax_hf_is_bit_exact(tmp_path, target_dir, layout):
    src, tensors = MAKE[layout](tmp_path / "src")
    assert convert(src, tmp_path / "orbax", "--target", target_dir) == 0
    assert convert(tmp_path / "orbax", tmp_path / "hf", "--target", target_dir, "--to", "hf",
                   *BACK.get(layout, [])) == 0
    assert sorted(os.listdir(tmp_path)) == ["hf", "orbax", "src"]     # no temporaries left
    out = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(out) == set(tensors) - IGNORED.get(layout, set())
    for name, arr in out.items():
        want = tensors[name]
        assert (arr.dtype, arr.shape) == (want.dtype, want.shape), name
        assert arr.tobytes() == want.tobytes(), name                  # bit for bit
    # The written config describes the same drafter.
    back, ref = load_drafter(tmp_path / "hf", TCFG), load_drafter(src, TCFG)
    assert back.module == ref.module and back.kind == KIND.get(layout, layout)


# ----------------------------------------------------------------- exactness
@pytest.mark.parametrize("layout", ["eagle1", "eagle3", "mtp", "medusa-fasterdecoding",
                                    "medusa-vllm", "dflash"])
def test_converted_drafter_is_exact(tmp_path, target_dir, target, plain, layout):
    src, _ = MAKE[layout](tmp_path / "src")
    assert convert(src, tmp_path / "orbax", "--target", target_dir) == 0
    d = load_drafter(tmp_path / "orbax", TCFG)
    ref = load_drafter(src, TCFG)
    assert d.module == ref.module
    assert_same_params(d, ref)
    assert_exact(target, plain, d)          # speculative greedy == plain greedy


# -------------------------------------------------------------------- errors
def test_mismatched_target_fails_before_writing(tmp_path, target_dir, capsys):
    # An HF drafter built for a 100-token vocabulary; the target has 97.
    src, _ = eagle3_ckpt(tmp_path / "src", vocab_size=100)
    assert convert(src, tmp_path / "out", "--target", target_dir) == 2
    line = last_line(capsys)
    assert line.startswith("error: ") and "100" in line and "97" in line, line
    # A jspec Orbax drafter paired with a target of another hidden size, on the way to HF.
    save_drafter(load_drafter(eagle1_ckpt(tmp_path / "e1", True)[0], TCFG), tmp_path / "e1o")
    save_orbax(tiny_target(vocab_size=V), tmp_path / "small")          # hidden size 16
    assert convert(tmp_path / "e1o", tmp_path / "out", "--target", tmp_path / "small",
                   "--to", "hf") == 2
    line = last_line(capsys)
    assert line.startswith("error: ") and "hidden size" in line, line
    assert not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]   # no temporaries


def test_refusals(tmp_path, target_dir, capsys):
    src, _ = eagle3_ckpt(tmp_path / "src")
    (tmp_path / "out").mkdir()
    assert convert(src, tmp_path / "out", "--target", target_dir) == 2
    assert "already exists" in last_line(capsys) and os.listdir(tmp_path / "out") == []
    assert convert(src, tmp_path / "out", "--target", target_dir, "--to", "hf",
                   "--layout", "vllm", "--overwrite") == 2
    assert "drafter, whose HF layouts are" in last_line(capsys)
    assert os.listdir(tmp_path / "out") == []
    assert convert(src, src, "--target", target_dir, "--overwrite") == 2
    assert "DST is SRC" in last_line(capsys)
    assert convert(src, tmp_path / "out", "--target", target_dir, "--overwrite") == 0
    assert load_drafter(tmp_path / "out", TCFG).kind == "eagle3"
    with pytest.raises(SystemExit):     # --target is required
        convert(src, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def _interrupt_writing(monkeypatch, to, hits):
    """Ctrl-C while the saver writes tensors: after Orbax wrote the params / half-way
    through the safetensors file."""
    if to == "orbax":
        save = ocp.PyTreeCheckpointer.save

        def fake(self, *a, **kw):
            save(self, *a, **kw)
            hits.append(1)
            raise KeyboardInterrupt
        monkeypatch.setattr(ocp.PyTreeCheckpointer, "save", fake)
    else:
        def fake(tensors, filename, metadata=None):
            Path(filename).write_bytes(b"\0" * 100)
            hits.append(1)
            raise KeyboardInterrupt
        monkeypatch.setattr(safetensors.numpy, "serialize_file", fake)


def _interrupt_renaming(monkeypatch, dst, hits):
    """Ctrl-C at the last step: everything written, the (first) rename onto DST not done."""
    replace = os.replace

    def fake(a, b, **kw):
        if not hits and Path(b).absolute() == dst.absolute():
            hits.append(1)
            raise KeyboardInterrupt
        return replace(a, b, **kw)
    monkeypatch.setattr(os, "replace", fake)


@pytest.mark.parametrize("to", ["orbax", "hf"])
@pytest.mark.parametrize("when", ["writing", "renaming"])
@pytest.mark.parametrize("old", [False, True], ids=["new", "overwrite"])
def test_interrupted_write_leaves_nothing(tmp_path, target_dir, monkeypatch, capsys,
                                          to, when, old):
    hf, _ = eagle3_ckpt(tmp_path / "src")
    src = hf
    if to == "hf":          # the other direction: a jspec Orbax drafter to HF
        src = tmp_path / "orbax"
        save_drafter(load_drafter(hf, TCFG), src)
    dst = tmp_path / "out"
    extra = []
    if old:                 # --overwrite of an existing DST keeps it until the new one is whole
        dst.mkdir()
        (dst / "old").write_text("old")
        extra = ["--overwrite"]
    before = sorted(os.listdir(tmp_path))
    hits = []
    if when == "writing":
        _interrupt_writing(monkeypatch, to, hits)
    else:
        _interrupt_renaming(monkeypatch, dst, hits)
    assert convert(src, dst, "--target", target_dir, "--to", to, *extra) == 130
    assert hits, "the simulated interruption was not reached (the saver changed?)"
    assert "interrupted" in last_line(capsys)
    assert sorted(os.listdir(tmp_path)) == before     # no DST, no hidden temporaries
    if old:
        assert os.listdir(dst) == ["old"]


# --------------------------------------------------------------- load_config
def test_load_config_is_load_targets(tmp_path):
    save_orbax(tiny_target(), tmp_path / "orbax")
    save_hf(tiny_target(tied=False), tmp_path / "hf")
    save_llama2c(l2c_target(True), tmp_path / "m.bin")
    for p in (tmp_path / "orbax", tmp_path / "hf", tmp_path / "m.bin"):
        assert load_config(p) == load_target(p).config, p
        assert load_config(p, dtype="bfloat16") == load_target(p, dtype="bfloat16").config, p
