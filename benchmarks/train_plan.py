"""``python -m jspec.bench plan --train``: the memory plan of one drafter training step,
without the hardware.

One step of :func:`jspec.train.trainer.make_train_step` (online: the target's forward runs
inside the step, :mod:`jspec.train.online`) is lowered and compiled for a ``DATA x MODEL``
mesh from **abstract** inputs (``jax.ShapeDtypeStruct`` with the shardings the trainer
gives them; nothing is allocated, so an 8B target plans on a laptop):

- the target's parameters in the checkpoint layout the trainer feeds it, sharded over
  ``model`` like inference (:func:`jspec.target.param_shardings`);
- the drafter as :func:`jspec.train.drafter.build_drafter` makes it (its draft-vocabulary
  head(s) and map, :func:`abstract_train_drafter`), split like the trainer splits it: the
  trained parameters inside a :class:`jspec.train.optim.TrainState` (AdamW state and all:
  ``jax.eval_shape(TrainState.create, ...)``), placed by
  :func:`jspec.train.placement.state_shardings` (replicated, or with ``fsdp`` every leaf
  split over ``data`` along its largest divisible axis), and the frozen map (``d2t``) and
  its inverse ``t2d`` replicated;
- the batch ``tokens [B, T] int32, lens [B] int32`` over ``data`` and ``rng [2] uint32``
  replicated (:func:`jspec.train.placement.batch_shardings`).

Printed, per chip: the bytes of each of those from the shardings (each leaf's shard shape),
then XLA's memory analysis of the compiled step (arguments, outputs, outputs aliased to
the donated state, temporaries: the activations kept for the backward pass, the target's
forward, the logits ...), their peak (:func:`jspec.aot.used_bytes`) against the chip's HBM
(:data:`jspec.aot.HBM_BYTES`: v5e 16 GiB, v5p 95 GiB, H200 141 GB) and whether it fits;
per step: ``compiled.cost_analysis()``'s flops and bytes accessed ("n/a" where the backend
gives none; XLA counts a ``while`` body once, and the trainer's target runs its layers
unrolled, so nothing here is under-counted by a layer scan). GB are decimal (1e9 bytes).

Defaults (``--train``): the EAGLE-3 head of Llama-3-8B (``--config llama3-8b``, bf16) with
a 32k draft vocabulary (``--draft-vocab 32768``), sequences of 2048 tokens (``--seq-len``),
a global batch of 8 rows per data shard (``--batch``, default ``8 x DATA``: rows go over
``data`` and every ``model`` group computes its data shard's drafter in full), FSDP on when
``DATA > 1`` (``--fsdp / --no-fsdp``), the trainer's loss (``default_loss``: 3-step TTT)
and top-16 soft labels. On CPU devices no HBM is known: ``fits`` is "n/a" there.
"""

from __future__ import annotations

import dataclasses
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jspec import aot
from jspec.bench import common

DEFAULT_DRAFT_VOCAB = 32768
ROWS_PER_DATA_SHARD = 8


def default_batch(data: int) -> int:
    """The global batch ``--train`` plans by default: 8 rows per data shard."""
    return ROWS_PER_DATA_SHARD * data


def _bytes(tree, shardings=None) -> int:
    """Bytes of ``tree``'s leaves: whole, or (given ``shardings``) one device's shards."""
    leaves = jax.tree.leaves(tree)
    shards = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
    total = 0
    for a, s in zip(leaves, shards, strict=True):
        shape = a.shape if s is None else s.shard_shape(a.shape)
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
    return total


def _replicated_bytes(tree, shardings) -> int:
    """Bytes of the leaves that every device holds whole (spec without a mesh axis)."""
    return sum(_bytes(a) for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))
               if s.is_fully_replicated)


# ------------------------------------------------------------------ abstract pieces
def drafter_arch(kind: str, target_cfg) -> dict:
    """The architecture options ``python -m jspec.train train`` passes for an online run
    (its default aux layers, for the kinds that read them)."""
    import inspect

    from jspec.drafters import registry
    from jspec.train.features import aux_layers_for
    entry = registry.kind(kind)
    fields = {f.name for f in dataclasses.fields(entry.module)} | {
        n for n, p in inspect.signature(entry.build).parameters.items()
        if p.kind is p.POSITIONAL_OR_KEYWORD}
    return {"aux_layers": aux_layers_for(target_cfg.num_layers)} if "aux_layers" in fields else {}


def abstract_train_drafter(kind: str, target_cfg, draft_vocab: int = 0, **arch):
    """``(module, params)``: the drafter :func:`jspec.train.drafter.build_drafter` builds, as
    shape/dtype structs. ``build_drafter`` reads the target's head and the token counts on
    the host (``np.asarray``), so it cannot run under ``jax.eval_shape``; this makes what it
    makes from the same pieces: the kind's random drafter over the draft vocabulary (which
    carries the map, ``d2t`` / ``token_map``), the family's start, and the draft-vocabulary
    heads unboxed as :func:`jspec.drafters.vocab.set_draft_vocab` leaves them."""
    from jspec.drafters import random_drafter
    from jspec.drafters.vocab import _get, _set
    from jspec.train.drafter import FAMILIES, _entry
    family = FAMILIES[_entry(kind).loss[0]]
    V = target_cfg.vocab_size
    vd = draft_vocab if draft_vocab and draft_vocab < V else 0
    box = {}

    def init(key):
        d = family.start(random_drafter(kind, target_cfg, key, vocab_size=family.vocab(vd, V),
                                        **arch))
        box["module"] = d.module
        params = dict(d.params)
        for path in d.module.draft_head_paths:
            params = _set(params, path, nn.unbox(_get(params, path)))
        return params

    params = jax.eval_shape(init, jax.random.key(0))
    return box["module"], params


def _sds(tree, shardings):
    return aot.with_shardings(tree, shardings)


# ------------------------------------------------------------------ the plan
@dataclasses.dataclass
class TrainPlan:
    info: dict
    memory: list[dict]          # per-device bytes from the shardings
    xla: dict                   # per-device bytes from XLA's memory analysis
    step: dict                  # per step: flops, bytes accessed

    def render(self) -> str:
        i = self.info
        gb = lambda b: "n/a" if b is None else f"{b / 1e9:.3f}"
        head = " ".join(f"{k}={v}" for k, v in i.items() if k not in ("compile_error",))
        rows = [{"what": r["what"], "dtype": r["dtype"], "spec": r["spec"],
                 "GB/chip": gb(r["bytes_per_device"]), "GB total": gb(r["bytes_total"])}
                for r in self.memory]
        lines = [head, "", "per chip, from the shardings (GB = 1e9 bytes):",
                 common.format_table(rows, ["what", "dtype", "spec", "GB/chip", "GB total"]), ""]
        if i.get("compile_error"):
            lines += [f"DOES NOT FIT (the compiler's answer): {i['compile_error']}"]
            return "\n".join(lines)
        x = self.xla
        hbm = i.get("hbm_bytes")
        xrows = [{"what": k, "GB/chip": gb(x.get(k))} for k in
                 ("arguments", "outputs", "aliased (donated state)", "temporaries (activations)",
                  "generated code")]
        xrows.append({"what": "peak = arguments + outputs - aliased + temporaries",
                      "GB/chip": gb(x.get("peak"))})
        xrows.append({"what": f"HBM ({i.get('chip', 'CPU device')})", "GB/chip": gb(hbm)})
        xrows.append({"what": "fits", "GB/chip": i["fits"]})
        lines += ["per chip, XLA memory analysis of the compiled step:",
                  common.format_table(xrows, ["what", "GB/chip"]), ""]
        s = self.step
        f = lambda v, unit, scale: "n/a" if v is None else f"{v / scale:,.1f} {unit}"
        lines += ["per step (compiled.cost_analysis(), one chip's partitioned program):",
                  common.format_table([
                      {"what": "flops", "value": f(s.get("flops"), "TFLOP", 1e12)},
                      {"what": "bytes accessed", "value": f(s.get("bytes_accessed"), "GB", 1e9)},
                      {"what": "tokens (global batch x seq len)", "value": str(s["tokens"])},
                  ], ["what", "value"])]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _cost(compiled) -> dict:
    """flops and bytes accessed, or None each where the backend reports none (a list of
    per-computation dicts in older jax, one dict now)."""
    try:
        ca = compiled.cost_analysis()
    except Exception:                     # noqa: BLE001 (a backend without one)
        ca = None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    ca = ca or {}
    get = lambda k: float(ca[k]) if k in ca and ca[k] is not None and ca[k] >= 0 else None
    return {"flops": get("flops"), "bytes_accessed": get("bytes accessed")}


def train_plan(cfg, kind: str, mesh, *, batch: int | None = None, seq_len: int = 2048,
               draft_vocab: int = DEFAULT_DRAFT_VOCAB, fsdp: bool | None = None, topk: int = 16,
               log=None) -> TrainPlan:
    """Compile one online training step of a ``kind`` drafter for ``cfg`` on ``mesh`` from
    abstract inputs (see the module doc). ``fsdp=None``: on when ``data > 1``;
    ``batch=None``: :func:`default_batch`. Trace it inside
    :func:`jspec.platform.building_for` the platform it is compiled for."""
    from jspec import llama
    from jspec.target import param_shardings
    from jspec.train.drafter import default_loss, split_params
    from jspec.train.optim import TrainState
    from jspec.train.placement import batch_shardings, state_shardings
    from jspec.train.trainer import TrainConfig, make_train_step

    data, model = mesh.shape["data"], mesh.shape["model"]
    fsdp = data > 1 if fsdp is None else fsdp
    batch = default_batch(data) if batch is None else batch
    if batch % data:
        raise ValueError(f"batch {batch} does not split over data={data}")
    repl = NamedSharding(mesh, P())
    memory = []

    def add(what, tree, shardings):
        leaves, shards = jax.tree.leaves(tree), jax.tree.leaves(shardings)
        specs = {str(s.spec) for s in shards}
        dtypes = {np.dtype(a.dtype).name for a in leaves}
        memory.append({"what": what, "dtype": dtypes.pop() if len(dtypes) == 1 else "mixed",
                       "spec": specs.pop() if len(specs) == 1 else "per leaf",
                       "leaves": len(leaves), "bytes_per_device": _bytes(tree, shardings),
                       "bytes_total": _bytes(tree),
                       "bytes_replicated": _replicated_bytes(tree, shardings)})

    # The target as the trainer holds it: checkpoint layout, sharded over model.
    tparams = nn.unbox(llama.abstract_params(cfg))
    tsh = param_shardings(cfg, mesh)
    tparams = _sds(tparams, tsh)
    add("target params", tparams, tsh)

    # The drafter as build_drafter makes it, split and placed as train() does.
    module, dparams = abstract_train_drafter(kind, cfg, draft_vocab, **drafter_arch(kind, cfg))
    trainable, frozen = split_params(dparams)
    tc = TrainConfig(batch_size=batch, online=True, topk=topk, fsdp=fsdp)
    lc = default_loss(kind)
    from jspec.train.optim import make_optimizer
    tx = make_optimizer(tc.lr, tc.warmup, tc.steps, tc.weight_decay, tc.clip)
    state = jax.eval_shape(lambda p: TrainState.create(
        p, tx, jax.random.key_data(jax.random.key(tc.seed))), trainable)
    state_sh = state_shardings(state, mesh, fsdp)
    state = _sds(state, state_sh)
    add(f"{kind} params (trained)", state.params, state_sh.params)
    rest = lambda t: (t.opt_state, t.step, t.key, t.data_pos)
    add("optimizer state (AdamW; step, key)", rest(state), rest(state_sh))
    frozen = _sds(frozen, jax.tree.map(lambda _: repl, frozen))
    # t2d [V]: the map's inverse (draft_t2d), replicated; none without a map.
    has_map = bool(jax.tree.leaves(frozen))
    t2d = jax.ShapeDtypeStruct((cfg.vocab_size,), jnp.int32, sharding=repl) if has_map else None
    if has_map:
        add(f"{kind} maps (d2t, t2d)", (frozen, t2d), (jax.tree.map(lambda _: repl, frozen), repl))
    b = {"tokens": jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
         "lens": jax.ShapeDtypeStruct((batch,), jnp.int32),
         "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}
    bsh = batch_shardings(b, mesh)
    b = _sds(b, bsh)
    add("batch (tokens, lens, rng)", b, bsh)

    info = {"config": f"{cfg.num_layers}L h{cfg.hidden_size} V{cfg.vocab_size}",
            "dtype": cfg.dtype, "drafter": kind, "draft_vocab": getattr(module, "draft_vocab",
                                                                       None),
            "mesh": f"{data}x{model}", "fsdp": fsdp, "batch": batch,
            "rows_per_data_shard": batch // data, "seq_len": seq_len, "unroll": lc.unroll,
            "topk": topk}
    dev = mesh.devices.flat[0]
    hbm = aot.hbm_bytes(dev)
    info["chip"] = getattr(dev, "device_kind", "?")
    info["hbm_bytes"] = hbm

    _, step = make_train_step(module, cfg, lc, tc, state_sh, mesh)
    if log:
        log(f"lowering and compiling one training step for a {data}x{model} mesh ...")
    t0 = time.perf_counter()
    try:
        compiled = step.lower(state, frozen, t2d, tparams, b).compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # The plan's answer, not a crash: the step does not fit the chip's memory.
        info.update(fits="no", compile_s=round(time.perf_counter() - t0, 1),
                    compile_error=str(e).splitlines()[0][:400])
        return TrainPlan(info, memory, {}, {"tokens": batch * seq_len})
    info["compile_s"] = round(time.perf_counter() - t0, 1)
    m = compiled.memory_analysis()
    xla = {}
    if m is not None:
        xla = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
               "aliased (donated state)": m.alias_size_in_bytes,
               "temporaries (activations)": m.temp_size_in_bytes,
               "generated code": m.generated_code_size_in_bytes, "peak": aot.used_bytes(m)}
    peak = xla.get("peak")
    info["fits"] = "n/a" if hbm is None or peak is None else ("yes" if peak <= hbm else "no")
    if hbm and peak is not None:
        info["peak_of_hbm"] = round(peak / hbm, 3)
    return TrainPlan(info, memory, xla, {**_cost(compiled), "tokens": batch * seq_len})


# ------------------------------------------------------------------ CLI (from plan.py)
def run(args, mesh, name: str, topology: str | None, platform: str) -> dict:
    """``plan --train``: called by :func:`benchmarks.plan.main` in its child, with the mesh
    (simulated CPU devices or a topology's abstract chips)."""
    from jspec.bench import configs
    from jspec.platform import building_for
    cfg = configs.random_config(name, args.dtype or configs.natural_dtype(name))
    data = mesh.shape["data"]
    dv = DEFAULT_DRAFT_VOCAB if args.draft_vocab is None else args.draft_vocab
    with building_for(platform):
        p = train_plan(cfg, args.drafter, mesh, batch=args.batch, seq_len=args.seq_len,
                       draft_vocab=dv, fsdp=args.fsdp, log=lambda s: print(s, flush=True))
    print(f"# train plan: {name}, {args.drafter}, mesh {args.mesh} (data={data}), "
          f"traced for {platform}"
          + (f", compiled for {topology} (deviceless)" if topology else ", CPU devices"))
    print(p.render())
    if args.json:
        common.write_json(args.json, p.as_dict())
    return p.as_dict()
