"""A quantized target saved as a jspec Orbax checkpoint (``python -m jspec.convert --quantize``)
loads back bit for bit, as the same mode, on one device and straight into a mesh's shardings
(values and scales placed as the packed layout says); a GGUF's kept blocks survive the trip;
bad combinations fail with clear errors before anything is written."""

import json
import os
import subprocess
import sys
import textwrap

import gguf
import jax
import numpy as np
import pytest
from helpers.gguf_files import SMALL_CFG as CFG, SMALL_VOCAB as VOCAB, write_llama_gguf

import jspec
from jspec import convert
from jspec.checkpoint import CheckpointError, load_target, save_orbax
from jspec.checkpoint.hf import state_dict_from_params
from jspec.llama import init_params
from jspec.quant import mode_of
from jspec.scoring import teacher_forced

IDS = [1, 5, 9, 30, 2, 7, 44, 12]


def same_tree(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return (jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
            and all(x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
                    for x, y in zip(la, lb)))


def logprobs(t):
    return np.array([e.logprob for e in teacher_forced(t, IDS)[1:]])


@pytest.mark.parametrize("mode", ["int8", "fp8", "w8a8"])
def test_convert_quantize_round_trip(stories_dir, tmp_path, mode):
    dst = tmp_path / "q"
    assert convert.main([str(stories_dir), str(dst), "--quantize", mode]) == 0
    meta = json.loads((dst / "jspec_config.json").read_text())
    assert meta["jspec"]["quant"]["mode"] == mode
    want = load_target(stories_dir, quantize=mode)
    got = load_target(dst)
    assert mode_of(got.params) == mode
    assert same_tree(got.params, want.params)
    np.testing.assert_array_equal(logprobs(got), logprobs(want))
    assert got.tokenizer.encode("Once upon") == want.tokenizer.encode("Once upon")
    # Asking for the mode it holds is a no-op; another mode is refused.
    assert same_tree(load_target(dst, quantize=mode).params, want.params)
    other = "int8" if mode != "int8" else "fp8"
    with pytest.raises(CheckpointError, match=f"quantized as {mode}"):
        load_target(dst, quantize=other)


def test_gguf_blocks_survive_the_trip(tmp_path):
    sd = state_dict_from_params(CFG, init_params(CFG, jax.random.key(0)))
    f = tmp_path / "m.gguf"
    write_llama_gguf(f, CFG, sd, VOCAB, qtype=gguf.GGMLQuantizationType.Q8_0)
    q = load_target(f, quantize="int8")
    save_orbax(q, tmp_path / "q")
    back = load_target(tmp_path / "q")
    assert same_tree(back.params, q.params)        # in_scale (GGUF norms) included
    np.testing.assert_array_equal(logprobs(back), logprobs(q))


def test_bad_combinations(stories_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        convert.main([str(stories_dir), str(tmp_path / "h"), "--quantize", "int8", "--to", "hf"])
    assert "--quantize writes a jspec Orbax checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert.main([str(stories_dir), str(tmp_path / "h"), "--quantize", "int4"])
    assert not (tmp_path / "h").exists()


SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    import jspec
    from jspec import sharding
    from jspec.checkpoint import load_target, save_orbax
    from jspec.serving_layout import packed_param_shardings

    src, out = sys.argv[1], sys.argv[2]
    ref = load_target(src, quantize="int8")
    save_orbax(ref, out)
    mesh = sharding.make_mesh(2, 4)
    t = load_target(out, mesh=mesh)
    want = packed_param_shardings(mesh, t.params)
    placed = jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), t.params, want)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                        t.params, ref.params)
    sharded = [a for a in jax.tree.leaves(t.params) if not a.sharding.is_fully_replicated]
    prompts = [[1, 5, 9], [1, 30, 2, 7]]
    gen = lambda tg, **kw: jspec.generate(tg, prompts, max_new_tokens=12, stop_ids=[], **kw).tokens
    print(json.dumps({"placed": all(jax.tree.leaves(placed)), "same": all(jax.tree.leaves(same)),
                      "int8_sharded": any(a.dtype == np.int8 for a in sharded),
                      "tokens": gen(t, mesh=mesh), "plain": gen(ref)}))
""")


def test_quantized_orbax_restores_into_a_mesh(stories_dir, tmp_path):
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                      + " --xla_force_host_platform_device_count=8").strip())
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(stories_dir), str(tmp_path / "q")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["same"] and res["placed"] and res["int8_sharded"]
    assert res["tokens"] == res["plain"]
