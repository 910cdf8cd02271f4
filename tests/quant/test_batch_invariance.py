"""Batch-invariant attention (jspec.invariant_attention): it computes the reference's
attention, and a query's output does not move by one bit with the block it is in, the rows
beside it or the cache bucket read; so a W8A8 target's verify pass gives every token the
keys, values and logits of its 1-token step, and W8A8 is exact under speculation."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from jspec.attention import ReferenceAttention
from jspec.checkpoint import load_target
from jspec.invariant_attention import for_params, invariant_attend, invariant_attention
from jspec.quant import QuantConfig, quantize_weight, quantized_linear
from jspec.quant.qweight import quantize_rows
from helpers import xla_env

KVH, G, D = 2, 3, 16


def _qkv(T, S, B=1, seed=0):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
    return f(B, T, KVH, G, D), f(B, KVH, S, D), f(B, KVH, S, D)


def _visible(T, S, live, tree=False):
    """Keys before ``live`` plus, for the block's queries, a causal (or tree) window."""
    B = len(live)
    win = np.tril(np.ones((T, T), bool))
    if tree:                                      # a branchy tree: node t sees its ancestors
        parent = [-1] + [(t - 1) // 2 for t in range(1, T)]
        win = np.eye(T, dtype=bool)
        for t in range(T):
            p = parent[t]
            while p >= 0:
                win[t, p], p = True, parent[p]
    vis = np.zeros((B, T, S), bool)
    for b, n in enumerate(live):
        vis[b, :, :n] = True
        vis[b, :, n:n + T] = win
    return jnp.asarray(vis)[:, None, None]


@pytest.mark.parametrize("tree", [False, True])
def test_it_computes_the_reference(tree):
    q, k, v = _qkv(8, 64, B=2)
    vis = _visible(8, 64, [21, 40], tree)
    want = ReferenceAttention.attend(q, k, v, vis, D)
    np.testing.assert_allclose(jax.jit(invariant_attend, static_argnums=4)(q, k, v, vis, D),
                               want, rtol=2e-6, atol=2e-6)


def test_a_query_is_bit_identical_across_blocks_rows_and_key_counts():
    q, k, v = _qkv(16, 512, B=3)
    run = jax.jit(invariant_attend, static_argnums=4)

    def first_row_query(T, S, B):
        live = [37, 5, 300][:B]
        out = run(q[:B, :T], k[:B, :, :S], v[:B, :, :S], _visible(T, S, live), D)
        return np.asarray(out[0, 0])

    alone = first_row_query(1, 64, 1)
    for T, S, B in [(1, 512, 1), (8, 64, 1), (16, 512, 1), (1, 64, 3), (16, 512, 3)]:
        assert np.array_equal(first_row_query(T, S, B), alone), (T, S, B)


@pytest.fixture(scope="module")
def w8a8(stories_dir):
    return load_target(stories_dir, quantize="w8a8")


def test_only_a_target_that_quantizes_activations_gets_it(w8a8, stories_dir):
    assert for_params(w8a8.serving_params, "given") is invariant_attention
    for mode in (None, "int8"):
        assert for_params(load_target(stories_dir, quantize=mode).serving_params, "given") == "given"


def test_only_w8a8_programs_for_a_cpu_take_the_legacy_emitters(stories_dir):
    """generate compiles a W8A8 target's CPU programs with XLA's loop emitters (under the
    fusion emitters a verify row left its 1-token step inside the loop); others keep XLA's
    defaults."""
    from jspec.invariant_attention import compiler_options
    w8a8 = load_target(stories_dir, quantize="w8a8").serving_params
    assert compiler_options((w8a8, 1)) == {"xla_cpu_use_fusion_emitters": False}
    for mode in (None, "int8"):
        assert compiler_options((load_target(stories_dir, quantize=mode).serving_params,)) is None


def test_programs_for_an_accelerator_keep_the_given_attention(w8a8):
    """Invariance was measured on XLA:CPU only; elsewhere the dot-free attention would only
    cost bandwidth (an 8B plan on the H200: 29.2 GB a plain step against 17.3)."""
    from jspec.platform import building_for
    for platform in ("gpu", "tpu"):
        with building_for(platform):
            assert for_params(w8a8.serving_params, "given") == "given"


def test_rows_are_quantized_as_qwix_quantizes_them():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((9, 64)) * 3, jnp.float32)
    x = x.at[4].set(0.0)                                  # an all-zero row: scale 1
    want = qwix.quantize(x, jnp.int8, channelwise_axes=(0,), scale_dtype=jnp.float32)
    got = quantize_rows(x, jnp.int8)
    assert np.array_equal(got.qvalue, want.qvalue) and np.array_equal(got.scale, want.scale)


def test_tiled_w8a8_product_is_qwix_and_the_same_alone_or_batched():
    """GGUF blocks keep one scale per 32 inputs; W8A8 sums their tiles in order."""
    r = np.random.default_rng(3)
    x = jnp.asarray(r.standard_normal((6, 64)), jnp.float32)
    w = quantize_weight(jnp.asarray(r.standard_normal((2, 24, 64)), jnp.float32),
                        QuantConfig("w8a8", tile=32), jnp.float32)
    assert w.q.scale.shape == (2, 24, 2)
    want = qwix.dot_general(quantize_rows(x, jnp.int8), w.q, (((1,), (2,)), ((), ())))
    product = jax.jit(quantized_linear)
    np.testing.assert_allclose(product(x, w), want, rtol=1e-5, atol=1e-5)
    together = np.asarray(product(x, w))
    for i in range(6):
        assert np.array_equal(np.asarray(product(x[i:i + 1], w))[0], together[i])


def _exactness(stories_dir, tmp_path, which=()):
    """``tests/helpers/w8a8_exact.py`` as a user runs it: jspec's CPU layer layout (an
    unrolled stack; the suite scans it, and with a scanned stack XLA fused the stack's last
    ops differently from one program to the next: docs/quantization.md) and XLA's default
    options, not the suite's fast ones (under XLA:CPU's fusion emitters a W8A8 verify row
    inside the loop left its 1-token step until ``generate`` compiled such programs with
    the legacy emitters, :func:`jspec.invariant_attention.compiler_options`)."""
    out = tmp_path / "w8a8.json"
    env = dict(xla_env.full_optimisation(), JSPEC_STACKED_LAYERS="0")
    script = Path(__file__).parents[1] / "helpers" / "w8a8_exact.py"
    p = subprocess.run([sys.executable, str(script), str(stories_dir), str(out), *which],
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def w8a8_doc(stories_dir, tmp_path_factory):
    return _exactness(stories_dir, tmp_path_factory.mktemp("w8a8"))


def test_w8a8_verify_gives_each_token_its_one_token_step_and_speculation_is_exact(w8a8_doc):
    """A token's keys and values at every layer (so every layer's input) in a T-token block
    equal its 1-token step's bit for bit, whatever the cache size (16 pages is one bucket of
    the reference's live-length read, 64 has three, 4 pages are fewer keys than XLA sums in
    one order: 0.14 in a logit until every read took at least MIN_KEYS) and beside another
    row; its logits (the float LM head) agree to rounding; and greedy speculative decoding
    of the W8A8 target equals its plain decoding (batch 1 and a ragged batch of 4, chain and
    tree), in ``generate`` and in the serving engine. A verify tree's node (attention alone,
    SmolLM2's head shapes) is bit-identical to its 1-token step after its path: XLA rounds
    a sum over keys by slot position, and the node's ancestors sit at other slots than in
    its step until a verify block's queries read their keys compacted (one bit before;
    SmolLM2 W8A8's tree speculation parted from plain decoding)."""
    doc = w8a8_doc
    assert len(doc["invariance"]) == 3
    for case, r in doc["invariance"].items():
        assert r["kv_equal"] and r["max_logit_diff"] < 1e-5, (case, r)
    assert doc["exact"] and all(doc["exact"].values()), doc["exact"]
    assert doc["tree_node_diff"] == 0.0
    assert set(doc["engine"]) == {"chain", "tree"}
    assert all(r["exact"] for r in doc["engine"].values()), doc["engine"]


def test_w8a8_speculative_logprobs_equal_plain_ones(w8a8_doc):
    """The bit-level claim behind W8A8's exactness, checked where it matters: in the compiled
    loops, every token both runs emit has the same logprob (to the float LM head's rounding).
    Under the fusion emitters it did not (stories260K: 0.03-0.08; SmolLM2's greedy output
    parted), though the tokens above still agreed. The serving engine's programs take the
    same options (jspec.compiled; without them its speculative tokens parted, 0.09 in a
    logprob), and its echo scoring of prompt + output, a prefill in a program of its own,
    gives the decoded logprobs (0.03 apart when it read a 32-key scratch cache)."""
    assert max(w8a8_doc["logprob_diff"].values()) < 1e-5, w8a8_doc["logprob_diff"]
    for r in w8a8_doc["engine"].values():
        assert r["logprob_diff"] < 1e-5 and r["score_diff"] < 1e-5, w8a8_doc["engine"]


@pytest.mark.slow
def test_w8a8_speculation_is_exact_for_every_drafter_kind_and_more_shapes(stories_dir, tmp_path):
    doc = _exactness(stories_dir, tmp_path, ["all"])
    assert len(doc["invariance"]) == 5 and len(doc["exact"]) == 7
    for case, r in doc["invariance"].items():
        assert r["kv_equal"] and r["max_logit_diff"] < 1e-5, (case, r)
    assert all(doc["exact"].values()), doc["exact"]
