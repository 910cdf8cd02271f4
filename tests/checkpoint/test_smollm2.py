"""SmolLM2-135M-Instruct, the real model a user starts with, loaded from its GGUF: jspec's greedy
output equals transformers' on the same file (``tests/data/smollm2_golden.json``, made by
``tests/data/make_smollm2_golden.py``) for chat-formatted and plain prompts, 96 tokens each,
through ``generate``, the engine and the dataset runner, plain and with a random EAGLE-3 head.

The model comes from ``python -m jspec models fetch smollm2`` (``.ci/run`` fetches it first;
cached). Without it, and without network to fetch it, the module skips.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import jspec
from jspec.drafters import random_drafter
from jspec.spec_config import SpecConfig

GOLDEN = json.loads((Path(__file__).parents[1] / "data" / "smollm2_golden.json").read_text())
ROWS = GOLDEN["rows"]
N = GOLDEN["new_tokens"]
# A short chain: a random head is (almost) never right, so every iteration verifies 3 nodes
# and keeps 1 token; exactness is what is tested here, not speed.
CHAIN = SpecConfig(2, 1, 3)


@pytest.fixture(scope="module")
def smollm2():
    from jspec.fetch import FetchError, fetch
    try:
        path = fetch("smollm2")
    except FetchError as e:
        pytest.skip(f"SmolLM2 not cached and cannot be fetched: {e}")
    return jspec.load_target(path)


@pytest.fixture(scope="module")
def eagle3(smollm2):
    import jax
    return random_drafter("eagle3", smollm2.config, jax.random.key(3))


def prompts():
    return [r["prompt_ids"] for r in ROWS]


def wanted():
    return [r["tokens"] for r in ROWS]


def test_config_and_prompt_ids(smollm2):
    """The config the metadata gives, and prompt ids equal to transformers' (chat rows
    through the GGUF's own template)."""
    cfg = smollm2.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    tok = smollm2.tokenizer
    for r in ROWS:
        if "text" in r:
            assert tok.encode(r["text"], bos=False) == r["prompt_ids"]
        else:
            assert tok.apply_chat_template(r["messages"], add_generation_prompt=True) \
                == r["prompt_ids"]
    assert tok.end_of_turn_ids == (2,)


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "eagle3"])
def test_generate_equals_transformers(smollm2, eagle3, drafted):
    kw = {"drafter": eagle3, "spec": CHAIN} if drafted else {}
    out = jspec.generate(smollm2, prompts(), max_new_tokens=N, stop_ids=[], **kw)
    for r, toks in zip(ROWS, out.tokens):
        assert list(toks) == r["tokens"], (r.get("text") or r["messages"][-1]["content"],
                                           f"min top-2 gap {r['min_top2_gap']:.4f}")


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "eagle3"])
def test_engine_equals_transformers(smollm2, eagle3, drafted):
    from jspec.engine import Engine, Request
    kw = {"drafter": eagle3, "spec": CHAIN} if drafted else {}
    eng = Engine(smollm2, slots=2, max_new_tokens=N, **kw)
    reqs = [Request(r["prompt_ids"], N, stop_ids=[], id=i) for i, r in enumerate(ROWS)]
    assert [c.tokens for c in eng.generate(reqs)] == wanted()


def test_runner_equals_transformers(smollm2, tmp_path):
    """``python -m jspec run`` (in process) with ``messages`` records and text prompts, a random
    EAGLE-3 head: each record's tokens equal transformers'."""
    from jspec.engine import runner
    lines = []
    for i, r in enumerate(ROWS):
        rec = {"id": i, "max_new_tokens": N, "stop": []}
        rec.update({"messages": r["messages"]} if "messages" in r else {"prompt": r["text"]})
        lines.append(json.dumps(rec))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    p = argparse.ArgumentParser()
    runner.add_args(p)
    args = p.parse_args(["--model", "smollm2", "--drafter", "random:eagle3",
                         "--spec", "2,1,3", "--input", str(tmp_path / "in.jsonl"),
                         "--output", str(tmp_path / "out.jsonl"), "--slots", "2",
                         "--no-progress"])
    assert runner.run(args, target=smollm2) == 0
    out = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert [out[i]["token_ids"] for i in range(len(ROWS))] == wanted()


def test_transformers_live(smollm2):
    """The golden's first chat row recomputed by transformers now (the ``hf`` extra)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import sys
    sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
    import make_smollm2_golden as mk
    import torch
    import transformers
    from jspec.fetch import fetch
    path = fetch("smollm2")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        toks, _ = mk.greedy(model, ROWS[0]["prompt_ids"])
    assert toks == ROWS[0]["tokens"]
