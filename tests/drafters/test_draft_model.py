"""The independent draft model (jspec.drafters.draft_model): any Llama checkpoint sharing the
target's tokenizer drafts from its own tokens and KV cache. Greedy output must equal plain
decoding (chain and tree, batch 1 and ragged 4); with the target itself as the draft model
every draft must be accepted, which pins its positions and its first token. Sampling is in
test_spec_sampling.py."""

import jax
import numpy as np
import pytest

import jspec
from jspec.checkpoint import save_orbax
from jspec.args import load_drafter_arg
from jspec.config import LlamaConfig
from jspec.drafters import Drafter, DrafterMismatchError, load_drafter, make_drafter
from jspec.drafters.draft_model import from_target
from jspec.llama import init_params
from jspec.spec_config import SpecConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16)
PROMPTS = [[1, 5, 7, 9, 3, 4, 5, 6, 7], [1, 2], [1, 9, 8, 7, 6, 5, 4, 3, 2, 1, 2, 3, 4, 5, 6, 7, 8],
           [1, 33, 2]]
LIMITS = [24, 9, 17, 1]
SPECS = [SpecConfig.chain(4), SpecConfig(4, 3, 8)]


@pytest.fixture(scope="module")
def target():
    return jspec.Target(CFG, init_params(CFG, jax.random.key(0)))


@pytest.fixture(scope="module")
def plain(target):
    return jspec.generate(target, PROMPTS, max_new_tokens=LIMITS, stop_ids=[])


def mean_accept(res):
    return sum(s["new_tokens"] for s in res.stats) / sum(s["iterations"] for s in res.stats)


def test_the_target_as_its_own_draft_model_accepts_every_draft(target, plain):
    """A chain of its greedy tokens (a tree ranks paths by probability, so may leave the
    greedy path's deep nodes out)."""
    d = Drafter(*from_target(target, CFG))
    res = jspec.generate(target, PROMPTS[:1], max_new_tokens=21, stop_ids=[], drafter=d,
                         spec=SPECS[0])
    assert res.tokens[0] == plain.tokens[0][:21]
    # 21 tokens: 1 from the prefill, then 4 iterations of S + 1 = 5.
    assert res.stats[0]["iterations"] == 4, res.stats


@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 4],
                         ids=["batch1", "ragged4"])
@pytest.mark.parametrize("spec", SPECS, ids=["chain", "tree"])
def test_greedy_identical_to_plain(target, plain, spec, batch):
    d = make_drafter("model", CFG, jax.random.key(3), num_layers=1)
    res = jspec.generate(target, PROMPTS[:batch], max_new_tokens=LIMITS[:batch], stop_ids=[],
                         drafter=d, spec=spec)
    assert res.tokens == plain.tokens[:batch]


@pytest.mark.slow
def test_a_cut_down_target_drafts_well(target, plain):
    """Two of the target's three layers, as a draft model: drafts accepted, output exact (a
    random target's layers agree only loosely: about 1.2 tokens per verify)."""
    cut = jspec.Target(CFG.replace(num_layers=2),
                       {k: v for k, v in target.params.items() if k != "layers_2"})
    res = jspec.generate(target, PROMPTS, max_new_tokens=LIMITS, stop_ids=[],
                         drafter=Drafter(*from_target(cut, CFG)), spec=SPECS[1])
    assert res.tokens == plain.tokens
    assert mean_accept(res) > 1.1


def test_loads_any_target_checkpoint_by_path_and_from_the_cli(tmp_path, target, plain):
    small = LlamaConfig(**{**CFG.__dict__, "num_layers": 1})
    draft = jspec.Target(small, init_params(small, jax.random.key(5)))
    save_orbax(draft, tmp_path / "draft")
    d1 = load_drafter(tmp_path / "draft", CFG)            # a target checkpoint: a draft model
    d2 = load_drafter_arg(f"model:{tmp_path / 'draft'}", target)
    assert d1.kind == d2.kind == "model" and d1.module.layer.num_layers == 1
    np.testing.assert_array_equal(d1.params["net"]["layers_0"]["mlp"]["down_proj"]["kernel"],
                                  draft.params["layers_0"]["mlp"]["down_proj"]["kernel"])
    res = jspec.generate(target, PROMPTS[:2], max_new_tokens=LIMITS[:2], stop_ids=[], drafter=d2,
                         spec=SPECS[0])
    assert res.tokens == plain.tokens[:2]


def test_refuses_a_different_vocabulary_before_compiling(tmp_path):
    other = CFG.replace(vocab_size=CFG.vocab_size + 8)
    save_orbax(jspec.Target(other, init_params(other, jax.random.key(1))), tmp_path / "draft")
    with pytest.raises(DrafterMismatchError, match="vocabulary of 104 tokens.*share the target"):
        load_drafter(tmp_path / "draft", CFG, kind="model")
