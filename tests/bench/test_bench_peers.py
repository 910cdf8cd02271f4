"""``python -m jspec.bench peers`` (benchmarks/peers.py): the table's structure on the tiny
ChatML target with a fake peer, speculative tokens equal to plain, prompts spread over the
categories, and peers that are not installed skipped with a note. transformers runs on an HF
twin of the tiny target when it is importable; the whole command on SmolLM2 runs with
``-m slow`` (llama.cpp only where ``llama-cpp-python`` is installed)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import peers
from helpers.chat_targets import IM_END, chat_target
from jspec import messages
from jspec.bench import common

STOP = [IM_END]
CONVS = [("chat", [{"role": "user", "content": "hello there, hello there"}]),
         ("code", [{"role": "user", "content": "def f(x): return x + 1"}])]


@pytest.fixture(scope="module")
def target():
    return chat_target()


@pytest.fixture(scope="module")
def prompts(target):
    return [(i, c, messages.render(target, m)) for i, (c, m) in enumerate(CONVS)]


def fake_peer(second) -> list[peers.Mode]:
    """A peer whose plain output is fixed and whose lookup differs from it on ``second``."""
    def plain(ids):
        return peers.Out([5, 6, IM_END], 0.01, 3)

    def lookup(ids):
        return peers.Out([5, 7, IM_END] if ids == second else [5, 6, IM_END], 0.005, 2)
    return [peers.Mode("fake", "plain", plain, plain=True),
            peers.Mode("fake", "lookup K=4", lookup)]


@pytest.fixture(scope="module")
def run(target, prompts):
    modes = peers.jspec_modes(target, ["ngram=ngram"], 12, STOP) + fake_peer(prompts[1][2])
    lines = []
    records = peers.measure(modes, prompts, 1, log=lines.append)
    return modes, records, peers.summarize(modes, records), lines


def test_rows_and_columns(run, prompts):
    modes, records, rows, lines = run
    assert [(r["system"], r["mode"]) for r in rows] == [
        ("jspec", "plain"), ("jspec", "ngram 4,1,5"), ("fake", "plain"), ("fake", "lookup K=4")]
    assert len(records) == len(prompts) == len(lines)
    table = common.format_table(rows, peers.COLUMNS).splitlines()
    assert table[0].split() == " ".join(peers.COLUMNS).split()
    assert len(table) == 2 + len(rows)
    for r in rows:
        assert r["tok/s"] > 0 and r["tokens"] > 0
        assert r["tokens"] == sum(len(rec["modes"][f"{r['system']}/{r['mode']}"]["tokens"])
                                  for rec in records)


def test_jspec_speculative_equals_plain(run, prompts):
    modes, records, rows, _ = run
    n = len(prompts)
    by = {(r["system"], r["mode"]): r for r in rows}
    plain = by[("jspec", "plain")]
    assert plain["= own plain"] == plain["= jspec plain"] == f"yes {n}/{n}"
    assert plain["accept len"] == pytest.approx(1.0) and plain["x own plain"] == pytest.approx(1.0)
    r = by[("jspec", "ngram 4,1,5")]
    assert r["= own plain"] == f"yes {n}/{n}" and r["equal_own_plain"] == n
    assert 1.0 <= r["accept len"] <= 5.0
    for rec in records:       # every row stops at the stop id or the limit
        for v in rec["modes"].values():
            assert len(v["tokens"]) <= 12
            assert IM_END not in v["tokens"][:-1]


def test_peer_columns(run):
    _, _, rows, _ = run
    by = {(r["system"], r["mode"]): r for r in rows}
    fp, fl = by[("fake", "plain")], by[("fake", "lookup K=4")]
    assert fp["= own plain"] == "yes 2/2" and fl["= own plain"] == "no 1/2"
    assert fp["tok/s"] == pytest.approx(6 / 0.02) and fl["x own plain"] == pytest.approx(2.0)
    assert fp["accept len"] == pytest.approx(1.0) and fl["accept len"] == pytest.approx(1.5)
    assert fp["equal_jspec_plain"] in (0, 1, 2)


def test_pick_spreads_over_categories():
    rows = [("a", 0), ("a", 1), ("a", 2), ("b", 3), ("c", 4), ("c", 5)]
    got = peers.pick(rows, 5)
    assert [(c, m) for _, c, m in got] == [("a", 0), ("b", 3), ("c", 4), ("a", 1), ("c", 5)]
    assert [i for i, _, _ in peers.pick(rows, None, ["c"])] == [4, 5]


def test_load_prompts_and_categories(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["hi", [{"role": "user", "content": "yo"}]]))
    assert peers.load_prompts(f)[0] == ("-", [{"role": "user", "content": "hi"}])
    (tmp_path / "p_categories.json").write_text(json.dumps(["chat", "code"]))
    assert [c for c, _ in peers.load_prompts(f)] == ["chat", "code"]


def test_parse_drafter_arg():
    assert peers.parse_drafter_arg("eagle3=checkpoints/x/eagle3") == \
        ("eagle3", "checkpoints/x/eagle3", None)
    assert peers.parse_drafter_arg("ngram") == ("ngram", "ngram", None)
    assert peers.parse_drafter_arg("n=ngram:1:2@3,1,4") == ("n", "ngram:1:2", "3,1,4")
    assert peers.parse_drafter_arg("some/dir/dflash@auto") == ("dflash", "some/dir/dflash", "auto")


def test_drafter_trees(target):
    """A drafter's tree: its kind's default, or the one after ``@``."""
    modes = peers.jspec_modes(target, ["ngram", "short=ngram:1:2@2,1,3"], 8, STOP)
    assert [m.mode for m in modes] == ["plain", "ngram 4,1,5", "short 2,1,3"]
    assert [m.plain for m in modes] == [True, False, False]


def test_missing_peers_raise_peer_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(peers.PeerMissing, match="llama_cpp not importable"):
        peers.llamacpp_load("m.gguf", 1, 64, [4])
    with pytest.raises(peers.PeerMissing, match="transformers not importable"):
        peers.transformers_load("m.gguf", 1)


@pytest.mark.slow             # importing torch and transformers alone takes 5-15 s here
@pytest.mark.skipif(not common.hf_available(), reason="transformers/torch not installed")
def test_transformers_on_a_twin(target, prompts):
    """transformers' modes on an HF copy of the tiny target: the passes are counted, plain's
    accept length is 1, and every column is filled."""
    model = common.hf_model_from_params(target.config, target.params)
    modes = peers.jspec_modes(target, [], 12, STOP) + peers.transformers_modes(model, 12, STOP, [3])
    records = peers.measure(modes, prompts[:1], 1, log=lambda s: None)
    rows = {r["mode"] if r["system"] == "transformers" else "jspec": r
            for r in peers.summarize(modes, records)}
    assert rows["plain"]["accept len"] == pytest.approx(1.0)
    assert rows["plain"]["= own plain"] == "yes 1/1"
    assert 1.0 <= rows["lookup K=3"]["accept len"] <= 4.0
    assert rows["plain"]["= jspec plain"] in ("yes 1/1", "no 0/1")


@pytest.mark.slow
def test_smollm2_all_peers(tmp_path):
    """The whole command on SmolLM2 (skipped when it is not cached): every installed system,
    one prompt, 8 tokens; jspec's n-gram tokens equal its plain ones."""
    from jspec import fetch
    from jspec.bench.__main__ import main as bench_main
    if not fetch.is_cached("smollm2"):
        pytest.skip("SmolLM2 is not cached (python -m jspec models fetch smollm2)")
    out = tmp_path / "peers.json"
    data = bench_main(["peers", "--limit", "1", "--max-new-tokens", "8", "--repeats", "1",
                       "--json", str(out)])
    assert json.loads(out.read_text())["columns"] == peers.COLUMNS
    rows = {(r["system"], r["mode"]): r for r in data["rows"]}
    assert rows[("jspec", "ngram 4,1,5")]["= own plain"] == "yes 1/1"
    systems = {s for s, _ in rows} | {n.split()[0] for n in data["notes"] if " skipped: " in n}
    assert systems == set(peers.PEERS)
