"""``python -m jspec.bench anatomy``: what the compiled decode programs are made of (nothing timed).

For the plain decode step and for one speculative iteration, split into its phases
(draft, verify, finish) and as a whole, this compiles each program from **abstract
inputs** (``jax.ShapeDtypeStruct`` / ``jax.eval_shape``: an 8B-shaped model needs no
weights and no memory) and reads the compiled executable:

- ``kernels``: kernels in the optimized HLO module (the counting rule of
  :mod:`benchmarks.hlo`); ``per_layer``: that count divided by the target's number of
  layers; ``layer_body``: the kernels of a scanned layer stack's body (while loops that run
  ``num_layers`` times), i.e. what one target layer compiles to (0 when the stack is
  unrolled: read ``per_layer`` there);
- ``bytes_MB`` / ``GFLOP``: ``compiled.cost_analysis()`` ("bytes accessed", "flops");
  ``bytes_x`` / ``flops_x``: the same over the plain step's;
  **XLA's cost analysis counts a while body once**, whatever its trip count: once the layer
  stack is a ``lax.scan``, these are one layer's cost plus everything outside the loop, and
  are not comparable with an unrolled stack's;
- ``io_MB`` / ``io_x``: HBM bytes every kernel reads and writes, weighted by loop trip
  counts (:func:`benchmarks.hlo_bytes.kernel_bytes`: slices charged as slices, in-place KV writes
  as their updates, a Pallas kernel its operands with a KV pool as one layer of it), and the
  same over the plain step's: comparable across scanned and unrolled stacks and across the
  reference and the kernels, where ``bytes_MB`` is not. ``io_goal_x``: that over one plain
  step plus one read of the drafter's parameters (``drafter_bytes``), issue 9's measure of
  what an iteration costs beyond the target;
- ``GFLOP_w`` / ``flops_w_x``: flops of the ``dot`` instructions read from the HLO (fused or
  not), weighted by the known trip counts of their enclosing loops (so a scanned layer stack
  counts L times; the draft scan S-1 times), and the same over the plain step's: comparable
  across unrolled and scanned programs. (Elementwise flops are left out.)
- ``temp_MB`` / ``arg_MB`` / ``out_MB`` / ``alias_MB``: ``compiled.memory_analysis()``
  (peak temporaries, arguments, outputs, outputs aliased to donated arguments);
- ``compile_s``: seconds of ``jit(...).lower(...).compile()`` (lowering included);
- ``pool_copies``: ``copy`` instructions, at top level or inside fusions, whose result is the
  target's or the drafter's whole KV pool (``k_pages`` / ``v_pages``), also seen through the
  reshapes XLA uses (``[L, KVH, P*page_size, D]`` etc., see :func:`benchmarks.hlo.pool_key`).
  Zero means no program copies a whole pool.
- ``pool_kernels``: kernels (same rule) with a pool-shaped result (or tuple element): the
  per-layer KV writes (in place when the pool is donated or loop-carried) and any copies.
  XLA's cost model charges such a scatter / dynamic-update-slice its whole operand, so
  ``bytes_MB`` is dominated by them at long contexts even when the write is in place.

**How the programs are built.** As :func:`jspec.generate.generate` builds them: pages come
from :func:`jspec.admission.admit` for ``B`` prompts of ``C`` tokens (the context) that
ask for ``--max-new`` tokens plus the speculative overshoot; the decode states are the
abstract outputs of the decoders' own functions (``PlainDecoder.run`` for the loop carry,
``SpecDecoder.initial_state``), so every shape is exactly the driver's. Arguments that the
decode loop carries (and so updates in place) are donated, as a ``while`` carry would be:
the plain step's state, verify's target cache, finish's and the whole iteration's state.
The draft phase's state is *not* donated: the iteration still needs it after the draft
(the extend writes the drafter's committed KV), which is precisely what may force a copy.
The finish program receives the verified cache inside its state (``s.cache``, which
``finish_phase`` does not otherwise read), so donating the state aliases the right buffer.
``kernels="reference"`` unless ``--kernels pallas`` (the TPU/GPU kernels, e.g. with ``--aot``);
greedy unless ``--temperature`` > 0.

All target parameter shapes come from :func:`abstract_target_params`, drafter ones from
:func:`abstract_drafter`: change those two functions when the parameter layout changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.hlo import count_kernels, dot_flops, pool_key
from benchmarks.hlo_bytes import kernel_bytes

from jspec import llama, serving_layout
from jspec.bench import common, configs
from jspec.bench.registry import Command, run_module
from jspec.config import LlamaConfig
from jspec.decode import PlainDecoder
from jspec.drafters import Drafter, random_drafter
from jspec.admission import admit
from jspec.platform import building_for
from jspec.sampling import SamplingConfig
from jspec.spec_config import SpecConfig
from jspec.spec_decode import SpecDecoder, tree_shape

COLUMNS = ["program", "kernels", "per_layer", "layer_body", "bytes_MB", "bytes_x", "io_MB", "io_x",
           "io_goal_x", "GFLOP",
           "flops_x", "GFLOP_w", "flops_w_x",
           "temp_MB", "arg_MB", "out_MB", "alias_MB", "compile_s", "pool_copies", "pool_kernels"]


# ------------------------------------------------------------------ abstract params
def abstract_target_params(cfg: LlamaConfig, stacked: bool = True, quantize: str | None = None):
    """Shape/dtype tree of the target's parameters in the layout the decoders run (packed
    for serving, as :attr:`jspec.target.Target.serving_params`), without allocating them.
    ``stacked`` (default): the scanned layer stack TPUs and GPUs run; False: the per-layer
    weights CPUs run (see :func:`jspec.serving_layout.default_stacked`). ``quantize``: a
    :data:`jspec.quant.MODES` name (``int8``, ``w8a8``, ``fp8``): the layer weights as
    :func:`jspec.quant.quantize_packed` makes them (int8 / float8 values and per-channel
    scales; embedding, norms and LM head stay float); None: float. Every target parameter
    path of this module goes through here."""
    params = jax.eval_shape(lambda k: serving_layout.pack_params(cfg, llama.init_params(cfg, k),
                                                                 stacked), jax.random.key(0))
    if quantize is None:
        return params
    from jspec.quant import quantize_packed
    return jax.eval_shape(lambda p: quantize_packed(cfg, p, quantize), params)


def add_quantize_arg(s) -> None:
    """``--quantize {int8,w8a8,fp8}`` (checked by argparse, before anything compiles)."""
    from jspec.quant import MODES
    s.add_argument("--quantize", default=None, choices=MODES,
                   help="plan a quantized target (jspec.quant): int8 weight-only, w8a8 (int8 "
                        "weights and activations) or fp8 (float8 e4m3 weights); the layer "
                        "weights become int8/fp8 values with per-channel scales, the "
                        "embedding, norms and LM head stay in the config's dtype "
                        "(default: none, the float target)")


def abstract_drafter(kind: str, cfg: LlamaConfig, **kw) -> Drafter:
    """A :class:`~jspec.drafters.Drafter` whose params are shape/dtype structs."""
    box = {}

    def init(k):
        d = random_drafter(kind, cfg, k, **kw)
        box["module"] = d.module
        return d.params

    params = jax.eval_shape(init, jax.random.key(0))
    return Drafter(box["module"], params)


def param_bytes(tree) -> int:
    """Bytes of a (possibly quantized) parameter tree: every leaf, values and scales alike."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


# ------------------------------------------------------------------ compile and read
def _cost(compiled) -> dict:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):           # older jax: one dict per computation
        ca = ca[0] if ca else {}
    ca = ca or {}
    return {"bytes": float(ca.get("bytes accessed", float("nan"))),
            "flops": float(ca.get("flops", float("nan")))}


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    get = lambda k: float(getattr(m, k, float("nan"))) if m is not None else float("nan")
    return {"temp_bytes": get("temp_size_in_bytes"), "arg_bytes": get("argument_size_in_bytes"),
            "out_bytes": get("output_size_in_bytes"), "alias_bytes": get("alias_size_in_bytes")}


def analyse(name: str, fn: Callable, args: tuple, donate=(), pool_shapes=(),
            num_layers: int = 1, compiler_options: dict | None = None, device=None,
            pool_layers: dict | None = None) -> dict:
    """Compile ``fn(*args)`` (abstract args) and read its anatomy into one table row.
    ``compiler_options``: XLA debug options for this compile only (they override
    ``XLA_FLAGS``; see :data:`DEFAULT_CPU_OPTIONS`). ``device``: compile for this (abstract)
    device instead of the default one (see :func:`aot_device`). ``pool_layers``: the KV
    pools' views and layer counts, for :func:`benchmarks.hlo_bytes.kernel_bytes`."""
    if device is not None:
        sh = jax.sharding.SingleDeviceSharding(device)
        args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
                            if isinstance(x, jax.ShapeDtypeStruct) else x, args)
    t0 = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=tuple(donate)).lower(*args).compile(compiler_options)
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    k = count_kernels(text, pool_shapes, num_layers)
    df = dot_flops(text)
    io = kernel_bytes(text, pool_layers)
    row = {"program": name, **k, "per_layer": k["kernels"] / num_layers, **_cost(compiled),
           **_memory(compiled), "compile_s": compile_s, "dot_flops_once": df["once"],
           "dot_flops_w": df["weighted"], "GFLOP_w": df["weighted"] / 1e9,
           "io_bytes": io["weighted"], "io_MB": io["weighted"] / 1e6}
    mb = lambda b: b / 1e6
    row.update(bytes_MB=mb(row["bytes"]), GFLOP=row["flops"] / 1e9, temp_MB=mb(row["temp_bytes"]),
               arg_MB=mb(row["arg_bytes"]), out_MB=mb(row["out_bytes"]),
               alias_MB=mb(row["alias_bytes"]))
    return row


# XLA:CPU's fusion emitters are the default, and what the counts here are meant to describe.
# The test suite turns them off process-wide to compile faster (tests/conftest.py); under that
# flag XLA:CPU fuses differently, so the anatomy test compiles with these options to read the
# programs users get.
DEFAULT_CPU_OPTIONS = {"xla_cpu_use_fusion_emitters": True}


# Deviceless compiles (DESIGN.md section 6): a named target's abstract device (jspec.aot);
# a topology name stands for its target (one chip of it).
AOT_TARGETS = ("v5e", "v6e", "v5p", "h200")


def aot_target(name: str) -> str:
    from jspec import aot as targets          # (``aot`` is anatomy()'s argument)
    name = next((t.name for t in targets.TARGETS.values() if name == t.topology), name)
    if name not in AOT_TARGETS:
        raise ValueError(f"--topology {name!r}: choose one of {sorted(AOT_TARGETS)}")
    return name


def aot_device(name: str):
    """The first device of a target's topology, for compiling without one (TPU: ``libtpu``,
    the ``tpu-aot`` extra; ``h200``: the ``gpu-aot`` extra)."""
    from jspec import aot as targets
    try:
        return targets.device(aot_target(name))
    except targets.CompilerMissing as e:
        raise SystemExit(f"--topology {e}") from None


# ------------------------------------------------------------------ programs
def parse_spec(text: str | None) -> SpecConfig | None:
    if text is None:
        return None
    try:
        S, K, N = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--spec wants S,K,N (e.g. 5,4,8 or 4,1,5), got {text!r}") from None
    return SpecConfig(S, K, N)


@dataclasses.dataclass
class Setup:
    cfg: LlamaConfig
    batch: int
    context: int
    max_new: int = 128
    page_size: int = 16
    temperature: float = 0.0
    kernels: str = "reference"

    def inputs(self, overshoot: int, shards: int = 1):
        """Abstract (prompt, lens, page_table, stop_ids, limits, key) as generate() would
        admit ``batch`` prompts of ``context`` tokens (over ``shards`` data shards: then
        ``num_pages`` is one shard's pool)."""
        B = self.batch
        lens = np.full((B,), self.context, np.int32)
        limits = np.full((B,), self.max_new, np.int32)
        T, cap_new, num_pages, table = admit(lens, limits, overshoot, 16, None, self.page_size,
                                              None, shards)
        sds = jax.ShapeDtypeStruct
        i32 = jnp.int32
        key = jax.eval_shape(lambda: jax.random.key(0))
        return dict(prompt=sds((B, T), i32), lens=sds((B,), i32), table=sds(table.shape, i32),
                    stop=sds((B, 8), i32), limits=sds((B,), i32), key=key, cap_new=cap_new,
                    num_pages=num_pages)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature)


def plain_program(setup: Setup, params) -> tuple[Callable, tuple, tuple, Any]:
    """``(fn, abstract args, donated argnums, state)`` for one plain decode step."""
    c = setup.cfg
    a = setup.inputs(0)
    dec = PlainDecoder(c, setup.sampling, a["cap_new"], setup.page_size, a["num_pages"], None,
                       setup.kernels)
    state = jax.eval_shape(lambda *x: dec.run(*x), params, a["prompt"], a["lens"], a["table"],
                           a["stop"], a["limits"], a["key"])
    fn = lambda p, s, stop, mx: dec.step(p, s, stop, mx)
    return fn, (params, state, a["stop"], a["limits"]), (1,), state


def spec_programs(setup: Setup, params, drafter: Drafter, spec: SpecConfig | None):
    """``({name: (fn, abstract args, donated argnums)}, state, spec)`` for draft, verify,
    finish and the whole iteration, built the way ``generate()`` builds its driver."""
    c = setup.cfg
    spec = spec if spec is not None else drafter.default_spec
    drafter.module.validate(c, None)
    S, N = tree_shape(drafter.module, spec)
    overshoot = max(N, drafter.module.cache_slots(spec)) + S + 1
    a = setup.inputs(overshoot)
    dec = SpecDecoder(c, drafter.module, spec, setup.sampling, a["cap_new"], setup.page_size,
                      a["num_pages"], 0.0, None, setup.kernels)
    dp = drafter.params
    s = jax.eval_shape(lambda *x: dec.initial_state(*x), params, dp, a["prompt"], a["lens"],
                       a["table"], a["table"], a["stop"], a["limits"], a["key"])
    stop, mx = a["stop"], a["limits"]
    tree = jax.eval_shape(lambda p, d, st: dec.draft_phase(p, d, st), params, dp, s)
    logits, feats, _ = jax.eval_shape(lambda p, cache, t: dec.verify(p, cache, t),
                                      params, s.cache, tree)

    def finish(p, d, st, t, lg, ft, stp, m):
        return dec.finish_phase(p, d, st, t, lg, ft, st.cache, stp, m)

    progs = {
        "draft": (lambda p, d, st: dec.draft_phase(p, d, st), (params, dp, s), ()),
        "verify": (lambda p, cache, t: dec.verify(p, cache, t), (params, s.cache, tree), (1,)),
        "finish": (finish, (params, dp, s, tree, logits, feats, stop, mx), (2,)),
        "iteration": (lambda p, d, st, stp, m: dec.iterate(p, d, st, stp, m),
                      (params, dp, s, stop, mx), (2,)),
    }
    return progs, s, spec


def pool_shapes_of(state) -> dict[str, Any]:
    """The KV pools of a speculative state: ``{"target": k_pages, "draft": k_pages}``
    (abstract; the plain step's pool has no speculative overshoot, so it is smaller)."""
    out = {"target": state.cache.k_pages}
    dcache = getattr(getattr(state, "draft", None), "cache", None)
    if dcache is not None:
        out["draft"] = dcache.k_pages
    return out


def anatomy(cfg: LlamaConfig, kind: str | None = "eagle3", spec: SpecConfig | None = None,
            batch: int = 8, context: int = 1024, max_new: int = 128, page_size: int = 16,
            temperature: float = 0.0, draft_vocab: int | None = None,
            programs=None, log=None, stacked: bool = True,
            compiler_options: dict | None = None, aot: str | None = None,
            kernels: str = "reference", drafter_kw: dict | None = None,
            quantize: str | None = None) -> dict:
    """Rows for the plain step and (with a drafter ``kind``) draft / verify / finish /
    iteration. ``programs``: names to compile (default all); ``compiler_options``: see
    :func:`analyse`; ``aot``: compile for that TPU generation without one
    (:data:`AOT_TARGETS`), tracing as for TPU (:func:`jspec.platform.building_for`);
    ``drafter_kw``: more arguments of the kind's registry ``build`` (DFlash's
    ``num_layers``, ``block_size``); ``quantize``: a quantized target
    (:func:`abstract_target_params`)."""
    device = aot_device(aot) if aot is not None else None
    platform = None
    if aot is not None:
        from jspec import aot as targets
        platform = targets.target(aot_target(aot)).platform
    with building_for(platform) if platform else contextlib.nullcontext():
        return _anatomy(cfg, kind, spec, batch, context, max_new, page_size, temperature,
                        draft_vocab, programs, log, stacked, compiler_options, device, kernels,
                        drafter_kw or {}, quantize)


def _anatomy(cfg, kind, spec, batch, context, max_new, page_size, temperature, draft_vocab,
             programs, log, stacked, compiler_options, device, kernels, drafter_kw,
             quantize=None) -> dict:
    setup = Setup(cfg, batch, context, max_new, page_size, temperature, kernels)
    params = abstract_target_params(cfg, stacked, quantize)
    want = lambda n: programs is None or n in programs
    rows, info = [], {}
    fn, args, donate, pstate = plain_program(setup, params)
    pools = {"plain target": pstate.cache.k_pages}
    all_progs = {"plain_step": (fn, args, donate, pool_key(pstate.cache.k_pages))}
    if kind is not None:
        kw = {"vocab_size": draft_vocab} if draft_vocab else {}
        drafter = abstract_drafter(kind, cfg, **kw, **drafter_kw)
        progs, sstate, spec = spec_programs(setup, params, drafter, spec)
        spools = pool_shapes_of(sstate)
        pools.update(spools)
        keys = [k for x in spools.values() for k in pool_key(x)]
        all_progs.update({k: (*v, keys) for k, v in progs.items()})
        S, N = tree_shape(drafter.module, spec)
        info["drafter_bytes"] = float(sum(np.prod(x.shape, dtype=np.float64) *
                                          np.dtype(x.dtype).itemsize
                                          for x in jax.tree.leaves(drafter.params)))
        info.update(drafter=kind, spec=None if spec is None else
                    [spec.num_steps, spec.topk, spec.num_draft_tokens], tree_depth=S, tree_nodes=N,
                    draft_vocab=getattr(drafter.module, "draft_vocab", None))
    pool_layers = {k: x.shape[0] for x in pools.values() for k in pool_key(x)}
    for name, (f, a, d, keys) in all_progs.items():
        if not want(name):
            continue
        if log:
            log(f"compiling {name} ...")
        rows.append(analyse(name, f, a, d, keys, cfg.num_layers, compiler_options, device,
                            pool_layers))
    base = next((r for r in rows if r["program"] == "plain_step"), None)
    for r in rows:
        r["bytes_x"] = r["bytes"] / base["bytes"] if base and base["bytes"] else float("nan")
        r["flops_x"] = r["flops"] / base["flops"] if base and base["flops"] else float("nan")
        r["flops_w_x"] = (r["dot_flops_w"] / base["dot_flops_w"] if base and base["dot_flops_w"]
                          else float("nan"))
        r["io_x"] = r["io_bytes"] / base["io_bytes"] if base and base["io_bytes"] else float("nan")
        # Issue 9's bytes goal: an iteration against one plain step plus one read of the
        # drafter's weights (what a drafter that cost nothing beyond its parameters would add).
        r["io_goal_x"] = (r["io_bytes"] / (base["io_bytes"] + info.get("drafter_bytes", 0.0))
                          if base and base["io_bytes"] else float("nan"))
    if device is not None:
        from jspec import aot as targets
        hbm = targets.hbm_bytes(device)
        info.update(chip=device.device_kind, hbm_GB=None if hbm is None else round(hbm / 1e9, 1))
    info.update(pool_shapes={k: [np.dtype(v.dtype).name, list(v.shape)] for k, v in pools.items()},
                batch=batch, context=context, max_new=max_new, page_size=page_size,
                dtype=cfg.dtype, quantize=quantize or "none",
                target_param_bytes=param_bytes(params), num_layers=cfg.num_layers,
                temperature=temperature, kernels=kernels)
    return {"info": info, "rows": rows}


# ------------------------------------------------------------------ CLI
def render(result: dict, title: str = "") -> str:
    i = result["info"]
    lines = [title] if title else []
    lines.append(" ".join(f"{k}={v}" for k, v in i.items() if k != "pool_shapes"))
    lines.append("pools: " + ", ".join(f"{k} {t}{d}" for k, (t, d) in i["pool_shapes"].items()))
    lines.append(common.format_table(result["rows"], COLUMNS))
    return "\n".join(lines)


def add_args(s) -> None:
    s.add_argument("--random-config", metavar="NAME", default="tiny",
                   help="a named random config (tiny, 100m, llama3-8b); no weights are made")
    s.add_argument("--drafter", metavar="KIND", default="eagle3",
                   help="a drafter kind (eagle3, dflash, ...), or none (plain step only)")
    s.add_argument("--spec", metavar="S,K,N", default=None,
                   help="tree knobs (default: the drafter's); a chain is S,1,S+1")
    s.add_argument("--draft-vocab", type=int, default=None,
                   help="eagle3: reduced draft vocabulary (with a d2t map)")
    s.add_argument("--drafter-arg", metavar="KEY=INT", action="append", default=[],
                   help="an argument of the kind's random build, e.g. num_layers=5 and "
                        "block_size=16 for dflash (repeatable)")
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--context", type=int, default=1024, help="prompt tokens in the cache per row")
    s.add_argument("--max-new", type=int, default=128)
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--temperature", type=float, default=0.0,
                   help="> 0 compiles the sampling walk instead of the greedy one")
    s.add_argument("--dtype", default=None,
                   help="default: the config's natural dtype (bfloat16 for llama3-8b, else float32)")
    s.add_argument("--programs", nargs="+", default=None,
                   help="a subset of: plain_step draft verify finish iteration")
    s.add_argument("--layout", choices=["scan", "per-layer"], default="scan",
                   help="target weights: the stacked, scanned layer stack TPUs/GPUs run "
                        "(default) or the per-layer weights CPUs run")
    s.add_argument("--topology", "--aot", dest="aot", default=None,
                   choices=["v5e", "v6e", "v5p", "h200", "v5e:2x2", "v6e:2x2", "v5p:2x2x1"],
                   help="compile for one chip of this accelerator on this host, without one "
                        "(TPU: libtpu, the tpu-aot extra; h200: the gpu-aot extra, run with "
                        "JAX_PLATFORMS=cpu); the counts are then that chip's program's")
    s.add_argument("--kernels", choices=["reference", "pallas"], default="reference",
                   help="attention and verify walk: the jnp reference or the Pallas kernels "
                        "(TPU/GPU, e.g. with --aot)")
    add_quantize_arg(s)
    s.add_argument("--json", metavar="OUT", help="also write the rows as JSON")


def _drafter_args(items) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise SystemExit(f"--drafter-arg {item!r}: expected KEY=INT")
        out[key] = int(value)
    return out


def main(args) -> dict:
    name = args.random_config
    dtype = args.dtype or configs.natural_dtype(name)
    cfg = configs.random_config(name, dtype)
    kind = None if args.drafter in (None, "none", "plain") else args.drafter
    log = lambda m: print(m, flush=True)
    result = anatomy(cfg, kind, parse_spec(args.spec), args.batch, args.context, args.max_new,
                     args.page_size, args.temperature, args.draft_vocab, args.programs, log=log,
                     stacked=args.layout == "scan", aot=args.aot, kernels=args.kernels,
                     drafter_kw=_drafter_args(args.drafter_arg), quantize=args.quantize)
    backend = f"{args.aot} (deviceless AOT)" if args.aot else jax.default_backend()
    result["info"] = {"config": name, "layout": args.layout, **result["info"], "jax": jax.__version__,
                      "backend": backend, "load_avg": common.load_avg()}
    print(render(result, "compiled-program anatomy (counts: while/scan bodies once; "
                         "bytes/flops: XLA cost analysis)"))
    if args.json:
        common.write_json(args.json, result)
    return result


COMMAND = Command("anatomy", "compiled plain step and speculative phases: kernels, bytes, flops, "
                             "memory, compile time (nothing timed)", add_args, main)

if __name__ == "__main__":
    run_module(COMMAND)
