"""Reading an optimized HLO module's text (``compiled.as_text()``): its computations and
instructions (:func:`parse_hlo`), kernel counts (:func:`count_kernels`), ``dot`` flops
weighted by the trip counts of their loops (:func:`dot_flops`), while-loop trip counts and
the HLO shapes of a KV pool (:func:`pool_key`). :mod:`jspec.bench.anatomy` reports these
per compiled program; :mod:`jspec.bench.plan` walks the same computations for collectives.

**Counting rule (kernels).** The module is walked from ``ENTRY`` through the control-flow
computations only: while bodies and conditions, conditional branches and ``call`` targets.
**Each of those computations is counted once**, however many times it runs (a ``lax.scan``
of S-1 draft steps contributes its body once; so does the cost analysis, which also
counts a while body once). Of a conditional's branches only the biggest counts, since one
runs (the reference attention's live-length buckets are such branches). Every instruction
of a control-flow computation is one kernel, except the ones that move no data or only hand
control on: ``parameter``, ``constant``, ``get-tuple-element``, ``tuple``, ``bitcast``,
``while`` / ``conditional`` / ``call`` (their bodies are walked instead), ``after-all``,
``add-dependency``, ``opt-barrier``, ``domain``, ``partition-id``, ``replica-id`` and the
``*-done`` / ``*-update`` halves of async pairs. So a fusion is one kernel whatever it contains, a custom-call is one, and
so are a dot, convolution, copy, scatter, gather, sort, dynamic-update-slice ... left
outside any fusion. Computations reached through ``calls=`` of a fusion (or an async
start) or ``to_apply=`` (reducers, scatter combiners, sort comparators) are parts of
their parent kernel and are not counted; fused computations are only read for
``pool_copies``. On CPU the backend also wraps single elementwise ops in fusions
("wrapped_*"), each one kernel by this rule; counts are comparable across commits on one
backend, not across backends.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

_HLO_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64",
              "int32": "s32", "int8": "s8", "uint8": "u8", "int64": "s64"}
NON_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
              "conditional", "call", "after-all", "add-dependency", "opt-barrier", "domain",
              "partition-id", "replica-id"}
CONTROL_ATTRS = ("body", "condition", "true_computation", "false_computation")


@dataclasses.dataclass
class Instr:
    name: str
    shape: str        # text of the result shape, layout included
    opcode: str
    attrs: str        # everything after the operand list


def _split_shape(rest: str) -> tuple[str, str]:
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str]:
    """``({computation name: instructions}, entry name)`` from an HLO module's text."""
    comps: dict[str, list[Instr]] = {}
    entry, cur = None, None
    header = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
    for line in text.splitlines():
        if cur is None:
            m = header.match(line)
            if m:
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
            continue
        s = line.strip()
        if s == "}" or s.startswith("}, "):     # TPU v5p: "}, execution_thread=..." (SparseCore)
            cur = None
            continue
        if " = " not in s:
            continue
        if s.startswith("ROOT "):
            s = s[5:]
        name, rest = s.split(" = ", 1)
        shape, tail = _split_shape(rest)
        m = re.match(r"([\w\-]+)", tail)
        if not m:
            continue
        comps[cur].append(Instr(name.lstrip("%"), shape, m.group(1), tail[m.end():]))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _called(attrs: str, keys) -> list[str]:
    out = []
    for k in keys:
        for m in re.finditer(rf"\b{k}=(\{{[^}}]*\}}|%?[^\s,]+)", attrs):
            v = m.group(1).strip("{}")
            out += [x.strip().lstrip("%") for x in v.split(",") if x.strip()]
    return out


def _shape_key(shape: str) -> tuple[str, tuple[int, ...]] | None:
    """``(element type, dims)`` of an array shape's text (layout dropped)."""
    m = re.match(r"^([a-z]+\d*)\[([\d,]*)\]", shape)
    if not m:
        return None
    return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


def pool_key(x) -> list[tuple[str, tuple[int, ...]]]:
    """The views of a KV pool ``[L, KVH, P, page_size, D]`` that XLA works on: the pool
    itself, ``[L, KVH, P*page_size, D]`` (slots flattened), ``[L*KVH, P, page_size, D]``,
    ``[L*KVH*P*page_size, D]`` (rows: how XLA:TPU lays out the commit's and the drafter's
    per-row scatters) and fully flat. Only whole pools match: a one-layer slice of a deeper
    pool, or a gather of some rows' pages, has other dims even when its element count equals
    a 1-layer pool's."""
    t = _HLO_TYPES[np.dtype(x.dtype).name]
    L, H, P, ps, D = x.shape
    views = {(L, H, P, ps, D), (L, H, P * ps, D), (L * H, P, ps, D), (L * H * P * ps, D),
             (L * H * P * ps * D,)}
    return [(t, v) for v in views]


def _trip_count(attrs: str) -> int | None:
    t = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
    return int(t.group(1)) if t else None


def _loop_trips(attrs: str, comps) -> int | None:
    """A while loop's trip count: XLA's ``known_trip_count`` (CPU), else the loop bound of a
    condition that is one ``compare(i, constant(N)), direction=LT`` (TPU drops the former)."""
    n = _trip_count(attrs)
    if n is not None:
        return n
    cond = _called(attrs, ("condition",))
    instrs = comps.get(cond[0], []) if cond else []
    consts = {i.name: re.match(r"\((-?\d+)\)", i.attrs) for i in instrs if i.opcode == "constant"}
    for i in instrs:
        if i.opcode == "compare" and "direction=LT" in i.attrs:
            ops = _operands(i.attrs)
            if len(ops) == 2 and consts.get(ops[1]):
                return int(consts[ops[1]].group(1))
    return None


def _biggest_branch(attrs: str, totals: dict, key: str, seen: set, visit) -> None:
    """Walk a conditional's branches (``visit(name)`` adds into ``totals``) and keep the
    totals of the branch with the biggest ``totals[key]``: one branch runs. Each branch is
    walked from the same totals, and forgotten by ``seen`` so another conditional calling
    the same computation counts it too."""
    before, best = dict(totals), None
    for c in _called(attrs, ("true_computation", "false_computation", "branch_computations")):
        totals.update(before)
        visit(c)
        seen.discard(c)
        if best is None or totals[key] > best[key]:
            best = dict(totals)
    totals.update(best or before)


def count_kernels(text: str, pool_shapes=(), num_layers: int | None = None) -> dict:
    """Kernel counts of an optimized HLO module by the rule in the module docstring, and
    ``pool_copies``: copies (anywhere, fusions included) with a result in ``pool_shapes``
    (``(hlo element type, dims)`` pairs, see :func:`pool_key`). ``layer_body``: kernels in
    the bodies of while loops that run ``num_layers`` times (a scanned layer stack's body:
    what one layer costs; 0 for an unrolled stack)."""
    comps, entry = parse_hlo(text)
    pools = set(pool_shapes)
    counts = {"kernels": 0, "fusions": 0, "custom_calls": 0, "unfused_dots": 0, "unfused_copies": 0,
              "other_unfused": 0, "while_loops": 0, "pool_copies": 0, "pool_kernels": 0,
              "layer_body": 0}
    seen_control, seen_fused = set(), set()

    def fused(name):                      # read a fusion's computations for pool copies only
        if name in seen_fused or name not in comps:
            return
        seen_fused.add(name)
        for ins in comps[name]:
            if ins.opcode in ("copy", "copy-start") and _shape_key(ins.shape) in pools:
                counts["pool_copies"] += 1
            for c in _called(ins.attrs, ("calls",)):
                fused(c)

    def control(name, in_layer=False):
        if name in seen_control or name not in comps:
            return
        seen_control.add(name)
        for ins in comps[name]:
            op = ins.opcode
            if op == "while":
                counts["while_loops"] += 1
            if op == "conditional":
                _biggest_branch(ins.attrs, counts, "kernels", seen_control,
                                lambda c: control(c, in_layer))
                continue
            if op in ("while", "call"):
                layer_loop = (op == "while" and num_layers is not None
                              and _loop_trips(ins.attrs, comps) == num_layers)
                for c in _called(ins.attrs, CONTROL_ATTRS + ("to_apply",)):
                    control(c, in_layer or layer_loop)
                continue
            if op in NON_KERNEL or op.endswith("-done") or op.endswith("-update"):
                continue
            counts["kernels"] += 1
            counts["layer_body"] += in_layer
            if op == "fusion":
                counts["fusions"] += 1
            elif op == "custom-call":
                counts["custom_calls"] += 1
            elif op in ("dot", "convolution"):
                counts["unfused_dots"] += 1
            elif op == "copy":
                counts["unfused_copies"] += 1
            else:
                counts["other_unfused"] += 1
            if op in ("copy", "copy-start") and _shape_key(ins.shape) in pools:
                counts["pool_copies"] += 1
            if any(_shape_key(x) in pools for x in re.findall(r"[a-z]+\d*\[[\d,]*\]", ins.shape)):
                counts["pool_kernels"] += 1
            for c in _called(ins.attrs, ("calls",)):
                fused(c)

    control(entry)
    return counts


def _operands(attrs: str) -> list[str]:
    """Operand names of an instruction (``attrs`` starts at its operand list)."""
    depth = 0
    for i, ch in enumerate(attrs):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return re.findall(r"%([\w.\-]+)", attrs[:i + 1])
    return []


def dot_flops(text: str) -> dict:
    """Flops of every ``dot`` (top level or fused), ``once`` (each loop body once, like XLA's
    cost analysis) and ``weighted`` by the known trip counts of the enclosing while loops
    (a loop without a known trip count weighs 1); of a conditional's branches only the
    biggest counts. 2 * result elements * contracted size."""
    comps, entry = parse_hlo(text)
    shapes = {c: {i.name: i.shape for i in ins} for c, ins in comps.items()}
    out = {"once": 0.0, "weighted": 0.0}
    seen = set()

    def walk(name, mult, first):
        if name not in comps:
            return
        first = first and name not in seen
        seen.add(name)
        for ins in comps[name]:
            if ins.opcode == "dot":
                ops = _operands(ins.attrs)
                lhs = _shape_key(shapes[name].get(ops[0], "")) if ops else None
                m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
                res = _shape_key(ins.shape)
                if lhs and m and res:
                    k = int(np.prod([lhs[1][int(d)] for d in m.group(1).split(",") if d]))
                    f = 2.0 * int(np.prod(res[1])) * k
                    out["weighted"] += f * mult
                    out["once"] += f if first else 0.0
            if ins.opcode == "conditional":
                _biggest_branch(ins.attrs, out, "weighted", seen,
                                lambda c: walk(c, mult, first))
                continue
            n = (_trip_count(ins.attrs) or 1) if ins.opcode == "while" else 1
            for c in _called(ins.attrs, ("body", "calls")):
                walk(c, mult * n, first)
            if ins.opcode == "call":
                for c in _called(ins.attrs, ("to_apply",)):
                    walk(c, mult, first)

    walk(entry, 1, True)
    return out


# ------------------------------------------------------------------ HBM bytes per kernel
_IN_PLACE = ("dynamic-update-slice", "scatter")
_PARTIAL_READ = ("dynamic-slice", "slice", "gather")
_TYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
               "pred": 1, "s64": 8, "u64": 8, "s16": 2, "u16": 2, "s4": 0.5, "u4": 0.5}


def _hbm_bytes(shape: str) -> float:
    """Bytes of a (tuple) shape's arrays, leaving out those XLA:TPU placed in VMEM
    (layout memory space ``S(1)``: prefetched copies, not HBM traffic)."""
    total = 0.0
    for m in re.finditer(r"([a-z]+\d*)\[([\d,]*)\](\{[^}]*\})?", shape):
        if m.group(3) and "S(1)" in m.group(3):
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        total += _TYPE_BYTES.get(m.group(1), 4) * float(np.prod(dims, dtype=np.float64))
    return total


def _param_index(ins: Instr) -> int | None:
    m = re.match(r"\((\d+)\)", ins.attrs)
    return int(m.group(1)) if m else None


def _fusion_io(comps: dict, comp: list[Instr], operand_bytes: list[float],
               result_bytes: float) -> float:
    """HBM bytes of one fusion: a parameter only sliced, dynamically sliced or gathered
    (also inside nested fusions, as XLA:TPU nests them) is charged what those read; a
    parameter that a root dynamic-update-slice / scatter updates in place is charged
    nothing, and that output its update instead of the whole buffer."""
    by_name = {i.name: i for i in comp}
    root = comp[-1] if comp else None

    def through_bitcasts(name):
        ins = by_name.get(name)
        while ins is not None and ins.opcode == "bitcast":
            ins = by_name.get(_operands(ins.attrs)[0])
        return ins

    outs = ([through_bitcasts(o) for o in _operands(root.attrs)] if root is not None
            and root.opcode == "tuple" else [through_bitcasts(root.name)] if root else [])
    in_place, written = set(), 0.0
    for o in outs:
        if o is not None and o.opcode in _IN_PLACE:
            ops = _operands(o.attrs)
            tgt = through_bitcasts(ops[0])
            if tgt is not None and tgt.opcode == "parameter":
                in_place.add(tgt.name)
                upd = by_name.get(ops[1] if o.opcode == "dynamic-update-slice" else ops[-1])
                written += _hbm_bytes(upd.shape) if upd is not None else 0.0
                result_bytes -= _hbm_bytes(o.shape)
    total = max(result_bytes, 0.0) + written
    for ins in comp:
        if ins.opcode == "parameter" and ins.name not in in_place:
            idx = _param_index(ins)
            full = operand_bytes[idx] if idx is not None and idx < len(operand_bytes) else 0.0
            total += _param_read(comps, comp, ins.name, full)
    return total


def _param_read(comps: dict, comp: list[Instr], name: str, full: float) -> float:
    """Bytes a fused computation reads of its parameter ``name`` (``full``: all of it)."""
    users: list[tuple[Instr, int]] = []
    todo = [name]
    while todo:                           # users, looking through bitcasts
        n = todo.pop()
        if comp and comp[-1].name == n:   # handed on whole (a nested fusion's root)
            return full
        for u in comp:
            for k, o in enumerate(_operands(u.attrs)):
                if o == n:
                    if u.opcode == "bitcast":
                        todo.append(u.name)
                    else:
                        users.append((u, k))
    read = 0.0
    for u, k in users:
        if u.opcode in _PARTIAL_READ and k == 0:
            read += _hbm_bytes(u.shape)
        elif u.opcode == "fusion" and _called(u.attrs, ("calls",))[0] in comps:
            inner = comps[_called(u.attrs, ("calls",))[0]]
            p = next((i for i in inner if i.opcode == "parameter" and _param_index(i) == k), None)
            read += _param_read(comps, inner, p.name, full) if p is not None else full
        else:
            return full
    return min(full, read)


def decode_loop_body(comps: dict, entry: str) -> str | None:
    """The body of the generate loop: of the ENTRY computation's ``while`` loops, the one
    without a fixed trip count (it runs until every row is done; a prefill's scanned layer
    stack also sits in ENTRY, with its trip count), the biggest if several; None without
    one."""
    loops = [i for i in comps[entry] if i.opcode == "while"]
    open_ended = [i for i in loops if _loop_trips(i.attrs, comps) is None]
    if not loops:
        return None
    return max((_called(i.attrs, ("body",))[0] for i in (open_ended or loops)),
               key=lambda c: len(comps.get(c, [])))


def kernel_bytes(text: str, pool_layers: dict | None = None, detail: list | None = None,
                 root: str | None = None) -> dict:
    """HBM bytes the kernels of an optimized module read and write, by the kernel rule of
    :func:`count_kernels`, ``weighted`` by the trip counts of their loops (a scanned layer
    stack counts ``L`` times, the draft scan ``S - 1`` times; a loop of unknown trip count,
    like the decode loop, once) and ``once`` (each body once, as XLA's cost analysis).

    A kernel is charged its operands and results, except: what a fusion only slices or
    gathers is charged the slice; a dynamic-update-slice or scatter (fused or not) updating
    a buffer in place is charged its update, not the buffer; a custom call's operand that
    it aliases to an output (``output_to_operand_aliasing``: the Pallas KV write) is charged
    nothing either way, its other operands in full and once each, except a KV pool: ``pool_layers`` maps
    a pool's views (:func:`pool_key`) to its number of layers, and a custom call handed a
    pool is charged one layer of it (the Pallas attention kernels read one layer's pages per
    call, up to the live length: at a full cache that is the layer's share of the pool).
    Arrays placed in VMEM (TPU ``S(1)``) are not HBM traffic. Unlike XLA's "bytes accessed"
    this sees into Pallas kernels' operands and does not charge in-place writes the pool, so
    programs with and without kernels compare. ``detail``: a list that receives
    ``(weighted bytes, computation, instruction, opcode, result shape)`` per kernel.
    ``root``: count from this computation instead of ENTRY (``"decode loop"``: one iteration
    of the generate loop, :func:`decode_loop_body`)."""
    comps, entry = parse_hlo(text)
    if root == "decode loop":
        root = decode_loop_body(comps, entry)
        if root is None:
            return {"once": float("nan"), "weighted": float("nan")}
    shapes = {c: {i.name: i.shape for i in ins} for c, ins in comps.items()}
    out = {"once": 0.0, "weighted": 0.0}
    seen = set()

    def charge(comp_name: str, ins: Instr) -> float:
        ops = _operands(ins.attrs)
        ob = [_hbm_bytes(shapes[comp_name].get(o, "")) for o in ops]
        rb = _hbm_bytes(ins.shape)
        op = ins.opcode
        if op == "fusion":
            called = _called(ins.attrs, ("calls",))
            if called and called[0] in comps:
                return _fusion_io(comps, comps[called[0]], ob, rb)
        if op == "dynamic-update-slice" and len(ob) >= 2:
            return 2 * ob[1] + sum(ob[2:])
        if op == "scatter" and len(ob) >= 3:
            return 2 * ob[-1] + sum(ob[1:-1])
        if op in _PARTIAL_READ:
            return 2 * rb + sum(ob[1:])
        if op == "custom-call":
            for k, o in enumerate(ops):
                layers = (pool_layers or {}).get(_shape_key(shapes[comp_name].get(o, "")))
                if layers:
                    ob[k] /= layers
                if o in ops[:k]:                   # one buffer handed in several times (the
                    ob[k] = 0.0                    # Pallas kernels' page-prefetch slots)
            at = ins.attrs.find("output_to_operand_aliasing=")
            pairs = re.findall(r"\{([\d,]*)\}:\s*\((\d+),", ins.attrs[at:]) if at >= 0 else []
            if pairs:
                skip = {int(i) for _, i in pairs}
                outs = re.findall(r"[a-z]+\d*\[[\d,]*\](?:\{[^}]*\})?", ins.shape)
                whole = any(o == "" for o, _ in pairs)           # {}: the (only) output
                out_skip = {int(o.split(",")[0]) for o, _ in pairs if o}
                rb = 0.0 if whole else sum(_hbm_bytes(x) for k, x in enumerate(outs)
                                           if k not in out_skip)
                return rb + sum(b for k, b in enumerate(ob) if k not in skip)
        return rb + sum(ob)

    def walk(name, mult, first):
        if name not in comps:
            return
        first = first and name not in seen
        seen.add(name)
        for ins in comps[name]:
            op = ins.opcode
            if op == "conditional":
                _biggest_branch(ins.attrs, out, "weighted", seen, lambda c: walk(c, mult, first))
                continue
            if op in ("while", "call"):
                n = (_loop_trips(ins.attrs, comps) or 1) if op == "while" else 1
                for c in _called(ins.attrs, ("body", "to_apply") if op == "call" else ("body",)):
                    walk(c, mult * n, first)
                continue
            if op in NON_KERNEL or op.endswith("-done") or op.endswith("-update"):
                continue
            b = charge(name, ins)
            if detail is not None:
                detail.append((b * mult, name, ins.name, ins.opcode, ins.shape[:80]))
            out["weighted"] += b * mult
            out["once"] += b if first else 0.0

    walk(root or entry, 1, True)
    return out
