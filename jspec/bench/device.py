"""``python -m jspec.bench device``: the prepared one-accelerator benchmark (one H200, < 8 min).

Run it from the repository root::

    OUT=/path/to/out python -m jspec.bench device           # the GPU run: $OUT/device_bench.json
    OUT=/tmp/out python -m jspec.bench device --smoke       # tiny shapes: a CPU check (< ~60 s)

It prints one summary table (a row per section) and a table per section, and writes one JSON
(``$OUT/device_bench.json``; ``OUT`` defaults to ``./out``) with every section under
``sections.<name>``: ``status`` (``ok``, ``error``, ``timeout``, ``skipped``), ``seconds``,
``error`` / ``reason`` when not ok, and the section's numbers.

Every section runs in its own Python process with its own hard time cap (``CAPS``; the whole
run also stops launching sections at ``--budget`` seconds), so one section that fails,
crashes or overruns records that in the JSON and the rest still run. The processes run one
after the other (timings never overlap); the parent process never touches the accelerator.

Sections, at Llama-3-8B shape (``configs.random_config("llama3-8b", "bfloat16")``: random
weights drawn on the device, never on the host), batch 1, 2k-token context, page size 16:

- ``copy``: device copy bandwidth, ``jit(x + 1)`` over a 2 GiB float32 buffer (read + write
  bytes / median time; :func:`jspec.bench.kernels.copy_bandwidth`);
- ``plain_decode``: one decode step (a 1-token target forward with logits against the 2k
  cache, as the driver's verify runs it: ``SpecDecoder.verify`` on a 1-node tree) at batch 1
  and 8: ms/step, achieved GB/s (weights read + KV read, over the step time) and the
  bandwidth floor (the same bytes / the ``copy`` bandwidth) with ``floor/ms``;
- ``verify``: ``t_V(N)``, one target forward over N tree nodes (a binary tree, its tree
  mask, positions ``context + depth``) for N in {1, 4, 8, 16, 32, 64}, and ``t_V/t_1``
  (t_1 = N = 1), all timed round-robin;
- ``draft``: the EAGLE-3 draft step cost ``c`` = one tree-loop step of a random EAGLE-3
  drafter with a 32k draft vocabulary (K = 4 frontier nodes, its windowed KV, top-K) / t_1,
  as :func:`jspec.bench.spec.micro_costs` measures it for the (5, 4, 8) tree (it also
  reports its own t_1 and t_V(8));
- ``e2e``: :func:`jspec.generate` end to end, batch 1, 2k prompt, 128 new tokens, plain vs
  the EAGLE-3 drafter (tree (5, 4, 8)) with ``forced_accept`` = 2, 3, 4: warm tokens/s,
  speed-up over plain, and the cost model's ideal ``E / (t_V(8)/t_1 + S c)`` when the
  ``verify`` and ``draft`` sections ran (:func:`jspec.bench.spec.ideal_speedup`). The four
  programs are compiled concurrently (threads), then timed round-robin;
- ``kernels``: the Pallas kernels as compiled for the device against their jnp references:
  tree attention (8B attention shape, bf16, N in {1, 8, 64}), the greedy and sampling verify
  walks (V = 128256), what ``kernels="auto"`` resolves to for the 8B shape (and how long the
  probe took), and generate(kernels="pallas") vs "reference" tokens on the tiny model;
- ``hf``: transformers' greedy ``generate`` on the same shape (torch, bf16, random weights,
  ``LlamaForCausalLM`` built on cuda), batch 1, 2k prompt, 128 new tokens: tokens/s (skipped
  with the reason when torch, transformers or CUDA is missing);
- ``pytest``: ``python -m pytest -m "slow or not slow"`` over the kernel test files, with a
  timeout; pass/fail/skip counts and the failing ids. Those tests run the kernels in Pallas
  *interpret* mode (plus cross-lowering checks) whatever the backend; the ``kernels``
  section is the check of the kernels compiled for the device.

Compile budget (the layer stack is one ``lax.scan``, so an 8B program compiles like a
one-layer one): the verify forward at 6 block widths, the batch-1 and batch-8 steps,
micro_costs' three programs and four ``generate`` programs; within ``plain_decode``,
``verify`` and ``e2e`` they are lowered one by one and compiled in parallel threads. ``--smoke`` shrinks every section (the "tiny" config, 64-token context,
N in {1, 4}, batch 1 and 2, 16 new tokens, a few pytest cases).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback

RESULT_NAME = "device_bench.json"
SECTIONS = ("copy", "plain_decode", "verify", "draft", "e2e", "kernels", "hf", "pytest")
# Hard caps (seconds, process start included) on the H200 and in --smoke. Sum <= BUDGET.
CAPS = {"copy": 20, "plain_decode": 55, "verify": 75, "draft": 60, "e2e": 110, "kernels": 40,
        "hf": 55, "pytest": 35}
SMOKE_CAPS = {s: 120 for s in SECTIONS}
BUDGET = 455          # seconds: no section starts after this; < 8 min with start-up margin
SMOKE_BUDGET = 600
KERNEL_TESTS = ["tests/test_kernel_tree_attention.py", "tests/test_kernel_verify_walk.py",
                "tests/test_kernels_e2e.py"]
SMOKE_TESTS = ["tests/test_kernel_verify_walk.py", "-k", "auto_on_cpu or dispatch_under_jit"]


# ====================================================================== shapes
class Plan:
    """Every size a section uses, full or ``--smoke``."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.config = "tiny" if smoke else "llama3-8b"
        self.dtype = "bfloat16"
        self.context = 64 if smoke else 2048
        self.batches = (1, 2) if smoke else (1, 8)
        self.nodes = (1, 8) if smoke else (1, 4, 8, 16, 32, 64)
        self.page_size = 16
        self.draft_vocab = 128 if smoke else 32768
        self.spec = (5, 4, 8)
        self.accepts = (2,) if smoke else (2, 3, 4)
        self.new_tokens = 16 if smoke else 128
        self.repeats = 3 if smoke else 20
        self.e2e_repeats = 2 if smoke else 3
        self.copy_bytes = (1 << 24) if smoke else (1 << 31)
        self.kernel_nodes = (1, 4) if smoke else (1, 8, 64)
        self.walk_vocab = 256 if smoke else 128256

    def target_config(self):
        from jspec.bench.configs import RANDOM_CONFIGS, random_config
        if self.config in RANDOM_CONFIGS:
            return random_config(self.config, self.dtype)
        # Only when configs.py lacks the entry (it has it since the anatomy bench).
        from jspec.bench.configs import LLAMA3_ROPE
        from jspec.config import LlamaConfig
        return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                           num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                           rope=LLAMA3_ROPE, tie_word_embeddings=False,
                           max_position_embeddings=131072, bos_token_id=128000,
                           eos_token_ids=(128001, 128009), dtype=self.dtype)


# ====================================================================== device helpers
def device_info() -> dict:
    import jax
    d = jax.devices()[0]
    return {"jax": jax.__version__, "backend": jax.default_backend(), "platform": d.platform,
            "device_kind": d.device_kind, "num_devices": jax.device_count()}


def device_random_params(cfg, seed: int = 0):
    """Random checkpoint-layout parameters drawn on the device (no host copy), distributed
    like :func:`jspec.bench.common.random_params`: embeddings ~ N(0, 1), ``[in, out]``
    kernels ~ N(0, 1/in), norm scales ~ 1 + 0.2 N(0, 1). One jitted program."""
    import jax

    from jspec import llama

    abstract = jax.eval_shape(lambda k: llama.init_params(cfg, k), jax.random.key(0))
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)

    def draw(key):
        leaves = []
        for k, (path, s) in zip(jax.random.split(key, len(flat)), flat):
            name = str(getattr(path[-1], "key", path[-1]))
            x = jax.random.normal(k, s.shape, s.dtype)
            if name == "scale":
                x = 1.0 + 0.2 * x
            elif name == "kernel":
                x = x * (1.0 / math.sqrt(s.shape[0]))
            leaves.append(x.astype(s.dtype))
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return jax.jit(draw)(jax.random.key(seed))


def device_random_drafter(kind: str, cfg, seed: int = 0, **kw):
    """:func:`jspec.drafters.random_drafter`, its initialisation compiled as one program
    (run eagerly, every initialiser op would compile on its own)."""
    import jax

    from jspec.drafters import Drafter, random_drafter

    box = {}

    def init(key):
        d = random_drafter(kind, cfg, key, **kw)
        box["module"] = d.module
        return d.params

    params = jax.jit(init)(jax.random.key(seed))
    return Drafter(box["module"], params)


def make_target(plan: Plan, seed: int = 0):
    """``(cfg, target)`` with random device weights in the layout the decoders run (the
    checkpoint-layout copy is dropped once packed, where the library packs)."""
    import jax

    from jspec.target import Target

    cfg = plan.target_config()
    target = Target(cfg, device_random_params(cfg, seed))
    packed = getattr(target, "serving_params", None)
    if packed is not None:
        target = Target(cfg, packed)
    jax.block_until_ready(target.params)
    return cfg, target


def weight_bytes(cfg, params) -> int:
    """Bytes of weights one decode step reads: every parameter except the input embedding
    (only B rows of it are read), unless it doubles as the (tied) LM head."""
    import jax
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if not cfg.tie_word_embeddings:
        total -= cfg.vocab_size * cfg.hidden_size * jax.tree.leaves(params)[0].dtype.itemsize
    return int(total)


def kv_bytes(cfg, batch: int, positions: int) -> int:
    import jax.numpy as jnp
    return int(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
               * batch * positions)


def binary_parents(n: int):
    import numpy as np
    return np.concatenate([[-1], np.arange(n - 1) // 2]).astype(np.int32)


def compile_all(jobs: dict, log=print) -> dict:
    """``{name: (fn, args, donate)}`` -> ``{name: (compiled, seconds)}``: lowered one by one
    (tracing holds the GIL), compiled in parallel threads (XLA releases it)."""
    import jax
    lowered, t_lower = {}, {}
    for name, (fn, args, donate) in jobs.items():
        t0 = time.perf_counter()
        lowered[name] = jax.jit(fn, donate_argnums=donate).lower(*args)
        t_lower[name] = time.perf_counter() - t0

    def comp(name):
        t0 = time.perf_counter()
        c = lowered[name].compile()
        return name, c, time.perf_counter() - t0 + t_lower[name]

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max(1, min(8, len(jobs)))) as ex:
        out = {n: (c, s) for n, c, s in ex.map(comp, list(jobs))}
    log(f"  compiled {len(jobs)} programs in {time.perf_counter() - t0:.1f}s "
        f"(+{sum(t_lower.values()):.1f}s lowering)")
    return out


def time_round_robin(variants: dict, repeats: int, warmup: int = 2) -> dict:
    """``variants``: name -> zero-argument callable that runs once and blocks. Returns
    name -> median seconds; the variants alternate call by call so load hits them alike."""
    import statistics
    times = {n: [] for n in variants}
    for i in range(warmup + repeats):
        for n, call in variants.items():
            t0 = time.perf_counter()
            call()
            if i >= warmup:
                times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


class VerifyBench:
    """The driver's verify forward (``SpecDecoder.verify``: target forward over a tree with
    its mask, logits, features) for given (batch, N), on a random cache of ``context``
    committed positions; the cache is donated and threaded back as the decode loop does."""

    def __init__(self, plan: Plan, cfg, target, seed: int = 0):
        from jspec.bench.anatomy import abstract_drafter
        self.plan, self.cfg, self.target, self.seed = plan, cfg, target, seed
        self.modes = {}
        # verify() reads only the drafter's feature layout (EAGLE-1: the final hidden state,
        # no aux layers), so abstract drafter params do.
        self.drafter = abstract_drafter("eagle1", cfg)

    def job(self, batch: int, N: int):
        import jax
        import numpy as np

        from jspec import kernels
        from jspec.bench import forward
        from jspec.sampling import SamplingConfig
        from jspec.spec_config import SpecConfig
        from jspec.spec_decode import SpecDecoder
        from jspec.tree.build import build_tree

        cfg, plan = self.cfg, self.plan
        cache = jax.jit(forward.make_cache, static_argnums=(0, 1, 2, 3, 4, 5))(
            cfg, batch, plan.context, N, plan.page_size, self.seed)
        mode = kernels.resolve("auto", cfg, page_size=plan.page_size, num_nodes=N, batch=batch,
                               max_pages=cache.page_table.shape[1], num_pages=cache.num_pages)
        self.modes[f"b{batch} N{N}"] = mode
        # verify() uses none of the tree knobs: a valid (5, 4, 8) stands in for them.
        dec = SpecDecoder(cfg, self.drafter.module, SpecConfig(5, 4, 8), SamplingConfig(0.0), 1,
                          plan.page_size, cache.num_pages, 0.0, None, mode)
        depth = max(1, int(np.ceil(np.log2(N + 1))))
        rng = np.random.default_rng(self.seed + N)
        tokens = rng.integers(0, cfg.vocab_size, (batch, N)).astype(np.int32)
        parents = np.broadcast_to(binary_parents(N), (batch, N))
        tree = jax.jit(build_tree, static_argnums=2)(tokens, parents, depth)
        fn = lambda p, c, t: dec.verify(p, c, t)
        return fn, (self.target.params, cache, tree), (1,)

    def runner(self, compiled, args):
        import jax
        state = {"cache": args[1]}
        params, tree = args[0], args[2]

        def call():
            logits, feats, state["cache"] = compiled(params, state["cache"], tree)
            jax.block_until_ready((logits, state["cache"]))
        return call


# ====================================================================== sections
def sec_copy(plan: Plan, ctx: dict) -> dict:
    from jspec.bench.kernels import copy_bandwidth
    gbps = copy_bandwidth(plan.copy_bytes)
    return {"GB/s": gbps, "buffer bytes": plan.copy_bytes,
            "method": "median time of jit(x + 1) over a float32 buffer; read + write bytes"}


def sec_plain_decode(plan: Plan, ctx: dict) -> dict:
    from jspec.bench.kernels import copy_bandwidth
    cfg, target = make_target(plan)
    vb = VerifyBench(plan, cfg, target)
    jobs = {B: vb.job(B, 1) for B in plan.batches}
    comp = compile_all(jobs)
    med = time_round_robin({B: vb.runner(comp[B][0], jobs[B][1]) for B in jobs}, plan.repeats)
    copy = ctx.get("copy GB/s") or copy_bandwidth(plan.copy_bytes)
    wbytes = weight_bytes(cfg, target.params)
    rows = []
    for B in plan.batches:
        nbytes = wbytes + kv_bytes(cfg, B, plan.context + 1)
        ms = 1e3 * med[B]
        floor = 1e3 * nbytes / (copy * 1e9)
        rows.append({"batch": B, "context": plan.context, "ms/step": ms,
                     "GB/s": nbytes / med[B] / 1e9, "floor ms": floor, "floor/ms": floor / ms,
                     "tokens/s": B / med[B], "MB read": nbytes / 1e6,
                     "compile s": comp[B][1], "kernels": vb.modes[f"b{B} N1"]})
    return {"rows": rows, "copy GB/s": copy, "weight bytes": wbytes,
            "config": plan.config, "dtype": plan.dtype,
            "what": "SpecDecoder.verify on a 1-node tree: 1-token target forward + logits "
                    "(+ features) against the cache; bytes = weights (no input embedding) + "
                    "KV of context + 1 positions"}


def sec_verify(plan: Plan, ctx: dict) -> dict:
    cfg, target = make_target(plan)
    vb = VerifyBench(plan, cfg, target)
    jobs = {N: vb.job(1, N) for N in plan.nodes}
    comp = compile_all(jobs)
    med = time_round_robin({N: vb.runner(comp[N][0], jobs[N][1]) for N in jobs}, plan.repeats)
    t1 = med[plan.nodes[0]]
    rows = [{"N": N, "ms": 1e3 * med[N], "t_V/t_1": med[N] / t1, "compile s": comp[N][1],
             "kernels": vb.modes[f"b1 N{N}"]} for N in plan.nodes]
    return {"rows": rows, "t_1 ms": 1e3 * t1, "context": plan.context, "batch": 1,
            "tree": "binary (parent of i = (i - 1) // 2), positions context + depth",
            "t_V/t_1": {str(r["N"]): r["t_V/t_1"] for r in rows}}


def sec_draft(plan: Plan, ctx: dict) -> dict:
    from jspec.bench.spec import micro_costs
    from jspec.spec_config import SpecConfig

    cfg, target = make_target(plan)
    d = device_random_drafter("eagle3", cfg, 0, vocab_size=plan.draft_vocab)
    spec = SpecConfig(*plan.spec)
    t0 = time.perf_counter()
    costs = micro_costs(target, plan.context, plan.repeats, plan.page_size, specs=[spec],
                        drafter=d)
    sp = costs["specs"][",".join(map(str, plan.spec))]
    return {"c": sp["c"], "draft step ms": sp["draft step ms"], "t_1 ms": costs["t_1 ms"],
            "t_V ms": sp["t_V ms"], "t_V/t_1": sp["t_V/t_1"], "drafter": costs["drafter"],
            "draft vocab": costs["draft vocab"], "spec": list(plan.spec),
            "K": plan.spec[1], "compile s": costs["compile s"],
            "micro s": time.perf_counter() - t0,
            "what": "jspec.bench.spec.micro_costs: one tree-loop step of the EAGLE-3 drafter "
                    f"({plan.spec[1]} frontier nodes, {plan.draft_vocab}-way head, top-K) over "
                    "t_1 (a 1-token target forward + logits), timed round-robin"}


class _ModeRecorder:
    """Records what ``generate`` resolves ``kernels`` to (wraps its resolver)."""

    def __enter__(self):
        gen = sys.modules["jspec.generate"]
        self.gen, self.orig, self.seen = gen, getattr(gen, "resolve_kernels", None), []
        if self.orig is not None:
            def spy(mode, *a, **kw):
                out = self.orig(mode, *a, **kw)
                self.seen.append(out)
                return out
            gen.resolve_kernels = spy
        return self

    def __exit__(self, *exc):
        if self.orig is not None:
            self.gen.resolve_kernels = self.orig


def sec_e2e(plan: Plan, ctx: dict) -> dict:
    import jspec
    import jspec.generate  # noqa: F401  (the module the recorder wraps)
    import numpy as np

    from jspec.bench.plain import make_prompts
    from jspec.bench.spec import _interleaved
    from jspec.spec_config import SpecConfig

    cfg, target = make_target(plan)
    drafter = device_random_drafter("eagle3", cfg, 1, vocab_size=plan.draft_vocab)
    spec = SpecConfig(*plan.spec)
    prompts = make_prompts(cfg, 1, plan.context, 7).tolist()
    new = plan.new_tokens

    def gen(**kw):
        return lambda: jspec.generate(target, prompts, max_new_tokens=new, stop_ids=[], **kw)

    calls = [gen()] + [gen(drafter=drafter, spec=spec, forced_accept=float(E)) for E in plan.accepts]
    with _ModeRecorder() as rec:
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(len(calls)) as ex:     # compile the programs concurrently
            firsts = [r.wall_s for r in ex.map(lambda c: c(), calls)]
        compile_wall = time.perf_counter() - t0
        timed = _interleaved(calls, plan.e2e_repeats)
    plain_s = timed[0][1]
    rows = [{"run": "plain", "E": 1, "tokens/s": new / plain_s, "ms/token": 1e3 * plain_s / new,
             "speedup": 1.0, "accept len": 1.0, "first s": firsts[0]}]
    for E, first, (_, med, res) in zip(plan.accepts, firsts[1:], timed[1:]):
        rows.append({"run": "eagle3 forced", "E": E, "tokens/s": new / med,
                     "ms/token": 1e3 * med / new, "speedup": plain_s / med,
                     "accept len": float(np.mean([s["mean_accept_len"] for s in res.stats])),
                     "first s": first})
    return {"rows": rows, "context": plan.context, "new tokens": new, "batch": 1,
            "spec": list(plan.spec), "draft vocab": plan.draft_vocab,
            "compile wall s (concurrent)": compile_wall, "kernels": sorted(set(rec.seen)),
            "what": "warm jspec.generate wall time (prefill included), median of "
                    f"{plan.e2e_repeats} round-robin calls; forced_accept=E output is not the "
                    "target's"}


def sec_kernels(plan: Plan, ctx: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jspec import kernels
    from jspec.bench.kernels import inputs
    from jspec.tree.build import build_tree
    from pallas_kernels.tree_attention import tree_attention, tree_attention_ref
    from pallas_kernels.verify_walk import (greedy_walk_ref, sample_walk_ref, verify_walk_greedy,
                                            verify_walk_sample)

    backend = jax.default_backend()
    compiled = backend in ("gpu", "tpu")
    if compiled:
        attn_kw, walk_impl, shape = {}, "auto", dict(H=32, KVH=8, D=128)
        how = f"compiled for {backend}"
    else:   # no compiled Pallas here: exercise the same checks through interpret mode
        attn_kw, walk_impl, shape = {"backend": "gpu", "interpret": True}, "gpu_interpret", \
            dict(H=4, KVH=2, D=16)
        how = f"Pallas interpret mode on {backend} (no compiled kernels on this backend)"
    rows = []
    B, prefix = 2, plan.context
    run_k = jax.jit(lambda *a: tree_attention(*a, **attn_kw))
    run_r = jax.jit(tree_attention_ref)
    for N in plan.kernel_nodes:
        args, _ = inputs(B, prefix, N, **shape, page=plan.page_size, dtype=jnp.bfloat16)
        t0 = time.perf_counter()
        got = jax.block_until_ready(run_k(*args))
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - run_r(*args).astype(jnp.float32))))
        rows.append({"check": f"tree attention N={N}", "max abs err": err, "ok": err <= 2e-2,
                     "s": time.perf_counter() - t0})
    # Verify walks: random trees whose drafts match the target half the time.
    V, N, S = plan.walk_vocab, 8, 3
    rng = np.random.default_rng(0)
    parents = np.broadcast_to(binary_parents(N), (B, N))
    toks = rng.integers(0, V, (B, N)).astype(np.int32)
    tree = build_tree(jnp.asarray(toks), jnp.asarray(parents), S)
    amax = np.where(rng.random((B, N)) < 0.5, np.roll(toks, -1, 1), rng.integers(0, V, (B, N)))
    amax = jnp.asarray(amax.astype(np.int32))
    targs = (tree.tokens, tree.first_child, tree.next_sibling)
    t0 = time.perf_counter()
    got = verify_walk_greedy(*targs, amax, max_depth=S, impl=walk_impl)
    want = greedy_walk_ref(*targs, amax, max_depth=S)
    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, want))
    rows.append({"check": f"greedy walk N={N}", "ok": same, "s": time.perf_counter() - t0})
    probs = jax.nn.softmax(3.0 * jax.random.normal(jax.random.key(1), (B, N, V)), -1)
    u_acc = jax.random.uniform(jax.random.key(2), (B, N))
    u_bon = jax.random.uniform(jax.random.key(3), (B,))
    t0 = time.perf_counter()
    got = verify_walk_sample(*targs, probs, u_acc, u_bon, max_depth=S, impl=walk_impl)
    want = sample_walk_ref(*targs, probs, u_acc, u_bon, max_depth=S)
    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, want))
    rows.append({"check": f"sample walk N={N} V={V}", "ok": same, "s": time.perf_counter() - t0})
    out = {"how": how, "backend": backend, "rows": rows}
    # What "auto" resolves to for the benchmark's shape (the probe compiles both kernels).
    cfg = plan.target_config()
    kernels._PROBED.clear()
    t0 = time.perf_counter()
    mode = kernels.resolve("auto", cfg, page_size=plan.page_size, num_nodes=8, max_depth=5,
                           batch=1, max_pages=-(-(plan.context + 64) // plan.page_size))
    out["auto"] = {"mode": mode, "probe s": time.perf_counter() - t0,
                   "probe error": next(iter(kernels._PROBED.values()), None)}
    rows.append({"check": f"auto -> {mode}", "ok": (mode == "pallas") == compiled,
                 "s": out["auto"]["probe s"]})
    if compiled:
        out["generate"] = _generate_identity()
        rows += [{"check": f"generate {k}: pallas == reference", "ok": v}
                 for k, v in out["generate"].items()]
    return out


def _generate_identity() -> dict:
    """generate(kernels="pallas") vs "reference" on the tiny model (fp32, greedy)."""
    import jax

    import jspec
    from jspec.bench.configs import random_config
    from jspec.bench.common import random_params
    from jspec.drafters import random_drafter
    from jspec.spec_config import SpecConfig
    from jspec.target import Target

    cfg = random_config("tiny")
    target = Target(cfg, random_params(cfg))
    prompts = [[1, 5, 9, 14, 3], [1, 7]]
    d = random_drafter("eagle1", cfg, jax.random.key(5))
    out = {}
    for name, kw in (("plain", {}), ("eagle1 (3,2,5)", {"drafter": d, "spec": SpecConfig(3, 2, 5)})):
        a = jspec.generate(target, prompts, max_new_tokens=16, stop_ids=[], kernels="pallas", **kw)
        b = jspec.generate(target, prompts, max_new_tokens=16, stop_ids=[], kernels="reference", **kw)
        out[name] = a.tokens == b.tokens
    return out


def sec_hf(plan: Plan, ctx: dict) -> dict:
    try:
        import torch
        import transformers
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return {"status": "skipped", "reason": f"torch/transformers not importable: {e}"}
    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "torch has no CUDA device"}
    import statistics

    from jspec.bench.common import _disable_eos
    from jspec.bench.plain import make_prompts

    cfg = plan.target_config()
    d = cfg.to_hf()
    d.pop("torch_dtype", None)
    d.pop("dtype", None)
    hf_cfg = transformers.LlamaConfig(**d)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    try:     # built in bf16 straight on the GPU (an fp32 build would take 32 GB first)
        torch.set_default_dtype(torch.bfloat16)
    except (TypeError, RuntimeError):   # a torch without bf16 defaults: fp32 build, then cast
        pass
    try:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model = model.to(torch.bfloat16).eval()
    _disable_eos(model)
    build_s = time.perf_counter() - t0
    new = plan.new_tokens
    ids = torch.from_numpy(make_prompts(cfg, 1, plan.context, 7).astype("int64")).cuda()
    gc = transformers.GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                       eos_token_id=None, pad_token_id=0, num_beams=1)

    def call():
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 generation_config=gc)
        torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + new
        return time.perf_counter() - t

    first = call()
    med = statistics.median([call() for _ in range(plan.e2e_repeats)])
    return {"tokens/s": new / med, "ms/token": 1e3 * med / new, "first s": first,
            "build s": build_s, "new tokens": new, "context": plan.context, "batch": 1,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "attn": getattr(model.config, "_attn_implementation", None),
            "device": torch.cuda.get_device_name(0),
            "what": "transformers greedy generate (prefill included), bf16, random weights"}


WORKERS = {"copy": sec_copy, "plain_decode": sec_plain_decode, "verify": sec_verify,
           "draft": sec_draft, "e2e": sec_e2e, "kernels": sec_kernels, "hf": sec_hf}


def run_worker(name: str, result_path: str, smoke: bool, ctx: dict) -> int:
    """One section in this process: its result (or error) as JSON at ``result_path``."""
    t0 = time.perf_counter()
    out: dict = {}
    try:
        if name != "hf":
            import jax
            # Random weights, caches and keys only need to be random: the "rbg" generator
            # compiles in a fraction of threefry's time (seconds each on a CPU).
            jax.config.update("jax_default_prng_impl", "rbg")
            out["device"] = device_info()
        data = WORKERS[name](Plan(smoke), ctx)
        out.update(data)
        out.setdefault("status", "ok")
    except Exception as e:  # noqa: BLE001 - recorded, the parent goes on
        out.update(status="error", error=f"{type(e).__name__}: {e}"[:4000],
                   traceback=traceback.format_exc()[-6000:])
    out["seconds"] = time.perf_counter() - t0
    with open(result_path, "w") as f:
        json.dump(out, f, indent=1, default=_json_default)
    return 0 if out["status"] != "error" else 1


# ====================================================================== pytest
_OUTCOME = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)


def run_pytest(plan: Plan, timeout: float, root: str) -> dict:
    files = SMOKE_TESTS if plan.smoke else KERNEL_TESTS
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "slow or not slow",
           *files]
    t0 = time.perf_counter()
    text, returncode, timed_out = _run_capped(cmd, timeout, root)
    outcomes = _OUTCOME.findall(text or "")
    counts = {}
    for _, o in outcomes:
        counts[o.lower()] = counts.get(o.lower(), 0) + 1
    failed = [t for t, o in outcomes if o in ("FAILED", "ERROR")]
    out = {"status": "timeout" if timed_out else ("ok" if returncode in (0, 5) and not failed
                                                  else "error"),
           "seconds": time.perf_counter() - t0, "command": " ".join(cmd), "returncode":
           returncode, "counts": counts, "failed": failed[:50],
           "ran": len(outcomes), "tail": (text or "")[-3000:],
           "what": "the kernel test files as they are: Pallas interpret mode + cross-lowering "
                   "(not the kernels compiled for the device; see the kernels section)"}
    if failed and not timed_out:
        out["error"] = f"{len(failed)} failed: {', '.join(failed[:5])}"
    if timed_out:
        out["error"] = f"timed out after {timeout:.0f}s with {len(outcomes)} tests done"
    return out


# ====================================================================== parent
def _json_default(o):
    try:
        import numpy as np
        if isinstance(o, (np.integer, np.floating, np.bool_)):
            return o.item()
    except ImportError:  # pragma: no cover
        pass
    return str(o)


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)      # the worker's own session: it and its children
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _run_capped(cmd, timeout: float, root: str) -> tuple[str, int, bool]:
    """Run ``cmd`` in its own session with stdout+stderr captured; past ``timeout`` seconds
    kill it and its children. Returns ``(output, returncode, timed_out)``."""
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        return proc.communicate(timeout=max(1.0, timeout))[0], proc.returncode, False
    except subprocess.TimeoutExpired:
        _kill(proc)
        return proc.communicate()[0], proc.returncode, True


def _launch(name: str, smoke: bool, ctx: dict, timeout: float, root: str, tmp: str) -> dict:
    path = os.path.join(tmp, f"{name}.json")
    cmd = [sys.executable, "-m", "jspec.bench", "device", "--worker", name, "--result", path,
           "--context-json", json.dumps(ctx)] + (["--smoke"] if smoke else [])
    t0 = time.perf_counter()
    log, returncode, timed_out = _run_capped(cmd, timeout, root)
    wall = time.perf_counter() - t0
    res = None
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
    if res is None:
        res = ({"status": "timeout", "error": f"killed after the {timeout:.0f}s cap"} if timed_out
               else {"status": "error", "error": f"worker exited with code {returncode} "
                                                 "and no result"})
    res["wall s"] = wall
    res["cap s"] = timeout
    res.setdefault("seconds", wall)
    if res["status"] != "ok":
        res["log tail"] = (log or "")[-3000:]
    return res


def _headline(name: str, r: dict) -> str:
    if r.get("status") != "ok":
        return (r.get("error") or r.get("reason") or "").splitlines()[0][:90] if (
            r.get("error") or r.get("reason")) else ""
    f = lambda x, d=2: f"{x:.{d}f}"
    try:
        if name == "copy":
            return f"{r['GB/s']:,.0f} GB/s"
        if name == "plain_decode":
            return "; ".join(f"b{x['batch']}: {f(x['ms/step'])} ms, {x['GB/s']:,.0f} GB/s, "
                             f"{x['floor/ms']:.0%} of floor" for x in r["rows"])
        if name == "verify":
            return ", ".join(f"N={x['N']}: {f(x['t_V/t_1'])}" for x in r["rows"]) + " (t_V/t_1)"
        if name == "draft":
            return f"c = {f(r['c'], 3)} ({f(r['draft step ms'], 3)} ms / t_1 {f(r['t_1 ms'], 3)} ms)"
        if name == "e2e":
            return ", ".join(f"E={x['E']}: {f(x['speedup'])}x" for x in r["rows"][1:]) + \
                f" (plain {r['rows'][0]['tokens/s']:.1f} tok/s)"
        if name == "kernels":
            ok = sum(bool(x.get("ok")) for x in r["rows"])
            return f"{ok}/{len(r['rows'])} checks ok ({r['how']}); auto -> {r['auto']['mode']}"
        if name == "hf":
            return f"{r['tokens/s']:.1f} tok/s ({r['attn']})"
        if name == "pytest":
            return ", ".join(f"{v} {k}" for k, v in sorted(r["counts"].items()))
    except (KeyError, TypeError, IndexError):
        return ""
    return ""


def render(payload: dict) -> str:
    from jspec.bench.common import format_table
    secs = payload["sections"]
    out = [f"device: {payload.get('device')}", "",
           format_table([{"section": n, "status": r.get("status"), "s": r.get("seconds"),
                          "wall s": r.get("wall s"), "result": _headline(n, r)}
                         for n, r in secs.items()],
                        ["section", "status", "s", "wall s", "result"])]
    detail = {"plain_decode": ["batch", "context", "ms/step", "GB/s", "floor ms", "floor/ms",
                               "tokens/s", "compile s", "kernels"],
              "verify": ["N", "ms", "t_V/t_1", "compile s", "kernels"],
              "e2e": ["run", "E", "tokens/s", "ms/token", "speedup", "ideal", "accept len",
                      "first s"],
              "kernels": ["check", "max abs err", "ok", "s"]}
    for n, cols in detail.items():
        r = secs.get(n, {})
        if r.get("status") == "ok" and r.get("rows"):
            out += ["", n, format_table(r["rows"], cols)]
    hf, e2e = secs.get("hf", {}), secs.get("e2e", {})
    if hf.get("status") == "ok" and e2e.get("status") == "ok":
        out += ["", f"jspec plain / transformers (batch 1, same shape): "
                    f"{e2e['rows'][0]['tokens/s'] / hf['tokens/s']:.2f}x"]
    return "\n".join(out)


def run_all(smoke: bool, budget: float, only=None, out_dir: str | None = None, log=print) -> dict:
    plan = Plan(smoke)
    out_dir = out_dir or os.environ.get("OUT") or "out"
    os.makedirs(out_dir, exist_ok=True)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    caps = SMOKE_CAPS if smoke else CAPS
    start = time.perf_counter()
    payload = {"benchmark": "device", "smoke": smoke, "budget s": budget,
               "command": "python -m jspec.bench device" + (" --smoke" if smoke else ""),
               "plan": {k: v for k, v in vars(plan).items()}, "sections": {}}
    ctx: dict = {}
    path = os.path.join(out_dir, RESULT_NAME)
    with tempfile.TemporaryDirectory(prefix="jspec_device_") as tmp:
        for name in SECTIONS:
            if only and name not in only:
                continue
            left = budget - (time.perf_counter() - start)
            if left < 10:
                payload["sections"][name] = {"status": "skipped", "seconds": 0.0,
                                             "reason": f"run budget of {budget:.0f}s spent"}
                continue
            timeout = min(caps[name], left)
            log(f"[{time.perf_counter() - start:6.1f}s] {name} (cap {timeout:.0f}s) ...")
            if name == "pytest":
                res = run_pytest(plan, timeout, root)
            else:
                res = _launch(name, smoke, ctx, timeout, root, tmp)
            payload["sections"][name] = res
            if res.get("device") and "device" not in payload:
                payload["device"] = res["device"]
            if name == "copy" and res.get("status") == "ok":
                ctx["copy GB/s"] = res["GB/s"]
            log(f"         {res.get('status')} in {res.get('seconds', 0):.1f}s  "
                f"{_headline(name, res)}")
            payload["total s"] = time.perf_counter() - start
            _write(path, payload)                   # after every section: a crash keeps the rest
    _add_ideal(payload)
    payload["total s"] = time.perf_counter() - start
    _write(path, payload)
    payload["path"] = path
    return payload


def _add_ideal(payload: dict) -> None:
    """e2e rows get the cost model's ideal speed-up when verify and draft ran."""
    from jspec.bench.spec import ideal_speedup
    s = payload["sections"]
    v, d, e = s.get("verify", {}), s.get("draft", {}), s.get("e2e", {})
    if not all(x.get("status") == "ok" for x in (v, d, e)):
        return
    N = e["spec"][2]
    ratio = v["t_V/t_1"].get(str(N))
    if ratio is None:
        return
    steps = e["spec"][0]
    for row in e["rows"][1:]:
        row["ideal"] = ideal_speedup(float(row["E"]), ratio, d["c"], steps)
        row["measured/ideal"] = row["speedup"] / row["ideal"]
    e["ideal model"] = (f"E / (t_V({N})/t_1 + S c), S = {steps} drafter forwards per verify "
                        "(jspec.bench.spec.ideal_speedup)")


def _write(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=_json_default)
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jspec.bench device",
                                description="the prepared one-accelerator benchmark; writes "
                                            f"$OUT/{RESULT_NAME} (OUT defaults to ./out)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check, < ~60 s)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds after which no section starts (default {BUDGET}; "
                        f"--smoke {SMOKE_BUDGET})")
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--context-json", default="{}", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return run_worker(a.worker, a.result, a.smoke, json.loads(a.context_json))
    try:   # this process only orchestrates: never let it claim the accelerator's memory
        import jax
        jax.config.update("jax_platforms", "cpu")
    except Exception:  # noqa: BLE001 - a backend already up is fine: it is never used here
        pass
    budget = a.budget if a.budget is not None else (SMOKE_BUDGET if a.smoke else BUDGET)
    payload = run_all(a.smoke, budget, a.only, log=lambda m: print(m, flush=True))
    print()
    print(render(payload))
    print(f"\nwrote {payload['path']} ({payload['total s']:.0f}s)")
    return payload


if __name__ == "__main__":
    main()
