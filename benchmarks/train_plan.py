"""``python -m jspec.bench plan --train``: the memory plan of one drafter training step,
without the hardware.

One step of :func:`jspec.train.trainer.make_train_step` (online: the target's forward runs
inside it, :mod:`jspec.train.online`) is compiled for a ``DATA x MODEL`` mesh from abstract
inputs with the trainer's shardings (nothing allocated): the target's checkpoint-layout
parameters over ``model`` (:func:`jspec.target.param_shardings`); the drafter as
:func:`jspec.train.drafter.build_drafter` makes it (:func:`abstract_train_drafter`), its
trained part in a :class:`jspec.train.optim.TrainState` (AdamW state included) placed by
:func:`jspec.train.placement.state_shardings` (replicated, or ``fsdp``: each leaf split over
``data``), its map ``d2t`` and the inverse ``t2d`` replicated; the batch (``tokens [B, T]``,
``lens [B]`` over ``data``, ``rng [2]`` replicated: ``placement.batch_shardings``).

Printed per chip: each of those's bytes from the shardings; XLA's memory analysis
(arguments, outputs, outputs aliased to the donated state, temporaries: the activations
kept for the backward pass, the target's forward, the logits), their peak
(:func:`jspec.aot.used_bytes`) against the chip's HBM (:data:`jspec.aot.HBM_BYTES`: v5e
16 GiB, v5p 95 GiB, H200 141 GB) and whether it fits ("n/a" on CPU devices). Per step (one
chip's partitioned program): ``cost_analysis()``'s flops and bytes accessed ("n/a" where the
backend gives none, as XLA:GPU compiled deviceless). XLA counts a ``while`` body once, and
on TPU the target's layers are a ``fori_loop`` (:func:`jspec.serving_layout.default_stacked`),
so there those count one layer of 32; beside them, the HLO's matmul flops
(:func:`matmul_flops`) and kernel HBM bytes (:func:`benchmarks.hlo_bytes.kernel_bytes`) with
every loop weighted by its trip count. GB are decimal (1e9 bytes).

Defaults: Llama-3-8B (bf16) with an EAGLE-3 head over a 32k draft vocabulary, 2048-token
sequences (``--seq-len``), a global batch of 8 rows per data shard (``--batch``, default
``8 x DATA``; each ``model`` group runs its data shard's drafter whole), FSDP when
``DATA > 1`` (``--fsdp / --no-fsdp``), the kind's loss (EAGLE-3: 3-step TTT), top-16 labels.
Meshes: one H200 ``1x1``; a v5e 2x4 slice ``2x4`` (16 GiB chips: the 16 GB target must be
split over ``model``); a v5p 2x2x1 ``4x1`` (95 GiB chips hold the target whole, so all four
chips split rows: no tensor-parallel collectives, no drafter work repeated over ``model``).
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


def _bytes(tree, shardings=None, only_replicated: bool = False) -> int:
    """Bytes of ``tree``'s leaves: whole, or (given ``shardings``) one device's shards, or
    (``only_replicated``) of the leaves that every device holds whole."""
    leaves = jax.tree.leaves(tree)
    shards = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
    return sum(int(np.prod(a.shape if s is None or only_replicated else s.shard_shape(a.shape),
                           dtype=np.int64)) * np.dtype(a.dtype).itemsize
               for a, s in zip(leaves, shards, strict=True)
               if not only_replicated or s.is_fully_replicated)


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
    from jspec.drafters import random_drafter, registry
    from jspec.train.drafter import FAMILIES, default_loss
    default_loss(kind)                        # refuses a kind jspec.train does not train
    family = FAMILIES[registry.kind(kind).loss[0]]
    V = target_cfg.vocab_size
    vd = draft_vocab if draft_vocab and draft_vocab < V else 0
    box = {}

    def unbox_at(tree: dict, path) -> dict:
        head, *more = path
        return {**tree, head: unbox_at(tree[head], more) if more else nn.unbox(tree[head])}

    def init(key):
        d = family.start(random_drafter(kind, target_cfg, key, vocab_size=family.vocab(vd, V),
                                        **arch))
        box["module"] = d.module
        params = dict(d.params)
        for path in d.module.draft_head_paths:
            params = unbox_at(params, path)
        return params

    params = jax.eval_shape(init, jax.random.key(0))
    return box["module"], params


# ------------------------------------------------------------------ the plan
_PEAK = "peak = arguments + outputs - aliased + temporaries"
_STEP = (("flops (cost_analysis)", "flops", "FLOP"),
         ("bytes accessed (cost_analysis)", "bytes_accessed", "B"),
         ("matmul flops, loops x trip counts (HLO)", "matmul_flops_weighted", "FLOP"),
         ("kernel HBM bytes, loops x trip counts (HLO)", "io_bytes_weighted", "B"))


@dataclasses.dataclass
class TrainPlan:
    info: dict
    memory: list[dict]          # per-device bytes from the shardings
    xla: dict                   # per-device bytes from XLA's memory analysis
    step: dict                  # per step: flops, bytes accessed

    def render(self) -> str:
        i, x, hbm = self.info, self.xla, self.info.get("hbm_bytes")
        big = max([r["bytes_total"] for r in self.memory] + [v or 0 for v in x.values()])
        u, scale = ("GB", 1e9) if big >= 1e8 else ("MB", 1e6)      # decimal
        num = lambda b: "n/a" if b is None else f"{b / scale:.3f}"
        rows = [{**r, f"{u}/chip": num(r["bytes_per_device"]), f"{u} total": num(r["bytes_total"])}
                for r in self.memory]
        lines = [" ".join(f"{k}={v}" for k, v in i.items() if k != "compile_error"), "",
                 f"per chip, from the shardings ({u} = {scale:.0e} bytes):",
                 common.format_table(rows, ["what", "dtype", "spec", f"{u}/chip", f"{u} total"]),
                 ""]
        if i.get("compile_error"):
            return "\n".join(lines + [f"DOES NOT FIT (the compiler's answer): "
                                      f"{i['compile_error']}"])
        chip = f"HBM ({i['chip']}" + (f", {hbm / 2**30:.1f} GiB)" if hbm else ")")
        xrows = [{"what": _PEAK if k == "peak" else k, f"{u}/chip": num(v)} for k, v in x.items()]
        xrows += [{"what": chip, f"{u}/chip": num(hbm)}, {"what": "fits", f"{u}/chip": i["fits"]}]
        srows = [{"what": what, "value": _si(self.step.get(k), unit)} for what, k, unit in _STEP]
        srows.append({"what": "tokens per step (global batch x seq len)",
                      "value": str(self.step["tokens"])})
        return "\n".join(lines + [
            "per chip, XLA memory analysis of the compiled step:",
            common.format_table(xrows, ["what", f"{u}/chip"]), "",
            "per step, one chip's partitioned program:",
            common.format_table(srows, ["what", "value"])])

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _si(v, unit: str) -> str:
    """``1.23 TFLOP`` / ``45.6 GB`` (decimal prefixes); "n/a" for None."""
    if v is None:
        return "n/a"
    p, f = next(((p, f) for p, f in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6),
                                      ("k", 1e3)) if abs(v) >= f), ("", 1))
    return f"{v / f:,.2f} {p}{unit}"


def _cost(compiled) -> dict:
    """flops and bytes accessed, or None each where the backend reports none (a list of
    per-computation dicts in older jax, one dict now)."""
    ca = compiled.cost_analysis()
    ca = (ca[0] if ca else None) if isinstance(ca, (list, tuple)) else ca
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
    from jspec.train.drafter import default_loss
    from jspec.train.trainer import TrainConfig, make_train_step
    data, model = mesh.shape["data"], mesh.shape["model"]
    fsdp = data > 1 if fsdp is None else fsdp
    batch = default_batch(data) if batch is None else batch
    if batch % data:
        raise ValueError(f"batch {batch} does not split over data={data}")
    tc = TrainConfig(batch_size=batch, online=True, topk=topk, fsdp=fsdp)
    lc = default_loss(kind)
    module, args, state_sh, memory = abstract_step_inputs(cfg, kind, mesh, tc, draft_vocab,
                                                          seq_len)
    dev = mesh.devices.flat[0]
    info = {"config": f"{cfg.num_layers}L h{cfg.hidden_size} V{cfg.vocab_size}",
            "dtype": cfg.dtype, "drafter": kind, "draft_vocab": getattr(module, "draft_vocab",
                                                                       None),
            "mesh": f"{data}x{model}", "fsdp": fsdp, "batch": batch,
            "rows_per_data_shard": batch // data, "seq_len": seq_len, "unroll": lc.unroll,
            "topk": topk, "chip": getattr(dev, "device_kind", "?"),
            "hbm_bytes": aot.hbm_bytes(dev)}
    _, step = make_train_step(module, cfg, lc, tc, state_sh, mesh)
    if log:
        log(f"lowering and compiling one training step for a {data}x{model} mesh ...")
    xla, cost = _compile_and_read(step, args, info)
    return TrainPlan(info, memory, xla, {**cost, "tokens": batch * seq_len})


def abstract_step_inputs(cfg, kind: str, mesh, tc, draft_vocab: int, seq_len: int):
    """``(module, (state, frozen, t2d, target params, batch), state shardings, memory rows)``:
    the step's arguments as the trainer places them, as ShapeDtypeStructs, and one row of
    per-device bytes for each of them."""
    from jspec import llama
    from jspec.target import param_shardings
    from jspec.train.drafter import split_params
    from jspec.train.trainer import fresh_state
    from jspec.train.placement import batch_shardings, state_shardings
    repl = NamedSharding(mesh, P())
    memory = []
    add = lambda what, tree, sh: memory.append(_row(what, tree, sh))
    # The target as the trainer holds it: checkpoint layout, sharded over model.
    tsh = param_shardings(cfg, mesh)
    tparams = aot.with_shardings(nn.unbox(llama.abstract_params(cfg)), tsh)
    add("target params", tparams, tsh)
    # The drafter as build_drafter makes it, split and placed as train() does.
    module, dparams = abstract_train_drafter(kind, cfg, draft_vocab, **drafter_arch(kind, cfg))
    trainable, frozen = split_params(dparams)
    state = jax.eval_shape(lambda p: fresh_state(p, tc), trainable)       # fp32 master weights
    state_sh = state_shardings(state, mesh, tc.fsdp)
    state = aot.with_shardings(state, state_sh)
    add(f"{kind} params (trained)", state.params, state_sh.params)
    rest = lambda t: (t.opt_state, t.step, t.key, t.data_pos)
    add("optimizer state (AdamW; step, key)", rest(state), rest(state_sh))
    fsh = jax.tree.map(lambda _: repl, frozen)
    frozen = aot.with_shardings(frozen, fsh)
    # t2d [V]: the map's inverse (trainer.draft_t2d), replicated; none without a map.
    t2d = None
    if jax.tree.leaves(frozen):
        t2d = jax.ShapeDtypeStruct((cfg.vocab_size,), jnp.int32, sharding=repl)
        add(f"{kind} maps (d2t, t2d)", (frozen, t2d), (fsh, repl))
    B = tc.batch_size
    b = {"tokens": jax.ShapeDtypeStruct((B, seq_len), jnp.int32),
         "lens": jax.ShapeDtypeStruct((B,), jnp.int32),
         "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}
    bsh = batch_shardings(b, mesh)
    b = aot.with_shardings(b, bsh)
    add("batch (tokens, lens, rng)", b, bsh)
    return module, (state, frozen, t2d, tparams, b), state_sh, memory


def _row(what: str, tree, shardings) -> dict:
    leaves, shards = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    specs = {str(s.spec) for s in shards}
    dtypes = {np.dtype(a.dtype).name for a in leaves}
    return {"what": what, "dtype": dtypes.pop() if len(dtypes) == 1 else "mixed",
            "spec": specs.pop() if len(specs) == 1 else "per leaf", "leaves": len(leaves),
            "bytes_per_device": _bytes(tree, shardings), "bytes_total": _bytes(tree),
            "bytes_replicated": _bytes(tree, shardings, only_replicated=True)}


def _compile_and_read(step, args, info: dict) -> tuple[dict, dict]:
    """Compile ``step(*args)``; ``(XLA memory analysis, cost)``, ``info`` updated with the
    compile time and whether it fits (``"no"`` with the compiler's message when it refuses
    for lack of memory)."""
    t0 = time.perf_counter()
    try:
        compiled = step.lower(*args).compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # The plan's answer, not a crash: the step does not fit the chip's memory.
        info.update(fits="no", compile_s=round(time.perf_counter() - t0, 1),
                    compile_error=str(e).splitlines()[0][:400])
        return {}, {}
    info["compile_s"] = round(time.perf_counter() - t0, 1)
    m, xla = compiled.memory_analysis(), {}
    if m is not None:
        xla = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
               "aliased (donated state)": m.alias_size_in_bytes,
               "temporaries (activations)": m.temp_size_in_bytes,
               "generated code": m.generated_code_size_in_bytes, "peak": aot.used_bytes(m)}
    peak, hbm = xla.get("peak"), info["hbm_bytes"]
    info["fits"] = "n/a" if hbm is None or peak is None else ("yes" if peak <= hbm else "no")
    if hbm and peak is not None:
        info["peak_of_hbm"] = round(peak / hbm, 3)
    return xla, {**_cost(compiled), **_weighted(compiled)}


def _weighted(compiled) -> dict:
    """Read from the optimized HLO, every loop counted by its trip count (the target's
    scanned layer stack L times, where ``cost_analysis`` counts its body once): the matmul
    flops (:func:`matmul_flops`) and the kernels' HBM bytes
    (:func:`benchmarks.hlo_bytes.kernel_bytes`); None where the text does not parse."""
    from benchmarks.hlo_bytes import kernel_bytes
    try:
        text = compiled.as_text()
        mm = matmul_flops(text)
        return {"matmul_flops_weighted": mm["weighted"] or None,
                "matmul_flops_once": mm["once"] or None,
                "io_bytes_weighted": kernel_bytes(text)["weighted"] or None}
    except Exception:                     # noqa: BLE001 (a format the parser does not know)
        return {"matmul_flops_weighted": None, "matmul_flops_once": None,
                "io_bytes_weighted": None}


def matmul_flops(text: str) -> dict:
    """Flops of every ``dot`` and ``convolution`` (XLA:TPU writes dots as convolutions) of an
    optimized module, top level or fused: ``once`` (each loop body once, like XLA's cost
    analysis) and ``weighted`` by the trip counts of the enclosing while loops
    (:func:`benchmarks.hlo.loop_trips`: XLA's ``known_trip_count``, or a ``compare(i, N)``
    condition as XLA:TPU leaves it). A dot: 2 x result elements x contracted size. A
    convolution as XLA's cost analysis counts it: 2 x (input features / feature groups) x
    output features x (batch / batch groups) x, per spatial dimension, the (output, kernel)
    position pairs that land on a real (not padding, not dilation) input element."""
    from benchmarks.hlo import operand_names, parse_hlo, shape_key, weighted_walk
    comps, entry = parse_hlo(text)
    shapes = {c: {i.name: i.shape for i in ins} for c, ins in comps.items()}
    out = {"once": 0.0, "weighted": 0.0}

    def visit(name, ins, mult, first):
        if ins.opcode not in ("dot", "convolution"):
            return
        ops = operand_names(ins.attrs)
        keys = [shape_key(shapes[name].get(o, "")) for o in ops[:2]]
        res = shape_key(ins.shape)
        if len(keys) < 2 or None in keys or res is None:
            return
        f = (_dot_flops(ins.attrs, keys[0][1], res[1]) if ins.opcode == "dot" else
             _conv_flops(ins.attrs, keys[0][1], keys[1][1], res[1]))
        if f:
            out["weighted"] += f * mult
            out["once"] += f if first else 0.0

    weighted_walk(comps, entry, out, visit, into_fusions=True)
    return out


def _dot_flops(attrs: str, lhs, res) -> float | None:
    import re
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
    if not m:
        return None
    k = int(np.prod([lhs[int(d)] for d in m.group(1).split(",") if d]))
    return 2.0 * int(np.prod(res)) * k


def _conv_flops(attrs: str, lhs, rhs, res) -> float | None:
    import re
    m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
    if not m:
        return None
    ll, rl, ol = m.groups()
    n = sum(c.isdigit() for c in ll)
    win = {}
    w = re.search(r"window=\{([^}]*)\}", attrs)
    for part in (w.group(1).split() if w else []):
        key, _, val = part.partition("=")
        win[key] = val.split("x")
    get = lambda key, d, default: int(win[key][d]) if key in win else default
    pairs = 1
    for d in range(n):
        I, K, O = lhs[ll.index(str(d))], rhs[rl.index(str(d))], res[ol.index(str(d))]
        stride, ld, rd = get("stride", d, 1), get("lhs_dilate", d, 1), get("rhs_dilate", d, 1)
        lo = int(win["pad"][d].split("_")[0]) if "pad" in win else 0
        if O * K > 5e7:                       # too many to enumerate: every pair
            pairs *= O * K
            continue
        pos = np.arange(O)[:, None] * stride - lo + np.arange(K)[None, :] * rd
        pairs *= int(np.count_nonzero((pos >= 0) & (pos < (I - 1) * ld + 1) & (pos % ld == 0)))
    group = lambda key: int(g.group(1)) if (g := re.search(key + r"=(\d+)", attrs)) else 1
    fin, fout, b = lhs[ll.index("f")], res[ol.index("f")], lhs[ll.index("b")]
    return 2.0 * (fin // group("feature_group_count")) * fout * (b // group("batch_group_count")) \
        * pairs


# ------------------------------------------------------------------ CLI (from plan.py)
def run(args, mesh, name: str, topology: str | None, platform: str) -> dict:
    """``plan --train``: called by :func:`benchmarks.plan.main` in its child, with the mesh
    (simulated CPU devices or a topology's abstract chips) and the platform to trace for."""
    from jspec.bench import configs
    from jspec.platform import building_for
    cfg = configs.random_config(name, args.dtype or configs.natural_dtype(name))
    dv = DEFAULT_DRAFT_VOCAB if args.draft_vocab is None else args.draft_vocab
    with building_for(platform):
        p = train_plan(cfg, args.drafter, mesh, batch=args.batch, seq_len=args.seq_len,
                       draft_vocab=dv, fsdp=args.fsdp, log=lambda s: print(s, flush=True))
    print(f"# train plan: {name}, {args.drafter}, mesh {args.mesh} (DATAxMODEL), traced for "
          f"{platform}" + (f", compiled for {topology} (deviceless)" if topology
                           else ", CPU devices"))
    print(p.render())
    if args.json:
        common.write_json(args.json, p.as_dict())
    return p.as_dict()
