"""End-to-end lossless sampling: on a small random target (vocabulary 16), speculative
sampling's distribution over the first 3 generated tokens matches the target's exact
distribution (enumerated), for a tree and a chain, like plain sampling does."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jspec
from jspec import kv_cache as kvc
from jspec.drafters import random_drafter
from jspec.llama import Llama, init_params
from jspec.sampling import SamplingConfig, target_probs
from jspec.spec_config import SpecConfig

V = 16
ROWS = 20_000
PROMPT = [1, 5, 9]
SAMPLING = dict(temperature=0.9, top_k=12)


@pytest.fixture(scope="module")
def target():
    cfg = jspec.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.key(7))
    # Sharpen the tied embedding so next-token distributions are far from uniform.
    params["embed_tokens"]["embedding"] = params["embed_tokens"]["embedding"] * 6
    return jspec.Target(cfg, params)


@pytest.fixture(scope="module")
def exact(target):
    """P(x1, x2, x3 | prompt) under the sampling filters, by enumerating all 256 (x1, x2)."""
    pairs = np.array(list(itertools.product(range(V), repeat=2)), np.int32)
    seqs = np.concatenate([np.tile(PROMPT, (len(pairs), 1)), pairs], 1)
    B, T = seqs.shape
    pt = kvc.allocate_page_table([T] * B, 8, B)
    cache = kvc.init_cache(2, 2, 8, pt, B, 8)
    model = Llama(target.config)
    h, _, _ = model.apply({"params": target.params}, jnp.asarray(seqs),
                          jnp.broadcast_to(jnp.arange(T), (B, T)), cache)
    probs = np.asarray(target_probs(model.apply({"params": target.params}, h, method=Llama.logits),
                                    SamplingConfig(**SAMPLING)), np.float64)
    p1 = probs[0, len(PROMPT) - 1]
    p2 = probs[::V, len(PROMPT)]                      # rows with x2 = 0 -> p(x2 | x1)
    p3 = probs[:, len(PROMPT) + 1].reshape(V, V, V)   # p(x3 | x1, x2)
    return p1[:, None, None] * p2[:, :, None] * p3


def pvalue(tokens, exact):
    counts = np.zeros(V ** 3)
    np.add.at(counts, np.ravel_multi_index(np.asarray(tokens).T, (V, V, V)), 1)
    e = exact.ravel() * len(tokens)
    assert counts[e == 0].sum() == 0, "sampled a sequence the target cannot produce"
    big = e >= 5
    obs = np.append(counts[big], counts[~big & (e > 0)].sum())
    exp = np.append(e[big], e[~big & (e > 0)].sum())
    return stats.chisquare(obs, exp / exp.sum() * obs.sum()).pvalue, int(big.sum())


def sample(target, drafter=None, spec=None, seed=0):
    res = jspec.generate(target, [PROMPT] * ROWS, max_new_tokens=3, stop_ids=[], seed=seed,
                         drafter=drafter, spec=spec, page_size=8, **SAMPLING)
    return np.array(res.tokens), res


# About 45 s apiece here, so the default run keeps one: EAGLE-1's tree below (the tree rule
# every kind's speculation goes through). Plain sampling, the other kinds and the chain run
# with -m slow, to keep the default run inside CI's 15 minutes.
@pytest.mark.slow
def test_plain_sampling_matches_enumeration(target, exact):
    toks, _ = sample(target)
    p, cells = pvalue(toks, exact)
    assert cells > 50 and p > 1e-3, (p, cells)


# About a minute apiece here: the tree runs by default, the calibrated tree and the chain (a
# tree of one branch) with -m slow, to keep the default run inside CI's time.
@pytest.mark.parametrize("spec", [SpecConfig(3, 4, 8),
                                  pytest.param(SpecConfig(3, 4, 8, "calibrated"),
                                               marks=pytest.mark.slow),
                                  pytest.param(SpecConfig.chain(3), marks=pytest.mark.slow)],
                         ids=["tree", "tree-calibrated", "chain"])
def test_speculative_sampling_matches_enumeration(target, exact, spec, rank_model):
    from jspec.drafters.calibration import attach
    drafter = random_drafter("eagle1", target.config, jax.random.key(2))
    if spec.selection == "calibrated":
        drafter = attach(drafter, rank_model(target.config.vocab_size))
    toks, res = sample(target, drafter, spec, seed=1)
    p, cells = pvalue(toks, exact)
    assert p > 1e-3, (p, cells)
    # Drafts must really be accepted (thousands of times), or this only tests plain sampling.
    hist = np.sum([s["accept_hist"] for s in res.stats], 0)
    assert hist[2:].sum() > 1000, hist


@pytest.mark.slow
def test_ngram_sampling_matches_enumeration(target, exact):
    """Prompt lookup drafts deterministic tokens from the row's own history: the tree rule
    keeps the output distributed exactly as the target's."""
    from jspec.drafters import ngram_drafter
    toks, res = sample(target, ngram_drafter(target.config), SpecConfig(3, 2, 6), seed=2)
    p, cells = pvalue(toks, exact)
    assert p > 1e-3, (p, cells)
    hist = np.sum([s["accept_hist"] for s in res.stats], 0)
    assert hist[2:].sum() > 1000, hist


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SpecConfig(3, 2, 6), SpecConfig.chain(3)],
                         ids=["tree", "chain"])
def test_draft_model_sampling_matches_enumeration(target, exact, spec):
    """An independent draft model (the target's first layer, cut off) drafts from its own
    tokens and KV: the output stays distributed exactly as the target's."""
    from jspec.drafters import Drafter
    from jspec.drafters.draft_model import from_target
    cut = jspec.Target(target.config.replace(num_layers=1),
                       {k: v for k, v in target.params.items() if k != "layers_1"})
    toks, res = sample(target, Drafter(*from_target(cut, target.config)), spec, seed=3)
    p, cells = pvalue(toks, exact)
    assert p > 1e-3, (p, cells)
    hist = np.sum([s["accept_hist"] for s in res.stats], 0)
    assert hist[2:].sum() > 1000, hist


@pytest.mark.slow
@pytest.mark.parametrize("spec", [SpecConfig(3, 4, 8), SpecConfig.chain(3)],
                         ids=["tree", "chain"])
def test_dflash_sampling_matches_enumeration(target, exact, spec):
    """A block drafter's deterministic per-position drafts (top-k of one parallel forward):
    the output stays distributed exactly as the target's. A random head drafts about its
    mask token at every position, whatever its weights, so the mask token is the target's
    likeliest first token: then drafts are accepted often, at every depth."""
    likeliest = int(np.argmax(exact.sum((1, 2))))
    drafter = random_drafter("dflash", target.config, jax.random.key(4), block_size=4,
                             mask_token_id=likeliest)
    toks, res = sample(target, drafter, spec, seed=3)
    p, cells = pvalue(toks, exact)
    assert p > 1e-3, (p, cells)
    hist = np.sum([s["accept_hist"] for s in res.stats], 0)
    assert hist[2:].sum() > 1000, hist
