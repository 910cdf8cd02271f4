"""Smoke test of ``python -m jspec.bench spec`` (parts A and B) on the tiny random config.

No assertions on times: only the table columns, exactness of every non-forced row, and that
forcing the accept length works.
"""

from __future__ import annotations

import json

import pytest

from jspec.bench import spec, spec_simulate
from jspec.bench.__main__ import main as bench_main


def _table(text: str, first_column: str) -> list[str]:
    """The lines of the table whose header starts with ``first_column``."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.split()[:1] == [first_column])
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_spec") / "spec.json"
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        bench_main(["spec", "--random-config", "tiny", "--batch", "1", "--new-tokens", "24",
                    "--prompt-len", "5", "--repeats", "1", "--simulate", "3",
                    "--kinds", "eagle1", "mtp",
                    "--json", str(out)])
    return buf.getvalue(), json.loads(out.read_text())


# Parts A and B compile ~10 programs; they run with -m slow (the exactness they report is
# tested directly in tests/decode/test_spec_generate.py).
@pytest.mark.slow
def test_part_a_table(run):
    text, data = run
    assert "load avg" in text
    table = _table(text, "drafter")
    header = table[0]
    for c in spec.COLUMNS:
        assert c in header, (c, header)
    assert data["columns"] == spec.COLUMNS
    rows = data["rows"]
    assert rows[0]["drafter"] == "plain"
    got = {(r["drafter"], r["mode"]) for r in rows[1:]}
    want = {(k, m) for k in ("eagle1", "mtp", "oracle") for m in ("chain", "tree")}
    assert got == want
    assert len(table) == 2 + len(rows)
    shapes = {(r["drafter"], r["mode"]): r["S,K,N"] for r in rows}
    assert shapes[("eagle1", "chain")] == "5,1,6" and shapes[("eagle1", "tree")] == "5,4,8"
    assert shapes[("mtp", "chain")] == "3,1,4" and shapes[("mtp", "tree")] == "3,2,6"
    assert shapes[("oracle", "chain")] == "4,1,5"
    for r in rows:
        assert r["same tokens"] is True, r          # every Part A row is exact (none forced)
        assert r["tokens/s"] > 0 and r["speedup"] > 0 and r["compile s"] >= 0
        assert r["accept len"] >= 1.0
    for line in table[2:]:
        assert line.split()[-1] == "yes", line
    # The oracle proposes the plain greedy continuation: nearly every verify accepts S + 1.
    acc = {(r["drafter"], r["mode"]): r["accept len"] for r in rows}
    assert acc[("oracle", "chain")] > 4.0 and acc[("oracle", "tree")] > 4.5


@pytest.mark.slow
def test_part_b_forced(run):
    text, data = run
    for name in ("t_1 =", "t_V =", "c = ", "ideal = E / (t_V/t_1 + S*c)"):
        assert name in text
    table = _table(text, "E")
    for c in spec_simulate.SIM_COLUMNS:
        assert c in table[0], (c, table[0])
    sim = data["simulate"]
    assert sim["columns"] == spec_simulate.SIM_COLUMNS
    costs = sim["costs"]
    assert costs["t_1 ms"] > 0 and costs["drafter"] == "eagle3"
    assert set(costs["specs"]) == {"5,4,8", "4,1,5"}
    for c in costs["specs"].values():
        assert c["t_V ms"] > 0 and c["c"] > 0
    assert [(r["S,K,N"], r["E"]) for r in sim["rows"]] == [("5,4,8", 3), ("4,1,5", 3)]
    for r in sim["rows"]:
        c = costs["specs"][r["S,K,N"]]
        S = int(r["S,K,N"].split(",")[0])
        assert abs(r["accept len"] - r["E"]) <= 0.35, r
        ideal = spec_simulate.ideal_speedup(r["E"], c["t_V/t_1"], c["c"], S)
        assert r["ideal"] == pytest.approx(ideal)
        assert r["speedup"] > 0 and r["tokens/s"] > 0
        assert "same tokens" not in r                # forced output is not the target's


def test_variants_and_ideal():
    from jspec.bench import configs
    cfg = configs.random_config("tiny")
    d = spec.make_random_drafter("medusa", cfg)
    (m1, s1), (m2, s2) = spec.variants(d)
    assert (m1, s1.num_steps, s1.topk) == ("chain", 4, 1) and (m2, s2) == ("tree", None)
    assert spec_simulate.ideal_speedup(3.0, 1.5, 0.1) == pytest.approx(3.0 / 2.0)


def test_text_prompts_run_one_at_a_time_with_checkpoint_drafters():
    """``--prompts``: real prompts at batch 1, in turn, with a trained drafter (the shipped
    default's MTP); greedy tokens must equal plain decoding's."""
    from pathlib import Path

    import jspec
    root = Path(__file__).resolve().parents[2] / "checkpoints" / "default"
    if not (root / "drafters" / "mtp").is_dir():
        pytest.skip("checkpoints/default/drafters not shipped")
    target = jspec.load_target(root)
    prompts = ["import os\n", "class Scanner:"]
    rows = spec.run_spec(target, new_tokens=8, repeats=1, kinds=(), text_prompts=prompts,
                         drafter_paths=[str(root / "drafters" / "mtp")], log=None)
    assert [r["drafter"] for r in rows] == ["plain", "mtp", "mtp"]
    assert all(r["same tokens"] for r in rows)
    assert all(r["accept len"] >= 1.0 for r in rows[1:])
    # Both prompts made their 8 tokens: the rate counts 16 tokens per call.
    assert rows[0]["tokens/s"] == pytest.approx(16 / rows[0]["median s"])
