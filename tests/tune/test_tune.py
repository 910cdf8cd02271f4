"""``jspec.tune``: the cost model, the stored pick, ``spec="auto"``, and one small tuning run
end to end (stories260K, a random EAGLE-1 drafter saved to disk)."""

from __future__ import annotations

import json
import logging

import jax
import pytest

import jspec
from jspec import tune, tune_store
from jspec.drafters import random_drafter
from jspec.drafters.checkpoint import load_drafter, save_drafter
from jspec.spec_config import SpecConfig


def test_cost_model_interpolates_and_fits_the_overhead():
    c = tune.Costs(batch=1, t1=2.0, tv={2: 2.0, 8: 4.0}, step={1: 0.5, 4: 1.0})
    assert c.t_verify(5) == pytest.approx(3.0) and c.t_step(2) == pytest.approx(2 / 3)
    chain = SpecConfig.chain(3)                       # N = 4, K = 1, S = 3
    assert c.iteration_ms(chain) == pytest.approx(c.t_verify(4) + 3 * 0.5)
    fitted = tune.fit_overhead(c, chain, c.iteration_ms(chain) + 0.75)
    assert fitted.overhead == pytest.approx(0.75)
    assert fitted.iteration_ms(SpecConfig(5, 4, 8)) == pytest.approx(4.0 + 5 * 1.0 + 0.75)
    fast = tune.fit_overhead(c, chain, 0.5 * c.iteration_ms(chain))   # never a negative overhead:
    assert fast.overhead == 0.0 and fast.scale == pytest.approx(0.5)    # the steps scale instead
    assert fast.iteration_ms(chain) == pytest.approx(0.5 * c.iteration_ms(chain))
    assert c.as_dict()["t_V/t_1"] == {2: 1.0, 8: 2.0}


def test_forced_accept_is_capped_by_depth():
    grid = [SpecConfig.chain(2), SpecConfig(5, 4, 8)]
    assert tune.predict_accept(None, None, grid, [], forced_accept=4.0) == {"2,1,3": 3.0,
                                                                             "5,4,8": 4.0}


def test_grid_has_calibrated_trees_when_asked_and_shapes_round_trip():
    grid = tune.default_grid(selections=("eagle2", "calibrated"))
    cal = [g for g in grid if g.selection == "calibrated"]
    assert cal and all(not g.is_chain for g in cal) and len(grid) == 39 + len(cal)
    assert tune.shape(SpecConfig(5, 4, 8, "calibrated")) == "5,4,8/cal"
    assert all(tune.parse_shape(tune.shape(g)) == g for g in grid)


def test_default_grid_is_valid_and_large_enough():
    grid = tune.default_grid()
    assert len(grid) >= 20 and len({tune.shape(g) for g in grid}) == len(grid)
    assert SpecConfig(5, 4, 8) in grid and SpecConfig.chain(7) in grid


def test_spec_auto_without_a_pick_warns_and_uses_the_default(caplog):
    d = random_drafter("eagle1", jspec.LlamaConfig(vocab_size=64, hidden_size=32,
                                                   intermediate_size=64, num_layers=2,
                                                   num_heads=2, num_kv_heads=1, head_dim=16))
    with caplog.at_level(logging.WARNING, logger="jspec"):
        assert tune_store.resolve_spec(d, "auto", 1) == d.default_spec
    assert "no tuned pick" in caplog.text
    with pytest.raises(ValueError, match="auto"):
        tune_store.resolve_spec(d, "fast", 1)


def test_tune_picks_the_fastest_timed_shape_and_spec_auto_uses_it(stories_dir, tmp_path):
    target = jspec.load_target(stories_dir)
    path = tmp_path / "drafter"
    save_drafter(random_drafter("eagle1", target.config, jax.random.key(0)), path)
    drafter = load_drafter(path, target.config)
    assert drafter.source == str(path) and drafter.serving.source == str(path)
    prompts = ["Once upon a time", "The little dog"]
    grid = [SpecConfig.chain(2), SpecConfig(3, 2, 4)]
    res = tune.tune(target, drafter, prompts, new_tokens=12, grid=grid, exhaustive=True,
                    repeats=1, cost_repeats=2, calib_tokens=16, cost_nodes=(2, 4),
                    cost_topk=(1, 2), progress=lambda m: None)
    timed = [r for r in res.rows if r.get("tok/s meas")]
    # exhaustive: every grid shape (and the drafter's default, added) was timed
    assert {r["S,K,N"] for r in timed} == {"2,1,3", "3,2,4", "5,4,8"}
    assert res.pick == max(timed, key=lambda r: r["tok/s meas"])["spec"]
    for r in timed:
        assert r["E pred"] >= 1.0 and r["E meas"] >= 1.0 and r["tok/s pred"] > 0
    assert set(res.errors()) == {"timed shapes", "E error", "tok/s error"}
    assert 0 < res.confirm_pick["of best"] <= 1.0
    # The acceptance profile: per depth and sibling rank, from one wide teacher-forced run.
    prof = res.profile
    assert len(prof["rate"]) == tune.PROFILE_SPEC.num_steps
    assert len(prof["rate"][0]) == tune.PROFILE_SPEC.topk and prof["count"][0][0] > 0
    assert all(v is None or 0.0 <= v <= 1.0 for row in prof["rate"] for v in row)
    assert "| depth | rank 0 |" in tune.format_profile(prof)
    again = tune.TuneResult.from_dict(json.loads(json.dumps(res.as_dict())))
    assert again.pick == res.pick and again.rows == res.rows and again.profile == prof
    assert again.costs.iteration_ms(res.pick) == pytest.approx(res.costs.iteration_ms(res.pick))
    assert again.shortlist_pick(1, None)["S,K,N"] == max(res.rows, key=lambda r: r["tok/s pred"])["S,K,N"]
    stored = tune_store.store(res, drafter.source)
    data = json.loads(stored.read_text())
    assert list(data["picks"]) == [f"{tune_store.device_kind()}|batch=1"]
    assert tune_store.stored_spec(drafter, 1) == res.pick
    assert tune_store.stored_spec(drafter, 2) is None
    plain = jspec.generate(target, prompts[:1], max_new_tokens=10)
    auto = jspec.generate(target, prompts[:1], max_new_tokens=10, drafter=drafter, spec="auto")
    assert auto.tokens == plain.tokens
    S = res.pick.num_steps
    assert len(auto.stats[0]["accept_hist"]) == S + 2      # accept lengths 0 .. S + 1
