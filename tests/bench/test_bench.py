"""Smoke tests of the benchmarks on a tiny random config (no assertions on times)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import forward
from jspec.bench import common, configs, plain
from jspec.bench.__main__ import main as bench_main
from jspec.target import Target


@pytest.fixture(scope="module")
def tiny():
    cfg = configs.random_config("tiny")
    return Target(cfg, common.random_params(cfg, seed=0))


def _check_table(text: str, columns):
    header = text.splitlines()[0]
    for c in columns:
        assert c in header, (c, header)
    assert len(text.splitlines()) >= 3


def test_random_params_match_model_tree(tiny):
    shapes = common.param_shapes(tiny.config)
    got = [np.shape(x) for x in __import__("jax").tree.leaves(tiny.params)]
    want = [s.shape for s in __import__("jax").tree.leaves(shapes)]
    assert got == want
    assert "lm_head" in tiny.params  # the tiny config is untied
    assert common.param_count(tiny.params) == sum(int(np.prod(s)) for s in want)


def test_format_table_columns():
    rows = [{"a": 1, "b": 2.5, "c": True}, {"a": 10, "c": False}]
    text = common.format_table(rows, ["a", "b", "c"])
    lines = text.splitlines()
    assert lines[0].split() == ["a", "b", "c"]
    assert lines[2].split() == ["1", "2.500", "yes"] and lines[3].split() == ["10", "-", "NO"]


# The plain tests share one static shape (batch 2, 12 new tokens, prompt bucket 16), so
# jspec compiles once for the whole module.
def test_plain_matches_hf(tiny):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    rows = plain.run_plain(tiny, batches=(2,), new_tokens=12, prompt_len=5, repeats=1,
                           hf=True, log=None)
    for r in rows:
        assert r["same tokens"] is True, r
        assert r["HF tokens/s"] > 0 and r["jspec/HF"] > 0


def test_plain_cli_without_hf(tmp_path, capsys):
    out = tmp_path / "plain.json"
    bench_main(["plain", "--random-config", "tiny", "--batch", "2", "--new-tokens", "12",
                "--prompt-len", "5", "--repeats", "1", "--no-hf", "--json", str(out)])
    text = capsys.readouterr().out
    _check_table(text[text.index("batch  prompt len"):], plain.COLUMNS)
    data = json.loads(out.read_text())
    assert data["columns"] == plain.COLUMNS
    (r,) = data["rows"]
    assert r["batch"] == 2 and r["new tokens"] == 12 and r["prompt len"] == 5
    assert r["tokens/s"] > 0 and r["ms/token"] > 0 and r["compile s"] >= 0
    assert "same tokens" not in r


def test_forward_cli(tmp_path, capsys):
    out = tmp_path / "forward.json"
    bench_main(["forward", "--random-config", "tiny", "--context", "40", "--block", "4",
                "--repeats", "2", "--page-size", "8", "--json", str(out)])
    text = capsys.readouterr().out
    assert "parameters" in text
    _check_table(text[text.index("forward  batch"):], forward.COLUMNS)
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 4]
    assert all(r["context"] == 40 and r["ms"] > 0 for r in rows)
    assert rows[0]["x decode"] == 1.0 and rows[1]["x decode"] > 0
