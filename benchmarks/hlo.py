"""Reading an optimized HLO module's text (``compiled.as_text()``): its computations and
instructions (:func:`parse_hlo`), kernel counts (:func:`count_kernels`), ``dot`` flops
weighted by the trip counts of their loops (:func:`dot_flops`), while-loop trip counts, the
generate loop's body (:func:`decode_loop_body`) and the HLO shapes of a KV pool
(:func:`pool_key`). :mod:`benchmarks.hlo_bytes` counts HBM bytes with the same reading and
:mod:`benchmarks.collectives` the collectives of one iteration; :mod:`benchmarks.anatomy`
and :mod:`benchmarks.plan` report them.

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

from jspec.llama import LAYER_SCOPE, LAYER_SCOPE_REST

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


def callees(attrs: str, keys) -> list[str]:
    out = []
    for k in keys:
        for m in re.finditer(rf"\b{k}=(\{{[^}}]*\}}|%?[^\s,]+)", attrs):
            v = m.group(1).strip("{}")
            out += [x.strip().lstrip("%") for x in v.split(",") if x.strip()]
    return out


def shape_key(shape: str) -> tuple[str, tuple[int, ...]] | None:
    """``(element type, dims)`` of an array shape's text (layout dropped)."""
    m = re.match(r"^([a-z]+\d*(?:e\d+m\d+[a-z]*)?)\[([\d,]*)\]", shape)
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


def loop_trips(attrs: str, comps) -> int | None:
    """A while loop's trip count: XLA's ``known_trip_count`` (CPU), else the loop bound of a
    condition that is one ``compare(i, constant(N)), direction=LT`` (TPU drops the former)."""
    n = _trip_count(attrs)
    if n is not None:
        return n
    cond = callees(attrs, ("condition",))
    instrs = comps.get(cond[0], []) if cond else []
    consts = {i.name: re.match(r"\((-?\d+)\)", i.attrs) for i in instrs if i.opcode == "constant"}
    for i in instrs:
        if i.opcode == "compare" and "direction=LT" in i.attrs:
            ops = operand_names(i.attrs)
            if len(ops) == 2 and consts.get(ops[1]):
                return int(consts[ops[1]].group(1))
    return None


def _biggest_branch(attrs: str, totals: dict, key: str, seen: set, visit) -> None:
    """Walk a conditional's branches (``visit(name)`` adds into ``totals``) and keep the
    totals of the branch with the biggest ``totals[key]``: one branch runs. Each branch is
    walked from the same totals, and forgotten by ``seen`` so another conditional calling
    the same computation counts it too."""
    before, best = dict(totals), None
    for c in callees(attrs, ("true_computation", "false_computation", "branch_computations")):
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
    what one layer costs; 0 for an unrolled stack).

    A layer stack that stops where aux states are read runs as several loops over the same
    body (:func:`jspec.llama.forward`): its first loop (named ``LAYER_SCOPE``) counts as the
    stack's layer body, as one loop would, and the later ones (``LAYER_SCOPE_REST``) only
    for pool copies."""
    comps, entry = parse_hlo(text)
    pools = set(pool_shapes)
    counts = {"kernels": 0, "fusions": 0, "custom_calls": 0, "unfused_dots": 0, "unfused_copies": 0,
              "other_unfused": 0, "while_loops": 0, "pool_copies": 0, "pool_kernels": 0,
              "layer_body": 0}
    seen_control, seen_fused = set(), set()

    def fused(name):                      # for pool copies only: a fusion's computations,
        if name in seen_fused or name not in comps:     # or a repeated layer body and all
            return                                      # it calls
        seen_fused.add(name)
        for ins in comps[name]:
            if ins.opcode in ("copy", "copy-start") and shape_key(ins.shape) in pools:
                counts["pool_copies"] += 1
            for c in callees(ins.attrs, ("calls",) + CONTROL_ATTRS + ("to_apply",)):
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
                layer_loop = op == "while" and num_layers is not None and (
                    loop_trips(ins.attrs, comps) == num_layers or f"{LAYER_SCOPE}/" in ins.attrs)
                if op == "while" and f"{LAYER_SCOPE_REST}/" in ins.attrs:
                    for c in callees(ins.attrs, CONTROL_ATTRS):   # counted in the first loop
                        fused(c)
                    continue
                for c in callees(ins.attrs, CONTROL_ATTRS + ("to_apply",)):
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
            if op in ("copy", "copy-start") and shape_key(ins.shape) in pools:
                counts["pool_copies"] += 1
            if any(shape_key(x) in pools for x in re.findall(r"[a-z]+\d*(?:e\d+m\d+[a-z]*)?\[[\d,]*\]", ins.shape)):
                counts["pool_kernels"] += 1
            for c in callees(ins.attrs, ("calls",)):
                fused(c)

    control(entry)
    return counts


def operand_names(attrs: str) -> list[str]:
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

    def visit(name, ins, mult, first):
        if ins.opcode != "dot":
            return
        ops = operand_names(ins.attrs)
        lhs = shape_key(shapes[name].get(ops[0], "")) if ops else None
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        res = shape_key(ins.shape)
        if lhs and m and res:
            k = int(np.prod([lhs[1][int(d)] for d in m.group(1).split(",") if d]))
            f = 2.0 * int(np.prod(res[1])) * k
            out["weighted"] += f * mult
            out["once"] += f if first else 0.0

    weighted_walk(comps, entry, out, visit, into_fusions=True,
                  trips=lambda attrs, comps: _trip_count(attrs))
    return out


def weighted_walk(comps: dict, root: str, totals: dict, visit, *, into_fusions: bool,
                  trips=loop_trips) -> None:
    """Call ``visit(computation, instruction, mult, first)`` on every instruction reached
    from ``root`` through while bodies and ``call`` targets (and fusions' computations when
    ``into_fusions``), ``mult`` the product of the enclosing loops' ``trips`` (1 when
    unknown) and ``first`` whether this is the first visit of each enclosing body. Of a
    conditional's branches only the one that adds most to ``totals["weighted"]`` is kept
    (one branch runs). ``visit`` adds into ``totals`` (keys ``once`` and ``weighted``)."""
    seen = set()
    into = ("body", "calls") if into_fusions else ("body",)

    def walk(name, mult, first):
        if name not in comps:
            return
        first = first and name not in seen
        seen.add(name)
        for ins in comps[name]:
            if ins.opcode == "conditional":
                _biggest_branch(ins.attrs, totals, "weighted", seen,
                                lambda c: walk(c, mult, first))
                continue
            visit(name, ins, mult, first)
            n = (trips(ins.attrs, comps) or 1) if ins.opcode == "while" else 1
            for c in callees(ins.attrs, into):
                walk(c, mult * n, first)
            if ins.opcode == "call":
                for c in callees(ins.attrs, ("to_apply",)):
                    walk(c, mult, first)

    walk(root, 1, True)


def prefill_loop_body(comps: dict, entry: str, trips: int) -> str | None:
    """The body of the chunked prefill's scan (:mod:`jspec.prefill`): the ENTRY ``while``
    that runs ``trips`` times (the prompt's chunks after the first), the biggest if several;
    None without one (a prompt of one chunk)."""
    loops = [i for i in comps[entry] if i.opcode == "while"
             and loop_trips(i.attrs, comps) == trips]
    if not loops or trips < 1:
        return None
    return max((callees(i.attrs, ("body",))[0] for i in loops),
               key=lambda c: len(comps.get(c, [])))


def decode_loop_body(comps: dict, entry: str) -> str | None:
    """The body of the generate loop: of the ENTRY computation's ``while`` loops, the one
    without a fixed trip count (it runs until every row is done; a prefill's scanned layer
    stack also sits in ENTRY, with its trip count), the biggest if several; None without
    one."""
    loops = [i for i in comps[entry] if i.opcode == "while"]
    if not loops:
        return None
    open_ended = [i for i in loops if loop_trips(i.attrs, comps) is None]
    return max((callees(i.attrs, ("body",))[0] for i in (open_ended or loops)),
               key=lambda c: len(comps.get(c, [])))
