"""Acceptance-aware node selection (jspec.tree.calibration): the fit, the in-loop lookup, the
selection it drives, storage beside a drafter checkpoint, and the teacher-forced records."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import kv_cache as kvc
from jspec.checkpoint import CheckpointError
from jspec.drafters import load_drafter, random_drafter, save_drafter
from jspec.llama import init_params
from jspec.spec_config import SpecConfig
from jspec.train.acceptance import TeacherForced
from jspec.tree import calibration as C
from jspec.tree.select import select_pool


def true_rate(step, rank, q):
    return np.sqrt(q) * np.where(rank == 0, 1.0, 0.3) * 0.9 ** step


def test_fit_recovers_rates_monotone_and_beats_raw_q():
    rng = np.random.default_rng(0)
    n = 300_000
    step, rank, q = rng.integers(0, 3, n), rng.integers(0, 4, n), rng.uniform(size=n)
    hit = rng.uniform(size=n) < true_rate(step, rank, q)
    table = C.fit(step, rank, q, hit, depths=4, ranks=4, bins=10)
    assert table.shape == (4, 4, 10) and np.all(table <= 0)
    assert np.all(np.diff(table, axis=-1) >= -1e-6)            # isotonic in q
    centres = (np.arange(10) + 0.5) / 10
    for s in range(3):
        for r in range(4):
            np.testing.assert_allclose(np.exp(table[s, r]), true_rate(s, r, centres), atol=0.05)
    # Step 3 was never observed: it copies step 2 (and later ranks the last observed rank).
    np.testing.assert_array_equal(table[3, 0], table[2, 0])
    nll_cal, nll_raw = C.log_loss(table, step, rank, q, hit)
    assert nll_cal < nll_raw


def test_lookup_interpolates_between_bin_centres():
    table = np.log(np.array([[[0.1, 0.3, 0.5, 0.9]], [[0.2, 0.2, 0.2, 0.2]]], np.float32))  # [2,1,4]
    at = lambda step, q: float(C.lookup(table, step, 0, jnp.log(jnp.float32(q))))
    assert at(0, 0.375) == pytest.approx(np.log(0.3), abs=1e-5)        # a bin centre
    assert at(0, 0.5) == pytest.approx(0.5 * np.log(0.3) + 0.5 * np.log(0.5), abs=1e-5)
    assert at(0, 0.01) == pytest.approx(np.log(0.1), abs=1e-5)         # flat past the edges
    assert at(5, 0.9) == pytest.approx(np.log(0.2), abs=1e-5)          # deeper steps: last row
    assert float(C.lookup(table, 0, 3, jnp.float32(np.nan))) == -np.inf
    logq = jnp.log(jnp.array([[0.5, 0.2]]))
    assert C.node_scores("eagle2", logq, 0, {}) is logq


@pytest.fixture(scope="module")
def tiny():
    cfg = jspec.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.key(0))
    params["embed_tokens"]["embedding"] = params["embed_tokens"]["embedding"] * 4
    return jspec.Target(cfg, params)


def test_calibrated_selection_drafts_other_closed_trees(tiny, rank_table):
    d = C.attach(random_drafter("eagle3", tiny.config, jax.random.key(1)), rank_table)
    m, B, T, ps = d.module, 4, 12, 8
    table = kvc.allocate_page_table([T + 40] * B, ps, B * 8)
    state = m.init_state(B, table, B * 8, ps)
    feats = jax.random.normal(jax.random.key(2), (B, T, 3 * tiny.config.hidden_size))
    nxt = jax.random.randint(jax.random.key(3), (B, T), 0, 64)
    state = m.prefill(d.params, (tiny.config, tiny.params), state, feats, nxt, jnp.full((B,), T))
    trees = {}
    for sel in ("eagle2", "calibrated"):
        spec = SpecConfig(5, 4, 10, sel)
        pool = m.draft_pool(d.params, (tiny.config, tiny.params), state, spec)
        tree, closed = select_pool(nxt[:, -1], pool, 10, 5)
        assert bool(jnp.all(closed))
        # Calibrated log-rates are <= 0, so path scores never increase down a path.
        par = jnp.clip(pool.parents, 0, None)
        assert bool(jnp.all((pool.parents < 0)
                            | (pool.scores <= jnp.take_along_axis(pool.scores, par, 1) + 1e-6)))
        trees[sel] = np.asarray(tree.depths)
    # The rank table trusts rank-0 chains: calibrated trees are deeper than EAGLE-2's.
    assert trees["calibrated"].max(1).mean() > trees["eagle2"].max(1).mean()


def test_stored_beside_the_drafter_checkpoint(tiny, rank_table, tmp_path):
    d = random_drafter("eagle1", tiny.config, jax.random.key(1))
    save_drafter(C.attach(d, rank_table), tmp_path / "d")
    assert (tmp_path / "d" / C.FILENAME).is_file()
    back = load_drafter(tmp_path / "d", tiny.config)
    np.testing.assert_allclose(np.asarray(back.params[C.PARAM_KEY]), rank_table, atol=1e-4)  # stored to 4 places
    save_drafter(d, tmp_path / "plain")
    assert C.PARAM_KEY not in load_drafter(tmp_path / "plain", tiny.config).params
    (tmp_path / "plain" / C.FILENAME).write_text('{"shape": [1, 1, 2], "log_rate": [[[0.5, 0.1]]]}')
    with pytest.raises(CheckpointError, match=C.FILENAME):
        load_drafter(tmp_path / "plain", tiny.config)


def test_target_as_its_own_drafter_reaches_the_chain_ceiling_when_calibrated(tiny):
    """The target drafting for itself: its rank-0 child is always the greedy token, so the
    calibration learns rank 0 = certain, and calibrated selection drafts that chain and
    accepts all S + 1 tokens at every position, whatever EAGLE-2 makes of the same pools."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(2, 64, n) for n in (20, 27)]
    tf = TeacherForced(tiny, seqs, stride=3, max_depth=5, chunk=16)
    rec = tf.records(None, SpecConfig(4, 4, 16))
    first = (rec["step"] == 0) & (rec["rank"] == 0)
    assert rec["hit"][first].all() and not rec["hit"][rec["rank"] > 0].any()
    table = C.fit(rec["step"], rec["rank"], rec["q"], rec["hit"])
    spec = SpecConfig(4, 3, 6)
    assert tf.accept(None, spec.with_selection("calibrated"), calibration=table) == 5.0
    assert tf.accept(None, spec) <= 5.0
