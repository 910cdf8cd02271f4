"""``bench memory-floor`` and ``bench verify-cost`` on a tiny target: the pieces compute what
they say (no assertions on times)."""

from __future__ import annotations

import jax

from benchmarks import memory_floor, verify_cost
from helpers.tiny_targets import tiny_target


def test_step_bytes_counts_every_parameter_once_and_the_cache():
    t = tiny_target()
    cfg = t.config
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t.params))
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 10
    assert memory_floor.step_bytes(t, 10) == params + kv


def test_bandwidth_and_bf16_product_report_their_fields():
    bw = memory_floor.read_bandwidth(8, 1)
    assert set(bw) == {"numpy (1 thread)", "XLA jnp.sum"} and all(v > 0 for v in bw.values())
    prod = memory_floor.bf16_product(64, 256, 1)
    assert set(prod["seconds"]) == {"float32", "bfloat16"}
    assert isinstance(prod["converts_weight"], bool)


def test_verify_cost_curve():
    out = verify_cost.curve(tiny_target(), [1], [2, 4], context=16, repeats=2)
    assert set(out) == {1} and out[1]["t_1 ms"] > 0 and out[1][2] > 0 and out[1][4] > 0
