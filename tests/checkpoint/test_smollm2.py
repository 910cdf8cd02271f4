"""SmolLM2-135M-Instruct, the real model a user starts with, loaded from its GGUF: jspec's greedy
output equals transformers' on the same file (``tests/data/smollm2_golden.json``, made by
``tests/data/make_smollm2_golden.py``) for chat-formatted and plain prompts, 96 tokens each,
through ``generate``, the engine and the dataset runner, plain and with a random EAGLE-3 head
(in one subprocess: ``tests/helpers/smollm2_paths.py``).

The model comes from ``python -m jspec models fetch smollm2`` (``.ci/run`` fetches it first;
cached). Without it, and without network to fetch it, the module skips.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import jspec
from helpers import xla_env

GOLDEN_FILE = Path(__file__).parents[1] / "data" / "smollm2_golden.json"
GOLDEN = json.loads(GOLDEN_FILE.read_text())
ROWS = GOLDEN["rows"]
N = GOLDEN["new_tokens"]


def fetch_path() -> Path:
    from jspec.fetch import FetchError, fetch
    try:
        return fetch("smollm2")
    except FetchError as e:
        pytest.skip(f"SmolLM2 not cached and cannot be fetched: {e}")


@pytest.fixture(scope="module")
def smollm2():
    return jspec.load_target(fetch_path())


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


def _paths(which: str, tmp_path_factory):
    """The paths' tokens (``which``: ``generate`` or ``served``), from one subprocess compiled
    with XLA's full optimisation (``tests/helpers/smollm2_paths.py`` says why)."""
    out = tmp_path_factory.mktemp("smollm2") / "paths.json"
    env = xla_env.full_optimisation()
    script = Path(__file__).parents[1] / "helpers" / "smollm2_paths.py"
    p = subprocess.run([sys.executable, str(script), str(fetch_path()), str(GOLDEN_FILE),
                        str(out), which], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def generate_paths(smollm2, tmp_path_factory):
    return _paths("generate", tmp_path_factory)


@pytest.fixture(scope="module")
def served_paths(smollm2, tmp_path_factory):
    return _paths("served", tmp_path_factory)


# The engine and the runner on SmolLM2 run with -m slow (CI time): the small models check
# both in the default run, and these paths differ from generate's only in serving.
@pytest.mark.parametrize("path", ["generate-plain", "generate-eagle3",
                                  pytest.param("engine-eagle3", marks=pytest.mark.slow),
                                  pytest.param("runner-eagle3", marks=pytest.mark.slow)])
def test_equals_transformers(request, path):
    from helpers.smollm2_paths import SERVED_TOKENS
    paths = request.getfixturevalue("generate_paths" if path.startswith("generate")
                                    else "served_paths")
    n = len(ROWS[0]["tokens"]) if path.startswith("generate") else SERVED_TOKENS
    for r, toks in zip(ROWS, paths[path]):
        assert toks == r["tokens"][:n], (path, r.get("text") or r["messages"][-1]["content"],
                                     f"min top-2 gap {r['min_top2_gap']:.4f}")


def test_the_trained_head_accepts_more_than_a_random_one(generate_paths):
    """``generate-eagle3`` drafts with the EAGLE-3 head in training, so the golden comparison
    above covers passes that keep drafted tokens (a random head's accept length is ~1.0;
    this head's was 1.20 on the golden's prompts, chain (2, 1, 3))."""
    assert generate_paths["generate-eagle3-accept"] > 1.1


@pytest.mark.slow      # the golden file pins transformers' tokens; this recomputes one row (a minute)
def test_transformers_live(smollm2):
    """The golden's first chat row recomputed by transformers now (the ``hf`` extra)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import sys
    sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
    import make_smollm2_golden as mk
    import torch
    import transformers
    path = fetch_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        toks, _ = mk.greedy(model, ROWS[0]["prompt_ids"])
    assert toks == ROWS[0]["tokens"]
