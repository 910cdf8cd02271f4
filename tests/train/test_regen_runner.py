"""`python -m jspec.train regen` through the dataset runner: a sample depends only on its
seed (not the slot count), greedy samples equal plain `generate`, and a rerun resumes."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jspec
from jspec.train import regen

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "checkpoints" / "default"
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:"]


def _regen(out, slots, temperature):
    cmd = [sys.executable, "-m", "jspec.train", "regen", "--target", str(MODEL), "--out",
           str(out), "--prompts", str(out.parent / "p.json"), "--num-samples", "5",
           "--max-new-tokens", "12", "--temperature", str(temperature), "--seed", "3", "--",
           "--slots", str(slots), "--no-progress"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return regen.load_sequences(out, with_prompt_lens=True)


@pytest.mark.slow        # four runner invocations: ~40 s
def test_regen_through_the_runner(tmp_path):
    import json
    (tmp_path / "p.json").write_text(json.dumps({"train": PROMPTS}))
    a, pa = _regen(tmp_path / "a.npz", 2, 0.8)
    b, pb = _regen(tmp_path / "b.npz", 4, 0.8)
    assert len(a) == 5 and pa == pb
    assert all(np.array_equal(x, y) for x, y in zip(a, b))          # slots do not matter
    target = jspec.load_target(MODEL)
    assert list(a[3][:pa[3]]) == target.tokenizer.encode(PROMPTS[0])  # sample 3: prompt 0
    g, pg = _regen(tmp_path / "g.npz", 2, 0.0)
    plain = jspec.generate(target, [target.tokenizer.encode(p) for p in PROMPTS],
                           max_new_tokens=12)
    for i in range(5):
        assert list(g[i][pg[i]:]) == plain.tokens[i % 3]
    before = (tmp_path / "g.npz.results.jsonl").read_text()
    g2, _ = _regen(tmp_path / "g.npz", 2, 0.0)                       # a rerun: nothing redone
    assert (tmp_path / "g.npz.results.jsonl").read_text() == before
    assert all(np.array_equal(x, y) for x, y in zip(g, g2))


def test_regen_renders_conversations(tmp_path):
    """A conversation prompt is rendered through the target's chat template (the assistant's
    header appended) and its reply stops at the template's end of turn; greedy samples equal
    ``jspec.chat``'s replies."""
    from helpers.chat_targets import chat_target
    from jspec import messages
    from jspec.checkpoint import save_orbax
    target = chat_target()
    save_orbax(target, tmp_path / "t")
    convs = [[{"role": "user", "content": "hi there"}],
             [{"role": "system", "content": "be brief."}, {"role": "user", "content": "why?"}]]
    seqs, plens = regen.regenerate_with_runner(
        tmp_path / "t", convs, 3, tmp_path / "s.npz", max_new_tokens=10, temperature=0.0,
        runner_args=["--slots", "2", "--no-progress"])
    want = jspec.chat(target, convs, max_new_tokens=10)
    for i in range(3):
        assert list(seqs[i][:plens[i]]) == messages.render(target, convs[i % 2])
        assert list(seqs[i][plens[i]:]) == list(want.result.tokens[i % 2])
