"""``kernels="auto"``: resolution on the host, static refusal, and the logged fallback when a
kernel fails to compile (jspec.kernels.resolve)."""

import logging

import numpy as np
import pytest

import jspec
from jspec import kernels
from jspec.bench.configs import random_config
from jspec.target import Target


@pytest.fixture(autouse=True)
def _fresh_probe_cache():
    kernels._PROBED.clear()
    yield
    kernels._PROBED.clear()


CFG = random_config("tiny")                        # head_dim 16, vocab 256
GPU_CFG = CFG.replace(head_dim=64)                 # a head dim the GPU kernel takes unpadded


def test_auto_is_reference_on_cpu(caplog):
    assert kernels.default_backend() == "cpu"
    with caplog.at_level(logging.DEBUG, logger="jspec"):
        assert kernels.resolve("auto", CFG) == "reference"
        assert kernels.resolve("auto", CFG, num_nodes=8, max_depth=5) == "reference"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_concrete_modes_pass_through():
    for m in ("reference", "pallas_interpret", "pallas_interpret_gpu"):
        assert kernels.resolve(m, CFG) == m
    with pytest.raises(ValueError, match="choose one of"):
        kernels.resolve("fast", CFG)
    with pytest.raises(ValueError, match="resolve"):
        kernels.attention_fn("auto")
    with pytest.raises(ValueError, match="resolve"):
        kernels.walk_impl("auto")


def test_generate_defaults_to_auto():
    import inspect
    import argparse
    from jspec import cli, demo_cli
    assert inspect.signature(jspec.generate).parameters["kernels"].default == "auto"
    for add, argv in ((cli.add_generate_args, ["--model", "x", "--prompt", "a"]),
                      (demo_cli.add_args, [])):
        p = argparse.ArgumentParser()
        add(p)
        assert p.parse_args(argv).kernels == "auto"
        assert p.parse_args(argv + ["--kernels", "reference"]).kernels == "reference"


def test_explicit_pallas_on_cpu_errors():
    with pytest.raises(ValueError, match="kernels='pallas' needs a TPU or GPU"):
        kernels.resolve("pallas", CFG)


def test_failed_probe_falls_back_with_warning(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "default_backend", lambda: "gpu")
    calls = []

    def bad_probe(mode, key):
        calls.append(key)
        raise RuntimeError("Triton lowering exploded (fake)")

    monkeypatch.setattr(kernels, "probe", bad_probe)
    with caplog.at_level(logging.INFO, logger="jspec"):
        assert kernels.resolve("auto", GPU_CFG, page_size=16, num_nodes=8, max_depth=5) == "reference"
        # cached per shape key: a second call neither probes nor warns again
        assert kernels.resolve("auto", GPU_CFG, page_size=16, num_nodes=8, max_depth=5) == "reference"
    warns = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "jspec"]
    assert len(warns) == 1 and len(calls) == 1
    msg = warns[0].getMessage()
    assert "Triton lowering exploded" in msg and "RuntimeError" in msg and "reference" in msg
    # another shape key probes again
    assert kernels.resolve("auto", GPU_CFG, page_size=16, num_nodes=1) == "reference"
    assert len(calls) == 2


def test_successful_probe_resolves_to_pallas(monkeypatch):
    monkeypatch.setattr(kernels, "default_backend", lambda: "gpu")
    monkeypatch.setattr(kernels, "probe", lambda mode, key: None)
    assert kernels.resolve("auto", GPU_CFG, num_nodes=8, max_depth=5) == "pallas"


def test_static_refusal_is_info_for_auto_and_error_for_pallas(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "default_backend", lambda: "gpu")
    monkeypatch.setattr(kernels, "probe", lambda mode, key: pytest.fail("must not probe"))
    with caplog.at_level(logging.INFO, logger="jspec"):
        # The Triton kernel needs a power-of-two page size.
        assert kernels.resolve("auto", GPU_CFG, page_size=12) == "reference"
    infos = [r for r in caplog.records if r.name == "jspec" and r.levelno == logging.INFO]
    assert infos and "power of two" in infos[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with pytest.raises(ValueError, match="page_size to be a power of two"):
        kernels.resolve("pallas", GPU_CFG, page_size=12)
    # TPU: head_dim 64 would need padding to 128 (a page-pool copy per call): auto declines,
    # an explicit "pallas" pads as before.
    monkeypatch.setattr(kernels, "default_backend", lambda: "tpu")
    assert kernels.resolve("auto", GPU_CFG) == "reference"
    assert kernels.resolve("pallas", GPU_CFG) == "pallas"


def test_mesh_resolution_needs_heads_that_split(monkeypatch):
    """Under a mesh the kernels run per device on its KV heads: heads that do not divide over
    ``model`` resolve to the reference (auto) or are refused (explicit), before probing; heads
    that do are probed at one device's shapes."""
    monkeypatch.setattr(kernels, "default_backend", lambda: "gpu")
    probed = []
    monkeypatch.setattr(kernels, "probe", lambda mode, key: probed.append(key))

    class Mesh:
        def __init__(self, data, model):
            self.size, self.shape = data * model, {"data": data, "model": model}
    cfg = GPU_CFG                                  # 4 heads, 2 KV heads
    assert kernels.resolve("auto", cfg, mesh=Mesh(2, 4), batch=8) == "reference"
    with pytest.raises(ValueError, match="do not split over the mesh's 'model' axis of 4"):
        kernels.resolve("pallas_interpret", cfg, mesh=Mesh(2, 4))
    assert not probed
    assert kernels.resolve("auto", cfg, mesh=Mesh(4, 2), batch=8) == "pallas"
    (key,) = probed
    assert (key[1], key[2], key[9]) == (2, 1, 2)   # heads, KV heads and rows of one device


def test_generate_resolves_before_building_decoders(monkeypatch, caplog):
    """generate(kernels="auto") on a (faked) GPU whose kernel does not compile runs the
    reference decoder and logs the fallback instead of failing."""
    from jspec.bench.common import random_params
    seen = []
    real_resolve = kernels.resolve

    def spy(mode, *a, **kw):
        out = real_resolve(mode, *a, **kw)
        seen.append((mode, out, kw.get("num_nodes"), kw.get("max_depth")))
        return out

    monkeypatch.setattr(kernels, "default_backend", lambda: "gpu")
    monkeypatch.setattr(kernels, "probe", lambda mode, key: (_ for _ in ()).throw(
        RuntimeError("no Triton here")))
    import sys
    monkeypatch.setattr(sys.modules["jspec.plan"], "resolve_kernels", spy)
    cfg = CFG.replace(head_dim=16)
    target = Target(cfg, random_params(cfg))
    with caplog.at_level(logging.WARNING, logger="jspec"):
        res = jspec.generate(target, [[1, 5, 6]], max_new_tokens=3, stop_ids=[])
    assert len(res.tokens[0]) == 3
    assert seen == [("auto", "reference", 1, None)]
    assert any("no Triton here" in r.getMessage() for r in caplog.records)
    ref = jspec.generate(target, [[1, 5, 6]], max_new_tokens=3, stop_ids=[], kernels="reference")
    assert np.array_equal(res.tokens, ref.tokens)


@pytest.mark.parametrize("greedy", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_probe_compiles_the_interpret_kernels(greedy):
    """The real probe (abstract shapes, compile only) on CPU, through the interpret-mode
    kernels: the same code path "auto" runs on a TPU/GPU with mode "pallas"."""
    key = kernels._shape_key(CFG, 16, 4, 3, greedy, 2, 3, 6)
    kernels.probe("pallas_interpret", key)
    assert kernels.static_problem("gpu", key, pad_head_dim=False) is None
    assert "not native" in kernels.static_problem("tpu", key, pad_head_dim=False)
    assert kernels.static_problem("tpu", key, pad_head_dim=True) is None
