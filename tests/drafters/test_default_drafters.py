"""The drafters shipped with the default target (``checkpoints/default/drafters``).

Each loads with :func:`jspec.drafters.load_drafter`, and greedy speculative generation with
it gives exactly the target's plain greedy tokens; ``python -m jspec demo`` picks a drafter
and tree by timing candidates, stores the pick, and reports accept length and speedup.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jspec.spec_config import SpecConfig

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "checkpoints" / "default"
TARGET = SHIPPED / "target"
DRAFTERS = SHIPPED / "drafters"
KINDS = ("eagle3", "eagle1", "medusa", "mtp", "dflash")
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


def _demo(cache, *args):
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           "JSPEC_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-m", "jspec", "demo", "--max-new-tokens", "16",
                          "--repeats", "1", "--drafter", "eagle3", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, out.stderr


@pytest.mark.slow       # about 85 s: -m slow, for CI time (tests/cli/test_demo_chat.py runs the demo)
def test_demo_calibrates_once_and_runs_speculative(tmp_path):
    # --extra-drafter: a head of the user's (here the shipped one again) timed beside it
    extra = ("--extra-drafter", f"mine={ROOT / 'checkpoints/default/drafters/eagle3'}")
    text, err = _demo(tmp_path, *extra)
    # Round 1 (a 4-step chain) and round 2 (its neighbours, the default tree) were timed.
    assert "mine chain(4)" in text
    assert "eagle3 chain(4)" in text and "chain(3)" in text
    assert "tree(5,4,8)" in text                      # round 2 around the faster of the two
    assert "compiling ..." in err                     # the progress lines
    assert ("picked: eagle3" in text or "picked: mine" in text) and "import os" in text
    for line in ("mean accept length:", "plain decoding:", "speculative decoding:", "speedup:"):
        assert line in text
    assert "tokens identical to plain decoding: yes" in text
    rec, = (tmp_path / "calibration").glob("demo-*-n16-auto.json")
    stored = json.loads(rec.read_text())
    assert stored["pick"] == stored["candidates"][0]["candidate"]
    assert stored["candidates"][0]["tokens_per_s"] == max(
        r["tokens_per_s"] for r in stored["candidates"])
    # The second run reads the stored pick instead of calibrating again.
    text2, err2 = _demo(tmp_path, *extra)
    assert "measured earlier on this machine" in text2
    assert f"picked: {text.split('picked: ')[1].splitlines()[0]}" in text2
    assert "tokens identical to plain decoding: yes" in text2


def test_extra_drafter_flags_are_checked_before_loading(tmp_path):
    from jspec import demo
    head = ROOT / "checkpoints/default/drafters/eagle3"
    assert demo.parse_extra([f"a={head}"]) == {"a": head}
    for bad, err in ((["a"], ValueError), ([f"a={head}", f"a={head}"], ValueError),
                     ([f"a={tmp_path}"], FileNotFoundError)):
        with pytest.raises(err):
            demo.parse_extra(bad)


def test_second_round_follows_the_accept_histogram():
    from jspec import demo

    class FakeDrafter:
        default_spec = SpecConfig(5, 4, 8)
    row = {"candidate": {"kind": "eagle1", "spec": (4, 1, 5)}}
    often_full = demo.second_round({**row, "accept_hist": [0, 1, 1, 1, 1, 6]}, {"eagle1": FakeDrafter})
    assert [c.spec for c in often_full] == [(3, 1, 4), (5, 1, 6), (5, 4, 8)]
    rarely_full = demo.second_round({**row, "accept_hist": [0, 6, 1, 1, 1, 1]}, {"eagle1": FakeDrafter})
    assert [c.spec for c in rarely_full] == [(3, 1, 4), (5, 4, 8)]

    def own_default(S, N):             # a drafter whose default is its own shape (spec None)
        class Module:
            tree_shape = staticmethod(lambda spec: (S, N))

        class Like:
            default_spec, module = None, Module
        return Like
    m = demo.second_round({"candidate": {"kind": "medusa", "spec": (4, 1, 5)},
                           "accept_hist": [0, 9, 1, 0, 0, 0]}, {"medusa": own_default(4, 64)})
    assert [(c.spec, c.label) for c in m] == [((3, 1, 4), "medusa chain(3)"),
                                              (None, "medusa default tree")]
    # DFlash's own default is its whole block as a chain: labelled and run as one.
    d = demo.second_round({"candidate": {"kind": "dflash", "spec": (4, 1, 5)},
                           "accept_hist": [0, 9, 1, 0, 0, 0]}, {"dflash": own_default(15, 16)})
    assert [(c.spec, c.label) for c in d] == [((3, 1, 4), "dflash chain(3)"),
                                              ((15, 1, 16), "dflash chain(15)")]
