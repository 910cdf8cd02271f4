"""The sections of ``python -m jspec.bench device``, one function each (what each measures:
:mod:`benchmarks.device`).

A section runs in its own worker process (:func:`benchmarks.device.run_worker`) and returns
its numbers as a JSON-ready dict; ``pytest`` runs in the parent instead
(:func:`benchmarks.device.run_pytest`). JAX is imported inside the functions, as in
:mod:`benchmarks.device_setup`.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import time

from benchmarks.device_setup import (Plan, VerifyBench, binary_parents, compile_all,
                                     device_random_drafter, kv_bytes, make_target, weight_bytes)
from jspec.timing import round_robin


def sec_copy(plan: Plan, ctx: dict) -> dict:
    from benchmarks.kernels import copy_bandwidth
    gbps = copy_bandwidth(plan.copy_bytes)
    return {"GB/s": gbps, "buffer bytes": plan.copy_bytes,
            "method": "median time of jit(x + 1) over a float32 buffer; read + write bytes"}


def sec_plain_decode(plan: Plan, ctx: dict) -> dict:
    from benchmarks.kernels import copy_bandwidth
    cfg, target = make_target(plan)
    vb = VerifyBench(plan, cfg, target)
    jobs = {B: vb.job(B, 1) for B in plan.batches}
    comp = compile_all(jobs)
    med = {B: t.median for B, t in round_robin(
        {B: vb.runner(comp[B][0], jobs[B][1]) for B in jobs}, plan.repeats, warmup=2).items()}
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
    med = {N: t.median for N, t in round_robin(
        {N: vb.runner(comp[N][0], jobs[N][1]) for N in jobs}, plan.repeats, warmup=2).items()}
    t1 = med[plan.nodes[0]]
    rows = [{"N": N, "ms": 1e3 * med[N], "t_V/t_1": med[N] / t1, "compile s": comp[N][1],
             "kernels": vb.modes[f"b1 N{N}"]} for N in plan.nodes]
    return {"rows": rows, "t_1 ms": 1e3 * t1, "context": plan.context, "batch": 1,
            "tree": "binary (parent of i = (i - 1) // 2), positions context + depth",
            "t_V/t_1": {str(r["N"]): r["t_V/t_1"] for r in rows}}


def sec_draft(plan: Plan, ctx: dict) -> dict:
    from jspec.bench.spec_simulate import micro_costs
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
            "what": "jspec.bench.spec_simulate.micro_costs: one tree-loop step of the EAGLE-3 drafter "
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
    from jspec.timing import wall_s
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
        timed = round_robin(calls, plan.e2e_repeats, seconds=wall_s)
    plain_s = timed[0].median
    rows = [{"run": "plain", "E": 1, "tokens/s": new / plain_s, "ms/token": 1e3 * plain_s / new,
             "speedup": 1.0, "accept len": 1.0, "first s": firsts[0]}]
    for E, first, t in zip(plan.accepts, firsts[1:], timed[1:]):
        med, res = t.median, t.result
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
    from benchmarks.kernels import inputs
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
    kernels.probes(forget=True)
    t0 = time.perf_counter()
    mode = kernels.resolve("auto", cfg, page_size=plan.page_size, num_nodes=8, max_depth=5,
                           batch=1, max_pages=-(-(plan.context + 64) // plan.page_size))
    out["auto"] = {"mode": mode, "probe s": time.perf_counter() - t0,
                   "probe error": next(iter(kernels.probes().values()), None)}
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

    from jspec.bench.common import disable_eos
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
    disable_eos(model)
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


def sec_quant(plan: Plan, ctx: dict) -> dict:
    """Plain decode steps (a 1-node verify) of the target in bf16 and quantized (int8
    weight-only, fp8, W8A8), every (mode, batch) timed round-robin."""
    import jax

    from jspec.checkpoint import quantize_target
    cfg, target = make_target(plan)
    jobs, runners, nbytes = {}, {}, {}
    for mode in ("bf16", "int8", "fp8", "w8a8"):
        t = target if mode == "bf16" else quantize_target(target, mode)
        nbytes[mode] = sum(x.nbytes for x in jax.tree.leaves(t.params))
        vb = VerifyBench(plan, cfg, t)
        for B in plan.batches:
            jobs[mode, B] = vb.job(B, 1)
            runners[mode, B] = vb
    comp = compile_all({f"{m} b{B}": j for (m, B), j in jobs.items()})
    timed = round_robin({k: runners[k].runner(comp[f"{k[0]} b{k[1]}"][0], jobs[k][1])
                         for k in jobs}, plan.repeats, warmup=2)
    rows = [{"mode": m, "batch": B, "ms/step": 1e3 * t.median, "tokens/s": B / t.median,
             "weights MB": nbytes[m] / 1e6,
             "vs bf16": timed["bf16", B].median / t.median} for (m, B), t in timed.items()]
    return {"rows": rows, "config": plan.config,
            "what": "SpecDecoder.verify on a 1-node tree per quantization mode (jspec.quant)"}


WORKERS = {"copy": sec_copy, "plain_decode": sec_plain_decode, "verify": sec_verify,
           "draft": sec_draft, "e2e": sec_e2e, "kernels": sec_kernels, "hf": sec_hf,
           "quant": sec_quant}
