"""Acceptance-aware node selection (jspec.tree.calibration): the fit, the in-loop features, the
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
from jspec.train.calibrate import fit, log_loss
from jspec.drafters import calibration as DC
from jspec.tree import calibration as C
from jspec.tree.select import select_pool


def synthetic_records(n, vocab, rng, D=3, R=4, K=4):
    """Records drawn from a known model: sibling groups with sorted drafter log-probabilities,
    random parents and tokens, and hits from the model's rates."""
    groups = n // K
    q = np.sort(rng.dirichlet(np.ones(8) * 0.5, groups)[:, :K], axis=1)[:, ::-1]
    prank = rng.integers(-1, 3, groups)
    plogq = np.log(rng.uniform(0.05, 1, groups))
    x = C.node_features(np.log(q), prank, plogq, xp=np).reshape(-1, len(C.FEATURES))
    tokens = np.stack([rng.permutation(vocab)[:K] for _ in range(groups)])
    tk, pk = (k.reshape(-1) for k in C.pair_keys(tokens, xp=np))
    step = np.repeat(rng.integers(0, D, groups), K)
    rank = np.tile(np.arange(K), groups)
    w = rng.normal(0, 0.6, (D, R, len(C.FEATURES))).astype(np.float32)
    w[..., 0] -= 1.0
    model = {"weights": w, "token_bias": rng.normal(0, 0.7, 2 * vocab).astype(np.float32),
             "pair_bias": rng.normal(0, 0.7, C.PAIR_BUCKETS).astype(np.float32)}
    rate = np.exp(np.asarray(C.log_rates(model, step, rank, x, tk, pk)))
    rec = {"step": step, "rank": rank, "q": q.reshape(-1), "x": x, "token_key": tk,
           "pair_key": pk, "hit": rng.uniform(size=len(x)) < rate}
    return rec, model, rate


def test_fit_recovers_a_known_model_and_beats_raw_q():
    rng = np.random.default_rng(0)
    rec, _, rate = synthetic_records(400_000, 8, rng)
    model = fit(rec, 8, depths=4, ranks=4)
    assert model["weights"].shape == (4, 4, len(C.FEATURES)) and model["token_bias"].shape == (16,)
    fitted = np.exp(np.asarray(C.log_rates(model, rec["step"], rec["rank"], rec["x"],
                                           rec["token_key"], rec["pair_key"])))
    assert np.all(fitted < 1)
    assert np.mean(np.abs(fitted - rate)) < 0.015
    # Step 3 was never observed: it copies step 2.
    np.testing.assert_array_equal(model["weights"][3], model["weights"][2])
    nll_cal, nll_raw = log_loss(model, rec)
    assert nll_cal < nll_raw
    # Without its pair biases the fit still beats raw q, but not the model that has them.
    no_pairs = fit(rec, 8, depths=4, ranks=4, pairs=False, rounds=1)
    assert not no_pairs["pair_bias"].any()
    assert nll_cal < log_loss(no_pairs, rec)[0] < nll_raw


def test_pair_keys():
    keys = lambda t: [np.asarray(k) for k in C.pair_keys(jnp.array([t]))]
    tk, pk = keys([5, 7, 9])
    np.testing.assert_array_equal(tk, [[10, 15, 19]])               # 2 * token + (rank > 0)
    assert np.all((pk >= 0) & (pk < C.PAIR_BUCKETS)) and len(set(pk[0])) == 3
    _, other = keys([5, 7, 11])
    np.testing.assert_array_equal(other[0, :2], pk[0, :2])          # same token and rival
    assert other[0, 2] != pk[0, 2]
    _, other = keys([6, 7, 9])                                      # rank 0 is every rival
    assert np.all(other[0] != pk[0])
    _, other = keys([5, 8, 9])                                      # rank 1 rivals rank 0
    assert other[0, 0] != pk[0, 0] and other[0, 2] == pk[0, 2]
    for a, b in zip(C.pair_keys(np.array([[5, 7, 9]]), xp=np), (tk, pk)):
        np.testing.assert_array_equal(a, b)                         # numpy hashes alike
    chain_tk, chain_pk = keys([5])
    assert chain_tk[0, 0] == 10 and 0 <= chain_pk[0, 0] < C.PAIR_BUCKETS


def test_node_features_and_log_rates():
    logq = np.log(np.array([[0.6, 0.2, 0.1], [0.5, 0.3, np.nan]]))
    x = np.asarray(C.node_features(jnp.asarray(logq), jnp.array([-1, 2]), jnp.array([-0.3, -1.5])))
    assert x.shape == (2, 3, len(C.FEATURES))
    f = dict(zip(C.FEATURES, np.moveaxis(x, -1, 0)))
    np.testing.assert_allclose(f["logq"][0], logq[0], rtol=1e-6)
    assert f["logq"][1, 2] == C.LOGQ_FLOOR                               # a missing sibling
    np.testing.assert_allclose(f["logq_rank0"], np.log([[0.6] * 3, [0.5] * 3]), rtol=1e-6)
    np.testing.assert_allclose(f["logq_rank1"], np.log([[0.2] * 3, [0.3] * 3]), rtol=1e-6)
    np.testing.assert_array_equal(f["parent_rank0"], 0)                  # root, then rank 2
    np.testing.assert_array_equal(f["parent_later"], [[0] * 3, [1] * 3])
    np.testing.assert_allclose(f["parent_logq"], [[0] * 3, [-1.5] * 3])  # the root reads 0
    in_numpy = C.node_features(logq, np.array([-1, 2]), np.array([-0.3, -1.5]), xp=np)
    np.testing.assert_array_equal(x, in_numpy)
    w = np.zeros((2, 2, len(C.FEATURES)), np.float32)
    w[0, 0, 1], w[1, 1, 0] = 1.0, -2.0
    model = {"weights": w, "token_bias": np.array([0.0, 0.5, -0.5, 0.0], np.float32),
             "pair_bias": np.zeros(C.PAIR_BUCKETS, np.float32)}
    model["pair_bias"][7] = 0.25
    lr = lambda step, rank, tk, pk: float(C.log_rates(model, step, rank, x[0, 0], tk, pk))
    assert lr(0, 0, 1, 7) == pytest.approx(
        np.log(1 / (1 + np.exp(-(np.log(0.6) + 0.75)))), abs=1e-6)
    assert lr(5, 7, 2, 0) == pytest.approx(np.log(1 / (1 + np.exp(2.5))), abs=1e-6)  # last cell
    scores = C.node_scores("calibrated", jnp.asarray(logq), 0, {C.PARAM_KEY: model},
                           jnp.array([[0, 1, 2]] * 2) // 2, jnp.array([-1, 2]), jnp.array([0.0, -1.5]))
    assert scores[1, 2] == -np.inf and bool(jnp.all(scores[:, :2] < 0))
    lq = jnp.asarray(logq)
    assert C.node_scores("eagle2", lq, 0, {}) is lq


@pytest.fixture(scope="module")
def tiny():
    cfg = jspec.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.key(0))
    params["embed_tokens"]["embedding"] = params["embed_tokens"]["embedding"] * 4
    return jspec.Target(cfg, params)


def test_calibrated_selection_drafts_other_closed_trees(tiny, rank_model):
    model = rank_model(64)
    model["token_bias"][::3] = -1.0                  # so the token ids the loop reads matter
    model["pair_bias"][::5] = 0.5
    d = DC.attach(random_drafter("eagle3", tiny.config, jax.random.key(1)), model)
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
        if sel == "calibrated":
            # The loop's scores are the path sums of the model over the pool's own features,
            # the ones calibration records are fitted on (one definition of the features).
            step, rank = pool.depth_rank(pool.scores.shape[1], 4)
            rates = C.log_rates(model, step, rank,
                                *C.pool_features(pool.logq, pool.parents, pool.tokens, 4))
            parent_score = jnp.where(pool.parents < 0, 0.0,
                                     jnp.take_along_axis(pool.scores, par, 1))
            np.testing.assert_allclose(pool.scores, parent_score + rates, rtol=1e-5, atol=1e-5)
    # The rank model trusts rank-0 chains: calibrated trees are deeper than EAGLE-2's.
    assert trees["calibrated"].max(1).mean() > trees["eagle2"].max(1).mean()


def test_stored_beside_the_drafter_checkpoint(tiny, rank_model, tmp_path):
    d = random_drafter("eagle1", tiny.config, jax.random.key(1))
    model = rank_model(64)
    model["token_bias"][[3, 40]] = [0.25, -1.5]
    model["pair_bias"][[0, 1000, C.PAIR_BUCKETS - 1]] = [0.5, -0.125, 2.0]
    save_drafter(DC.attach(d, model), tmp_path / "d")
    assert (tmp_path / "d" / DC.FILENAME).is_file()
    back = load_drafter(tmp_path / "d", tiny.config).params[C.PARAM_KEY]
    for k in C.KEYS:                                        # stored to 5 and 4 decimals
        np.testing.assert_allclose(np.asarray(back[k]), model[k], atol=1e-4)
    save_drafter(d, tmp_path / "plain")
    assert C.PARAM_KEY not in load_drafter(tmp_path / "plain", tiny.config).params
    bad = tmp_path / "plain" / DC.FILENAME
    bad.write_text('{"version": 1, "shape": [1, 1, 2], "log_rate": [[[-0.5, -0.1]]]}')
    with pytest.raises(CheckpointError, match="version 1.*jspec.train calibrate"):
        load_drafter(tmp_path / "plain", tiny.config)
    DC.save(tmp_path / "plain", rank_model(65))               # another target's vocabulary
    with pytest.raises(CheckpointError, match=r"token_bias must be \[128\]"):
        load_drafter(tmp_path / "plain", tiny.config)
    with pytest.raises(C.CalibrationError, match="weights must be"):
        DC.attach(d, {**model, "weights": np.zeros((2, 2))})


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
    model = fit(rec, 64)
    spec = SpecConfig(4, 3, 6)
    assert tf.accept(None, spec.with_selection("calibrated"), calibration=model) == 5.0
    assert tf.accept(None, spec) <= 5.0
