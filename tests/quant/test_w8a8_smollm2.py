"""SmolLM2 W8A8 is exact in the serving engine: with the committed EAGLE-3 head, chain and
its default EAGLE-2 tree, the engine's greedy output equals plain ``generate`` of the same
W8A8 target on held-out chat prompts, with the same logprobs, and its echo scoring of
prompt + output gives them too (``tests/helpers/w8a8_smollm2_engine.py``, in a subprocess
under jspec's CPU layout and XLA's default options). Before the engine compiled with the
target's options, read at least 128 keys through the bucket switch, and compacted each
query's keys, chains kept their tokens but trees parted at tokens 8 to 57 of 64, and echo
scoring was 0.46 to 1.4 away."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import xla_env

pytestmark = pytest.mark.slow


def test_w8a8_smollm2_engine_equals_plain_generate(tmp_path):
    from jspec.fetch import FetchError, fetch
    try:
        model = fetch("smollm2")
    except FetchError as e:
        pytest.skip(f"SmolLM2 not cached and cannot be fetched: {e}")
    out = tmp_path / "engine.json"
    script = Path(__file__).parents[1] / "helpers" / "w8a8_smollm2_engine.py"
    env = dict(xla_env.full_optimisation(), JSPEC_STACKED_LAYERS="0")
    p = subprocess.run([sys.executable, str(script), str(model), str(out), "4", "48"],
                       env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc) == {"chain", "tree"}
    for spec, r in doc.items():
        assert r["partings"] == [None] * 4, (spec, r)
        assert r["logprob_diff"] < 1e-4 and r["score_diff"] < 1e-4, (spec, r)
