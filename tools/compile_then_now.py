"""Compile time of the whole speculative program at any commit, for issue 9's "3x lower" goal.

``jspec.bench anatomy`` did not exist when issue 9 was filed (8da0781), so this script uses
only what both that tree and today's have in common: ``SpecDecoder.run`` (prefill plus the
``while`` loop of iterations: exactly the program ``jspec.generate`` compiles), ``admit``,
``random_drafter`` and ``llama.init_params``. Weights and inputs are abstract
(``jax.eval_shape``), so the Llama-3-8B shape needs no memory.

    git worktree add /tmp/then 8da0781
    python tools/compile_then_now.py --repo /tmp/then   # the program when the issue was filed
    python tools/compile_then_now.py --repo .           # today's (scanned stack, as TPU/GPU run)
    python tools/compile_then_now.py --repo . --per-layer

Each run prints one JSON line: lower and compile seconds, and the optimized module's size.
``--aot v5p`` compiles for a TPU generation without one (needs libtpu), tracing as for TPU
where the tree knows how (``jspec.platform.building_for``; the 8da0781 tree has no such switch
and traces its one path).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", default=".")
    ap.add_argument("--spec", default="5,4,8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--per-layer", action="store_true", help="today's tree: the unrolled stack")
    ap.add_argument("--kernels", default="reference",
                    help="reference | pallas (the TPU/GPU kernels: what kernels='auto' picks "
                         "there)")
    ap.add_argument("--aot", default=None, help="v5e | v6e | v5p (deviceless TPU compile)")
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.repo))

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jspec
    from jspec import llama
    from jspec.config import LlamaConfig, RopeConfig
    from jspec.drafters import random_drafter
    try:
        from jspec.admission import admit
    except ImportError:          # a checkout from before the plan seam
        from jspec.generate import _admit as admit
    from jspec.sampling import SamplingConfig
    from jspec.spec_config import SpecConfig
    from jspec.spec_decode import SpecDecoder, tree_shape
    assert os.path.dirname(jspec.__file__).startswith(os.path.abspath(a.repo)), jspec.__file__

    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192)
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, rope=rope,
                      tie_word_embeddings=False, max_position_embeddings=131072,
                      bos_token_id=128000, eos_token_ids=(128001, 128009), dtype="bfloat16")

    # The editable install's finder would serve today's modules for names the old tree lacks.
    has = lambda rel: os.path.exists(os.path.join(a.repo, rel))
    building = contextlib.nullcontext()
    device = None
    if a.aot:
        from jspec import aot
        device = aot.device(a.aot)
        if has("jspec/platform.py"):
            from jspec.platform import building_for
            building = building_for("tpu")

    def target_params(k):
        p = llama.init_params(cfg, k)
        if not has("jspec/serving_layout.py"):
            return p
        from jspec import serving_layout             # today's tree: the packed serving layout
        return serving_layout.pack_params(cfg, p, not a.per_layer)

    box = {}

    def drafter_params(k):
        d = random_drafter("eagle3", cfg, k, vocab_size=a.draft_vocab)
        box["module"] = d.module
        return d.params

    S_, K_, N_ = (int(x) for x in a.spec.split(","))
    with building:
        params = jax.eval_shape(target_params, jax.random.key(0))
        dparams = jax.eval_shape(drafter_params, jax.random.key(0))
        module = box["module"]
        spec = SpecConfig(S_, K_, N_)
        S, N = tree_shape(module, spec)
        slots = module.cache_slots(spec) if hasattr(module, "cache_slots") else N
        overshoot = max(N, slots) + S + 1
        B = a.batch
        lens = np.full((B,), a.context, np.int32)
        limits = np.full((B,), a.max_new, np.int32)
        n_admit = len(inspect.signature(admit).parameters)
        admit_args = (lens, limits, overshoot, 16, None, 16, None)
        T, cap_new, num_pages, table = admit(*admit_args, *((1,) if n_admit > 7 else ()))
        dec = SpecDecoder(cfg, module, spec, SamplingConfig(0.0), cap_new, 16, num_pages, 0.0,
                          None, a.kernels)
        sds = jax.ShapeDtypeStruct
        args = (params, dparams, sds((B, T), jnp.int32), sds((B,), jnp.int32),
                sds(table.shape, jnp.int32), sds(table.shape, jnp.int32), sds((B, 8), jnp.int32),
                sds((B,), jnp.int32), jax.eval_shape(lambda: jax.random.key(0)))
        if device is not None:
            sh = jax.sharding.SingleDeviceSharding(device)
            args = jax.tree.map(lambda x: sds(x.shape, x.dtype, sharding=sh), args)
        t0 = time.perf_counter()
        lowered = jax.jit(lambda *x: dec.run(*x)).lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
    text = compiled.as_text()
    print(json.dumps({"repo": a.repo, "jspec": os.path.dirname(jspec.__file__),
                      "aot": a.aot or jax.default_backend(), "per_layer": a.per_layer,
                      "kernels": a.kernels,
                      "spec": a.spec, "batch": B, "context": a.context,
                      "draft_vocab": a.draft_vocab, "lower_s": round(t1 - t0, 2),
                      "compile_s": round(t2 - t1, 2), "total_s": round(t2 - t0, 2),
                      "hlo_lines": text.count("\n"), "jax": jax.__version__}), flush=True)


if __name__ == "__main__":
    main()
