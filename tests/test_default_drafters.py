"""The drafters shipped with the default target (``checkpoints/default/drafters``).

Each loads with :func:`jspec.drafters.load_drafter`, and greedy speculative generation with
it gives exactly the target's plain greedy tokens; ``python -m jspec demo`` runs the EAGLE-3
one and reports its accept length and speedup.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "checkpoints" / "default"
TARGET = SHIPPED / "target"
DRAFTERS = SHIPPED / "drafters"
KINDS = ("eagle3", "eagle1", "medusa", "mtp")
PROMPTS = ["def fibonacci(n):", "class Parser:\n    def "]
NEW = 16

pytestmark = pytest.mark.skipif(not (DRAFTERS / "eagle3").exists(),
                                reason="checkpoints/default/drafters not shipped")


@pytest.fixture(scope="module")
def target():
    import jspec
    return jspec.load_target(TARGET)


@pytest.fixture(scope="module")
def plain(target):
    import jspec
    return jspec.generate(target, PROMPTS, max_new_tokens=NEW, stop_ids=[]).tokens


def test_shipped_drafters_are_small():
    size = sum(f.stat().st_size for f in DRAFTERS.rglob("*") if f.is_file())
    assert size < 15e6, size


@pytest.mark.parametrize("kind", KINDS)
def test_drafter_loads_and_is_exact(kind, target, plain):
    import jspec
    from jspec.drafters import load_drafter

    d = load_drafter(DRAFTERS / kind, target.config)
    assert d.kind == kind
    if "d2t" in d.params:
        d2t = np.asarray(d.params["d2t"])
        ids = np.arange(len(d2t)) + d2t
        assert ids.min() >= 0 and ids.max() < target.config.vocab_size
        assert len(np.unique(ids)) == len(ids)
    res = jspec.generate(target, PROMPTS, max_new_tokens=NEW, stop_ids=[], drafter=d)
    assert res.tokens == plain
    assert all(s["mean_accept_len"] >= 1.0 for s in res.stats)


def test_demo_runs_speculative():
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    out = subprocess.run([sys.executable, "-m", "jspec", "demo", "--max-new-tokens", "32"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "drafters/eagle3" in text and "def fibonacci(n):" in text
    assert "mean accept length:" in text
    assert "speedup over plain decoding:" in text
    assert "tokens identical to plain decoding: yes" in text
