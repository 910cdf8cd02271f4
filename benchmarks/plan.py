"""``python -m jspec.bench plan``: the memory and collective plan of sharded speculative decoding,
without the hardware.

The whole speculative program (prefill and the generate loop, exactly what
``jspec.generate(..., mesh=...)`` compiles) is lowered and compiled for a ``DATA x MODEL`` mesh
of simulated CPU devices from **abstract** weights, drafter parameters and inputs
(``jax.ShapeDtypeStruct`` with their shardings: nothing is allocated, so Llama-3-70B plans on
a laptop). It prints:

- per-device bytes, two ways: from the shardings (parameters, the drafter's parameters, the
  target's and the drafter's KV pools, each leaf's shard shape) and from XLA's memory
  analysis of the compiled program (arguments, outputs, temporaries; the KV pools are made
  inside the program, so they count as temporaries there);
- every collective inside one iteration of the generate loop (the decode ``while`` loop's
  body, nested loops counted by their trip counts): op, result shape, bytes per device,
  group size, how many run per iteration, and where it comes from (the op's source line).

``--topology v5e:8x8`` (or ``--aot``) compiles for that TPU topology's abstract chips instead
(deviceless, with libtpu; without it, a note and the simulated CPU devices), ``--topology
h200 --mesh 1x1`` for one abstract H200 (the gpu-aot extra), with the Mosaic / Triton
kernels inside ``shard_map`` over ``model`` (``--kernels``, default: what ``generate``'s
"auto" picks there): the chip's own memory analysis (against its HBM) and collectives, where
the CPU compile upcasts bf16 weights for its dots and plans memory for a CPU.
``--plain-step`` adds one plain decode step's HBM bytes per device beside one iteration's.
``--quantize int8|w8a8|fp8`` plans a quantized target (:mod:`jspec.quant`): the layer weights
are int8 / float8 values with per-channel scales (the memory table splits the target's
parameters into those values, their scales and the float embedding, head and norms), and
every byte count and the compile see them as such.
``--train`` plans one drafter training step instead (:mod:`benchmarks.train_plan`).
The command re-runs itself in a child process with ``JAX_PLATFORMS=cpu`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (N = DATA x MODEL), so it never starts
an accelerator backend and always has the devices the mesh needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.anatomy import (Setup, abstract_drafter, abstract_target_params, add_quantize_arg,
                                parse_spec)
from benchmarks.collectives import loop_collectives
from benchmarks.hlo import parse_hlo, pool_key, prefill_loop_body
from benchmarks.hlo_bytes import kernel_bytes

from jspec import aot
from jspec.args import parse_mesh
from jspec.bench import common, configs
from jspec.bench.registry import Command, run_module
from jspec.platform import building_for
from jspec.prefill import chunk_plan
# The packed layer projections: the weights --quantize turns into int8 / float8 values and scales.
from jspec.quant.pack import LAYER_WEIGHTS
from jspec.serving_layout import default_stacked
from jspec.sampling import SamplingConfig
from jspec.spec_decode import SpecDecoder, tree_shape

_REEXEC = "JSPEC_PLAN_CHILD"


def _shard_bytes(shape_dtype, sharding) -> int:
    shard = sharding.shard_shape(shape_dtype.shape)
    return int(np.prod(shard, dtype=np.int64)) * np.dtype(shape_dtype.dtype).itemsize




def target_param_parts(params, shardings) -> dict[str, tuple[list, list]]:
    """The target's packed parameters split for the memory table: ``{part: (leaves,
    shardings)}`` with the layer projections' values (float, or a quantized weight's int8 /
    float8 values), their scales (quantized only: per-channel weight scales and any
    ``in_scale``) and everything else (embedding, LM head, norms). Every leaf lands in
    exactly one part, so the parts add up to the whole."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    shards = jax.tree.leaves(shardings)
    assert len(flat) == len(shards), (len(flat), len(shards))
    parts = {"target: layer weights": ([], []), "target: layer scales": ([], []),
             "target: embed, head, norms": ([], [])}
    for (path, leaf), sh in zip(flat, shards):
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if names[0] == "layers" and any(n in LAYER_WEIGHTS for n in names):
            part = ("target: layer scales" if names[-1] in ("scale", "zero_point", "in_scale")
                    else "target: layer weights")
        else:
            part = "target: embed, head, norms"
        parts[part][0].append(leaf)
        parts[part][1].append(sh)
    return {k: v for k, v in parts.items() if v[0]}


# ------------------------------------------------------------------ the plan
@dataclasses.dataclass
class Plan:
    info: dict
    memory: list[dict]
    xla: dict
    collectives: list[dict]

    def render(self) -> str:
        i = self.info
        lines = [" ".join(f"{k}={v}" for k, v in i.items() if k != "compile_error"), "",
                 "per-device bytes, from the shardings:",
                 common.format_table(self.memory, ["what", "shape", "dtype", "spec", "MB/device",
                                                   "MB total"]),
                 "", ("DOES NOT FIT: " + i["compile_error"]) if not i.get("fits", True) else
                 "XLA memory analysis (per device): " +
                 ", ".join(f"{k} {v:.1f} MB" for k, v in self.xla.items()), "",
                 f"collectives in one iteration of the generate loop ({len(self.collectives)} "
                 f"kinds, {sum(c['per_iter'] for c in self.collectives)} ops, "
                 f"{sum(c['bytes'] * c['per_iter'] for c in self.collectives) / 2**20:.2f} MB "
                 "per device):"]
        rows = [{**c, "KB": c["bytes"] / 1024} for c in self.collectives]
        lines.append(common.format_table(rows, ["op", "shape", "KB", "group", "per_iter",
                                                "source"]))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan(cfg, kind: str | None, mesh, *, spec=None, batch: int = 8, context: int = 2048,
         max_new: int = 128, page_size: int = 16, draft_vocab: int | None = None,
         platform: str = "tpu", log=None, kernels: str = "reference",
         plain_step: bool = False, hlo_out: str | None = None,
         quantize: str | None = None) -> Plan:
    """Compile the speculative program on ``mesh`` from abstract inputs; see module doc.
    ``platform``: the platform the program is *traced* for (:func:`jspec.platform.building_for`:
    the code paths a TPU or GPU run takes, e.g. no CPU-only live-length buckets); it is
    compiled for the mesh's devices (simulated CPU ones, or a topology's abstract chips).
    ``kernels``: ``"reference"`` or ``"pallas"`` (the platform's kernels, each call inside a
    ``shard_map`` over ``model``: :func:`jspec.kernels.per_device`; compiles only for real
    chips' devices). ``plain_step``: also compile plain decoding on the mesh and report one
    plain step's HBM bytes per device beside one iteration's (``iteration_io_MB``:
    :func:`benchmarks.hlo_bytes.kernel_bytes` of the generate loop's body). ``hlo_out``: write the
    compiled program's optimized HLO there. ``quantize``: a :data:`jspec.quant.MODES` name
    (the target's layer weights quantized, :func:`benchmarks.anatomy.abstract_target_params`)."""
    with building_for(platform):
        return _plan(cfg, kind, mesh, spec, batch, context, max_new, page_size, draft_vocab,
                     platform, log, kernels, plain_step, hlo_out, quantize)


def _plan(cfg, kind, mesh, spec, batch, context, max_new, page_size, draft_vocab, platform,
          log, kernels="reference", plain_step=False, hlo_out=None, quantize=None) -> Plan:
    from jspec.serving_layout import packed_param_shardings
    from jspec.sharding import batch_sharding, kv_pages_spec

    data, model = mesh.shape["data"], mesh.shape["model"]
    if kind is None:
        raise ValueError("plan compiles the speculative program: pass a drafter kind")
    if batch % data:
        raise ValueError(f"batch {batch} does not split over data={data}")
    setup = Setup(cfg, batch, context, max_new, page_size)
    # As generate() runs it (quantized as jspec.checkpoint.quantize_target leaves it).
    params = abstract_target_params(cfg, stacked=default_stacked(), quantize=quantize)
    pshard = packed_param_shardings(mesh, params)
    params = aot.with_shardings(params, pshard)
    repl = NamedSharding(mesh, P())
    memory = []

    def add(what, tree, shardings):
        leaves, shards = jax.tree.leaves(tree), jax.tree.leaves(shardings)
        per = sum(_shard_bytes(a, s) for a, s in zip(leaves, shards))
        total = sum(int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
                    for a in leaves)
        specs = {str(x.spec) for x in shards}
        spec = specs.pop() if len(specs) == 1 else "logical rules"
        shapes = {tuple(x.shape) for x in leaves}
        dtypes = dict.fromkeys(np.dtype(x.dtype).name for x in leaves)
        memory.append({"what": what, "shape": list(shapes.pop()) if len(shapes) == 1 else "-",
                       "dtype": "+".join(dtypes), "spec": str(spec),
                       "MB/device": per / 2**20, "MB total": total / 2**20})

    add("target params", params, pshard)
    for part, (leaves, shards) in target_param_parts(params, pshard).items():
        add(part, leaves, shards)
    info = {"config": f"{cfg.num_layers}L h{cfg.hidden_size} V{cfg.vocab_size}",
            "mesh": f"{data}x{model}", "batch": batch, "context": context, "max_new": max_new,
            "dtype": cfg.dtype, "quantize": quantize or "none", "traced_for": platform}
    kw = {"vocab_size": draft_vocab} if draft_vocab else {}
    drafter = abstract_drafter(kind, cfg, **kw)
    spec = spec if spec is not None else drafter.default_spec
    S, N = tree_shape(drafter.module, spec)
    overshoot = max(N, drafter.module.cache_slots(spec)) + S + 1
    a = setup.inputs(overshoot, shards=data)
    dshard = drafter.shardings(cfg, mesh)
    dparams = aot.with_shardings(nn.unbox(drafter.params), dshard)
    add(f"{kind} params", dparams, dshard)
    if kernels != "reference":    # the refusals generate() makes, before compiling
        from jspec.kernels import resolve
        kernels = resolve(kernels, cfg, page_size=page_size, num_nodes=N, max_depth=S,
                          batch=batch, max_pages=a["table"].shape[1], num_pages=a["num_pages"],
                          mesh=mesh)
    dec = SpecDecoder(cfg, drafter.module, spec, SamplingConfig(0.0), a["cap_new"], page_size,
                      a["num_pages"], 0.0, mesh, kernels)
    rows = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                          sharding=batch_sharding(mesh, len(x.shape)))
    args = (params, dparams, rows(a["prompt"]), rows(a["lens"]), rows(a["table"]),
            rows(a["table"]), rows(a["stop"]), rows(a["limits"]),
            jax.ShapeDtypeStruct(a["key"].shape, a["key"].dtype, sharding=repl))
    # The pools as one data shard's loop makes them (shapes from the decoder itself), and as
    # the program holds them: pages over data, KV heads over model where they divide.
    local = lambda x: jax.ShapeDtypeStruct((x.shape[0] // data,) + x.shape[1:], x.dtype)
    state = jax.eval_shape(lambda *x: dec.initial_state(*x), params, dparams,
                           *(local(a[k]) for k in ("prompt", "lens", "table", "table", "stop",
                                                   "limits")), a["key"])
    heads_spec = kv_pages_spec(cfg, mesh)
    for name, cache, spec_ in (("target KV (k+v)", state.cache, heads_spec),
                               (f"{kind} KV (k+v)", getattr(state.draft, "cache", None),
                                P(None, None, "data"))):
        if cache is None:
            continue
        whole = lambda x: jax.ShapeDtypeStruct(x.shape[:2] + (x.shape[2] * data,) + x.shape[3:],
                                               x.dtype)
        sh = NamedSharding(mesh, spec_)
        add(name, {"k": whole(cache.k_pages), "v": whole(cache.v_pages)}, {"k": sh, "v": sh})
    info.update(drafter=kind, spec=None if spec is None else
                f"{spec.num_steps},{spec.topk},{spec.num_draft_tokens}",
                pages=a["num_pages"], page_size=page_size, kernels=kernels)
    t0 = time.perf_counter()
    if log:
        log(f"lowering and compiling for a {data}x{model} mesh ...")
    try:
        compiled = SpecDecoder.run.lower(dec, *args).compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # The plan's answer, not a crash: this does not fit the device's memory.
        info.update(fits=False, compile_s=round(time.perf_counter() - t0, 1),
                    compile_error=str(e).splitlines()[0][:300])
        return Plan(info, memory, {}, [])
    info.update(fits=True, compile_s=round(time.perf_counter() - t0, 1))
    m = compiled.memory_analysis()
    xla = {k: getattr(m, f"{k}_size_in_bytes", 0) / 2**20
           for k in ("argument", "output", "temp", "alias", "generated_code")} if m else {}
    hbm = aot.hbm_bytes(mesh.devices.flat[0])
    if hbm and m is not None:
        used = aot.used_bytes(m)
        info.update(hbm_GB=round(hbm / 1e9, 1), used_GB=round(used / 1e9, 2),
                    used_of_hbm=round(used / hbm, 3))
    text = compiled.as_text()
    if hlo_out:
        Path(hlo_out).write_text(text)
    info["pallas_calls"] = len(re.findall(r'custom_call_target="(tpu_custom_call|__gpu\$xla'
                                          r'\.gpu\.triton)"', text))
    # HBM bytes of one iteration on one device (the partitioned program is one device's):
    # its pools are that device's shards of the loop's pools.
    pools = [state.cache.k_pages] + ([state.draft.cache.k_pages]
                                     if getattr(state.draft, "cache", None) is not None else [])
    info["iteration_io_MB"] = round(kernel_bytes(text, _local_pools(pools, cfg, mesh),
                                                 root="decode loop")["weighted"] / 1e6, 1)
    # One chunk of the prefill's scan (jspec.prefill): a prompt of one chunk has none.
    n_chunks, C = chunk_plan(a["prompt"].shape[1], dec.prefill_chunk)
    body = prefill_loop_body(*parse_hlo(text), n_chunks - 1)
    info.update(prefill_chunks=n_chunks, prefill_chunk=C, prefill_chunk_io_MB=None if body is None
                else round(kernel_bytes(text, _local_pools(pools, cfg, mesh),
                                        root=body)["weighted"] / 1e6, 1))
    if plain_step:
        if log:
            log("compiling plain decoding on the same mesh ...")
        info.update(_plain_step_io(cfg, mesh, setup, params, data, kernels))
    return Plan(info, memory, xla, loop_collectives(text, data * model))


def _local_pools(pools, cfg, mesh) -> dict:
    """``{pool view: layers}`` of one device's shards of ``pools`` (per data shard already;
    KV heads over ``model`` where they divide), for :func:`benchmarks.hlo_bytes.kernel_bytes`."""
    model = mesh.shape["model"]
    out = {}
    for x in pools:
        L, H, *rest = x.shape
        h = H // model if H == cfg.num_kv_heads and H % model == 0 else H
        for v in (x, jax.ShapeDtypeStruct((L, h, *rest), x.dtype)):
            out.update({k: L for k in pool_key(v)})
    return out


def _plain_step_io(cfg, mesh, setup, params, data, kernels) -> dict:
    """One plain decode step's HBM bytes per device on the same mesh: ``PlainDecoder.run``
    compiled like the speculative program, its loop body read the same way."""
    from jspec.decode import PlainDecoder
    from jspec.sharding import batch_sharding
    a = setup.inputs(0, shards=data)
    if kernels != "reference":
        from jspec.kernels import resolve
        kernels = resolve(kernels, cfg, page_size=setup.page_size, batch=setup.batch,
                          max_pages=a["table"].shape[1], num_pages=a["num_pages"], mesh=mesh)
    dec = PlainDecoder(cfg, SamplingConfig(0.0), a["cap_new"], setup.page_size, a["num_pages"],
                       mesh, kernels)
    rows = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                          sharding=batch_sharding(mesh, len(x.shape)))
    key = jax.ShapeDtypeStruct(a["key"].shape, a["key"].dtype, sharding=NamedSharding(mesh, P()))
    args = (params, *(rows(a[k]) for k in ("prompt", "lens", "table", "stop", "limits")), key)
    pool = jax.ShapeDtypeStruct((cfg.num_layers, cfg.num_kv_heads, a["num_pages"],
                                 setup.page_size, cfg.head_dim), cfg.dtype)   # one data shard's
    t0 = time.perf_counter()
    text = jax.jit(lambda *x: dec.run(*x)).lower(*args).compile().as_text()
    io = kernel_bytes(text, _local_pools([pool], cfg, mesh), root="decode loop")
    return {"plain_step_io_MB": round(io["weighted"] / 1e6, 1),
            "plain_compile_s": round(time.perf_counter() - t0, 1)}


# ------------------------------------------------------------------ CLI
def _reexec(n: int) -> int:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env.update(XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={n}".strip(),
               JAX_PLATFORMS="cpu", **{_REEXEC: "1"})
    # The same command line, however it was run (python -m jspec.bench plan, -m benchmarks.plan).
    return subprocess.call([sys.executable, *sys.orig_argv[1:]], env=env)


def tpu_devices(topology: str, n: int):
    """``n`` abstract devices of a TPU topology such as ``v5e:2x4`` (deviceless compile,
    needs libtpu; DESIGN.md section 6): all of its chips, or its first chip for a 1x1 mesh
    (libtpu describes no topology smaller than one host's 2x2). Raises
    :class:`jspec.aot.CompilerMissing` without libtpu."""
    devices = aot.topology_devices("tpu", topology)
    if len(devices) != n and n != 1:
        raise SystemExit(f"--topology {topology} has {len(devices)} chips, the mesh needs {n}")
    return devices[:n]


def add_args(s) -> None:
    s.add_argument("--config", default="llama3-8b", help="a named random config (llama3-8b, "
                   "llama3-70b, 100m, ...)")
    s.add_argument("--drafter", default="eagle3", help="eagle1, eagle3, mtp")
    s.add_argument("--mesh", default="2x4", help="DATAxMODEL")
    s.add_argument("--spec", metavar="S,K,N", default=None)
    s.add_argument("--draft-vocab", type=int, default=None)
    s.add_argument("--batch", type=int, default=None,
                   help="global batch (default 8; --train: 8 rows per data shard)")
    s.add_argument("--context", type=int, default=2048)
    s.add_argument("--max-new", type=int, default=128)
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--dtype", default=None)
    s.add_argument("--topology", "--aot", dest="aot", metavar="TOPOLOGY", default=None,
                   help="compile for a TPU topology's abstract chips (e.g. v5e:2x4, v5e:8x8, "
                        "v6e:2x2 with --mesh 1x1 for one chip; needs libtpu, else simulated CPU "
                        "devices) instead of simulated CPU devices")
    s.add_argument("--hlo", metavar="FILE", help="also write the compiled program's HLO")
    s.add_argument("--plain-step", action="store_true",
                   help="also compile plain decoding on the mesh: one plain step's HBM bytes "
                        "per device beside one iteration's")
    s.add_argument("--kernels", default="auto", choices=["auto", "reference", "pallas"],
                   help="auto: the Pallas kernels when compiling for a topology, else the "
                        "reference")
    s.add_argument("--trace-for", default="tpu", choices=["tpu", "gpu", "cpu"],
                   help="the platform whose code paths are traced (compiled for CPU devices)")
    add_quantize_arg(s)
    s.add_argument("--json", metavar="OUT")
    t = s.add_argument_group("--train: one drafter training step instead (benchmarks.train_plan)")
    t.add_argument("--train", action="store_true",
                   help="plan one online training step of the drafter (default: eagle3 over "
                        "a 32768-token draft vocabulary) instead of the speculative program")
    t.add_argument("--seq-len", type=int, default=2048, help="--train: tokens per sequence")
    t.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                   help="--train: shard the drafter's parameters and optimizer state over "
                        "DATA (default: on when DATA > 1)")


def main(args) -> dict | None:
    data, model = parse_mesh(args.mesh)
    if args.train and args.quantize:
        raise SystemExit("--quantize plans a quantized serving target; --train plans the "
                         "drafter's training step (its target is float): use one or the other")
    if not os.environ.get(_REEXEC):       # never start an accelerator backend for a plan
        sys.exit(_reexec(data * model))
    from jspec.sharding import make_mesh
    devices, topology = None, args.aot
    chip = "gpu" if topology and topology.startswith("h200") else "tpu"
    if topology:
        try:
            devices = (tpu_devices(topology, data * model) if chip == "tpu" else
                       aot.topology_devices("gpu", "1x1x1")[:data * model])
            if len(devices) != data * model:
                raise SystemExit(f"--topology {topology} has {len(devices)} GPU(s), the mesh "
                                 f"needs {data * model}")
        except aot.CompilerMissing as e:
            print(f"# --topology {topology}: {e}; falling back to simulated CPU devices",
                  flush=True)
            topology = None
    if devices is None and len(jax.devices()) < data * model:
        raise SystemExit(f"mesh {data}x{model} needs {data * model} devices; have "
                         f"{len(jax.devices())}")
    if args.train:
        from benchmarks.train_plan import run as train_run
        return train_run(args, make_mesh(data, model, devices), args.config, topology,
                         chip if topology else args.trace_for)
    kernels = args.kernels
    if kernels == "auto":        # what generate's "auto" picks on the chips compiled for
        kernels = "pallas" if topology else "reference"
    if kernels == "pallas" and not topology:
        raise SystemExit("--kernels pallas compiles Mosaic or Triton kernels: it needs "
                         "--topology (and its compiler); simulated CPU devices run the reference")
    name = args.config
    cfg = configs.random_config(name, args.dtype or configs.natural_dtype(name))
    mesh = make_mesh(data, model, devices)
    p = plan(cfg, args.drafter, mesh, spec=parse_spec(args.spec), batch=args.batch or 8,
             context=args.context, max_new=args.max_new, page_size=args.page_size,
             draft_vocab=args.draft_vocab, platform=chip if topology else args.trace_for,
             log=lambda s: print(s, flush=True), kernels=kernels, plain_step=args.plain_step,
             hlo_out=args.hlo, quantize=args.quantize)
    print(f"# plan: {name}"
          + (f" {args.quantize}" if args.quantize else f" {cfg.dtype}")
          + f", {args.drafter}, mesh {args.mesh}"
          + (f", compiled for {topology} (deviceless)" if topology else ", CPU devices"))
    print(p.render())
    if args.json:
        common.write_json(args.json, p.as_dict())
    return p.as_dict()


COMMAND = Command("plan", "per-device memory and the collectives of one iteration of sharded "
                          "speculative decoding, compiled on simulated CPU devices from abstract "
                          "weights (nothing allocated)", add_args, main)

if __name__ == "__main__":
    run_module(COMMAND)
