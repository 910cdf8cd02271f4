"""Accept length by context position (jspec.position_stats): the buckets, and that a run's
per-bucket passes and tokens add up to its accept histogram."""

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec import position_stats as ps
from jspec.bench.configs import random_config
from jspec.bench.common import random_params
from jspec.drafters import random_drafter


def test_record_and_summary():
    t = ps.empty(4)
    ctx = jnp.array([0, 255, 256, 70_000])
    t = ps.record(t, ctx, jnp.array([3, 2, 4, 1]), jnp.array([True, True, True, False]))
    t = ps.record(t, ctx, jnp.array([1, 1, 1, 1]), jnp.array([True, False, True, True]))
    assert ps.summary(t[0]) == {"0-256": {"iterations": 2, "mean_accept_len": 2.0}}
    assert ps.summary(t[2]) == {"256-512": {"iterations": 2, "mean_accept_len": 2.5}}
    assert ps.summary(t[3]) == {"65536+": {"iterations": 1, "mean_accept_len": 1.0}}
    pooled = ps.merge([ps.summary(t[r]) for r in range(4)])
    assert pooled["0-256"] == {"iterations": 3, "mean_accept_len": 2.0}
    assert list(pooled) == ["0-256", "256-512", "65536+"]
    assert "0-256" in ps.table({"x": pooled}) and len(ps.labels()) == ps.NUM_BUCKETS


def test_generate_reports_accept_by_position():
    cfg = random_config("tiny")
    target = jspec.Target(cfg, random_params(cfg, 0))
    prompts = [list(range(3, 3 + n)) for n in (250, 20)]
    res = jspec.generate(target, prompts, max_new_tokens=[30, 12], stop_ids=[],
                         drafter=random_drafter("eagle3", cfg, jax.random.key(0)))
    for st, n in zip(res.stats, (250, 20)):
        by = st["accept_by_position"]
        h = np.asarray(st["accept_hist"])
        assert sum(v["iterations"] for v in by.values()) == st["iterations"] == h.sum()
        tokens = sum(v["iterations"] * v["mean_accept_len"] for v in by.values())
        assert np.isclose(tokens, (h * np.arange(len(h))).sum())
    assert set(res.stats[0]["accept_by_position"]) == {"0-256", "256-512"}   # crosses 256
    assert set(res.stats[1]["accept_by_position"]) == {"0-256"}
