"""``python -m jspec.bench serve-plan``: the serving engine's programs compiled for real chips
without them (deviceless; ``../shared/DESIGN.md`` section 6), with their memory per chip.

From abstract weights (nothing allocated), for a ``(1, model)`` mesh of a topology's chips
(``--topology v5e:2x4``: 8 v5e chips, tensor parallelism over the KV heads; ``--topology h200``:
one H200), it compiles the engine's ``decode`` for a full bucket of ``--slots`` rows (the fixed
spec and plain decoding), its ``sync`` (the drafter caught up after plain chunks) and its
``insert`` for a prompt bucket, and prints XLA's memory
analysis of each: arguments (weights, the slots' state with its KV pools), outputs, what is
aliased (the state is donated, so the pools are updated in place) and temporaries, against
the chip's HBM. ``--quantize int8|w8a8|fp8``: a quantized target (:mod:`jspec.quant`; int8 /
float8 layer weights with per-channel scales), as ``serve --quantize`` runs it.
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.anatomy import (abstract_drafter, abstract_target_params, add_quantize_arg,
                               param_bytes)

from jspec import aot
from jspec import kv_cache as kvc
from jspec.bench import common, configs
from jspec.bench.registry import Command, run_module
from jspec.engine.programs import PLAIN, Programs
from jspec.platform import building_for
from jspec.sampling import SamplingConfig
from jspec.serving_layout import default_stacked
from jspec.serving_layout import packed_param_shardings
from jspec.sharding import kv_pages_spec, make_mesh
from jspec.spec_config import parse_spec


def add_args(s) -> None:
    s.add_argument("--topology", required=True,
                   help="v5e:2x4 (8 chips, a (1, 8) mesh), v6e:2x2, v5p:2x2x1, or h200 (one chip)")
    s.add_argument("--config", default="llama3-8b")
    s.add_argument("--drafter", default="eagle3")
    s.add_argument("--draft-vocab", type=int, default=32768)
    s.add_argument("--spec", default=None, help="S,K,N (default: the drafter's)")
    s.add_argument("--slots", type=int, default=64)
    s.add_argument("--context", type=int, default=8192, help="prompt + new tokens a row holds")
    s.add_argument("--max-new", type=int, default=1024)
    s.add_argument("--prompt", type=int, default=1024, help="the insert's prompt bucket")
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--kernels", default="pallas", choices=["pallas", "reference"])
    add_quantize_arg(s)
    s.add_argument("--json", metavar="OUT")


def _state_shardings(state, cfg, mesh):
    """The target's pools over KV heads (as the engine pins them), everything else replicated."""
    repl = NamedSharding(mesh, P())
    pools = NamedSharding(mesh, kv_pages_spec(cfg, mesh))
    target_pools = {id(state.core.cache.k_pages), id(state.core.cache.v_pages)}
    return jax.tree.map(lambda a: pools if id(a) in target_pools else repl, state)


def _memory(compiled, hbm) -> dict:
    m = compiled.memory_analysis()
    get = lambda k: getattr(m, f"{k}_size_in_bytes", 0)
    used = aot.used_bytes(m)
    row = {k: round(get(k) / 1e9, 3) for k in ("argument", "output", "alias", "temp")}
    row.update(used_GB=round(used / 1e9, 2))
    if hbm:
        row.update(hbm_GB=round(hbm / 1e9, 1), used_of_hbm=round(used / hbm, 3))
    return row


def serve_plan(cfg, kind: str, mesh, *, slots: int, context: int, max_new: int, prompt: int,
               spec=None, draft_vocab: int | None = None, page_size: int = 16,
               kernels: str = "pallas", log=print, quantize: str | None = None) -> dict:
    params = abstract_target_params(cfg, stacked=default_stacked(), quantize=quantize)
    weights = param_bytes(params)
    params = aot.with_shardings(params, packed_param_shardings(mesh, params))
    drafter = abstract_drafter(kind, cfg, **({"vocab_size": draft_vocab} if draft_vocab else {}))
    dparams = aot.with_shardings(nn.unbox(drafter.params), drafter.shardings(cfg, mesh))
    spec = spec if spec is not None else drafter.default_spec
    S, N = drafter.module.tree_shape(spec)
    overshoot = max(N, drafter.module.cache_slots(spec)) + S + 1
    max_pages = kvc.pages_needed(context + overshoot, page_size)
    programs = Programs(config=cfg, drafter=drafter.module, sampling=SamplingConfig(),
                        slots=slots, max_new_tokens=max_new, max_depth=S, max_nodes=N,
                        page_size=page_size, num_pages=slots * max_pages, max_pages=max_pages,
                        stop_width=8, chunk=8, kernels=kernels, mesh=mesh)
    info = {"config": f"{cfg.num_layers}L h{cfg.hidden_size} V{cfg.vocab_size} {cfg.dtype}",
            "mesh": f"1x{mesh.shape['model']}", "device": mesh.devices.flat[0].device_kind,
            "drafter": kind, "spec": f"{S},{spec.topk},{N}", "slots": slots,
            "context": context, "pages": slots * max_pages, "kernels": kernels,
            "quantize": quantize or "none", "target_weights_GB": round(weights / 1e9, 2)}
    rows = {}
    hbm = aot.hbm_bytes(mesh.devices.flat[0])
    key_dtype = jax.random.key(0).dtype        # made here: under the mesh nothing can run
    with jax.set_mesh(mesh):
        state = jax.eval_shape(lambda p, d: Programs.init(programs, p, d), params, dparams)
        state = aot.with_shardings(state, _state_shardings(state, cfg, mesh))
        repl = NamedSharding(mesh, P())
        arg = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt, sharding=repl)
        key = jax.ShapeDtypeStruct((1,), key_dtype, sharding=repl)
        jobs = {
            f"decode {info['spec']} x{slots}": lambda: Programs.decode.trace(
                programs, params, dparams, state, arg((slots,)), spec=spec),
            f"decode plain x{slots}": lambda: Programs.decode.trace(
                programs, params, dparams, state, arg((slots,)), spec=PLAIN),
            f"sync x{slots}": lambda: Programs.sync.trace(
                programs, params, dparams, state, arg((slots,))),
            f"insert prompt {prompt}": lambda: Programs.insert.trace(
                programs, params, dparams, state, arg(()), arg((1, prompt)), arg((1,)),
                arg((1, max_pages)), arg((1, 8)), arg((1,)), key),
        }
        for name, trace in jobs.items():
            log(f"compiling {name} ...")
            t0 = time.perf_counter()
            try:
                compiled = trace().lower().compile()
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                rows[name] = {"fits": False, "error": str(e).splitlines()[0][:200]}
                continue
            mem = _memory(compiled, hbm)
            # XLA:GPU compiles deviceless past its own budget (it only warns), so a program
            # fits when it compiled and its memory is within the chip's HBM.
            rows[name] = {"fits": mem.get("used_of_hbm", 0) <= 1.0,
                          "compile_s": round(time.perf_counter() - t0, 1), **mem}
    kv = 2 * np.prod(state.core.cache.k_pages.shape) * np.dtype(cfg.dtype).itemsize
    info["target_KV_GB_per_chip"] = round(kv / mesh.shape["model"] / 1e9, 2)
    return {"info": info, "programs": rows}


def main(args) -> dict:
    import json

    name = args.topology
    if name.startswith("h200"):
        devices, platform = aot.topology_devices("gpu", "1x1x1")[:1], "gpu"
    else:
        devices, platform = aot.topology_devices("tpu", name), "tpu"
    cfg = configs.random_config(args.config, configs.natural_dtype(args.config))
    mesh = make_mesh(1, len(devices), devices)
    with building_for(platform):
        out = serve_plan(cfg, args.drafter, mesh, slots=args.slots, context=args.context,
                         max_new=args.max_new, prompt=args.prompt,
                         spec=parse_spec(args.spec) if args.spec else None,
                         draft_vocab=args.draft_vocab, page_size=args.page_size,
                         kernels=args.kernels, log=lambda s: print(s, flush=True),
                         quantize=args.quantize)
    print(f"# engine programs: {args.config} {args.quantize or cfg.dtype}, "
          f"{json.dumps(out['info'])}")
    print(f"{'program':<28} {'fits':>5} {'args GB':>8} {'out GB':>7} {'alias GB':>9} "
          f"{'temp GB':>8} {'used GB':>8} {'of HBM':>7}")
    for p, r in out["programs"].items():
        if not r["fits"]:
            print(f"{p:<28} {'no':>5}  {r['error']}")
            continue
        print(f"{p:<28} {'yes':>5} {r['argument']:>8.2f} {r['output']:>7.2f} {r['alias']:>9.2f} "
              f"{r['temp']:>8.2f} {r['used_GB']:>8.2f} {r.get('used_of_hbm', 0):>7.1%}")
    if args.json:
        common.write_json(args.json, out)
    return out


COMMAND = Command("serve-plan", "the engine's programs compiled for TPU chips or an H200 without "
                                "them: memory per chip", add_args, main)

if __name__ == "__main__":
    run_module(COMMAND)
