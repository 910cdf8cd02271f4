"""HBM bytes of a compiled program, kernel by kernel (:func:`kernel_bytes`), read from its
optimized HLO text with :mod:`benchmarks.hlo`'s parser and kernel rule. XLA's own "bytes
accessed" cannot compare decode programs: it charges an in-place KV write its whole pool,
a loop body once, and a Pallas kernel almost nothing. :mod:`benchmarks.anatomy` reports
these per program (``io_MB``), :mod:`benchmarks.plan` per device for one iteration of the
generate loop."""

from __future__ import annotations

import re

import numpy as np

from benchmarks.hlo import (NON_KERNEL, Instr, callees, decode_loop_body, operand_names,
                            parse_hlo, shape_key, weighted_walk)

_IN_PLACE = ("dynamic-update-slice", "scatter")
_PARTIAL_READ = ("dynamic-slice", "slice", "gather")
_TYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
               "pred": 1, "s64": 8, "u64": 8, "s16": 2, "u16": 2, "s4": 0.5, "u4": 0.5}
# An HLO element type, float8 / float4 ones included (f8e4m3fn, f8e5m2, f4e2m1fn, ...).
ELEMENT_TYPE = r"[a-z]+\d*(?:e\d+m\d+[a-z]*)?"


def type_bytes(t: str) -> float:
    """Bytes of one element of HLO type ``t`` (float8 types: 1; unknown: 4)."""
    if t.startswith("f8"):
        return 1
    if t.startswith("f4"):
        return 0.5
    return _TYPE_BYTES.get(t, 4)


def _hbm_bytes(shape: str) -> float:
    """Bytes of a (tuple) shape's arrays, leaving out those XLA:TPU placed in VMEM
    (layout memory space ``S(1)``: prefetched copies, not HBM traffic)."""
    total = 0.0
    for m in re.finditer(rf"({ELEMENT_TYPE})\[([\d,]*)\](\{{[^}}]*\}})?", shape):
        if m.group(3) and "S(1)" in m.group(3):
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        total += type_bytes(m.group(1)) * float(np.prod(dims, dtype=np.float64))
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
            ins = by_name.get(operand_names(ins.attrs)[0])
        return ins

    outs = ([through_bitcasts(o) for o in operand_names(root.attrs)] if root is not None
            and root.opcode == "tuple" else [through_bitcasts(root.name)] if root else [])
    in_place, written = set(), 0.0
    for o in outs:
        if o is not None and o.opcode in _IN_PLACE:
            ops = operand_names(o.attrs)
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
            for k, o in enumerate(operand_names(u.attrs)):
                if o == n:
                    if u.opcode == "bitcast":
                        todo.append(u.name)
                    else:
                        users.append((u, k))
    read = 0.0
    for u, k in users:
        if u.opcode in _PARTIAL_READ and k == 0:
            read += _hbm_bytes(u.shape)
        elif u.opcode == "fusion" and callees(u.attrs, ("calls",))[0] in comps:
            inner = comps[callees(u.attrs, ("calls",))[0]]
            p = next((i for i in inner if i.opcode == "parameter" and _param_index(i) == k), None)
            got = _param_read(comps, inner, p.name, full) if p is not None else full
            if got >= full and _same_dims(u.shape, p.shape if p is not None else ""):
                # A nested fusion handing on the whole parameter, element for element (XLA:TPU
                # relayouts a stacked int8 weight this way, in a copy fused into the matmul,
                # before slicing one layer out): it reads what its own result is read for.
                out = _hbm_bytes(u.shape)
                if out:
                    got = full * _param_read(comps, comp, u.name, out) / out
            read += got
        else:
            return full
    return min(full, read)


def _same_dims(a: str, b: str) -> bool:
    """Two array shapes' texts have the same dimensions (element type and layout aside)."""
    ka, kb = shape_key(a), shape_key(b)
    return ka is not None and kb is not None and ka[1] == kb[1]


def kernel_bytes(text: str, pool_layers: dict | None = None, detail: list | None = None,
                 root: str | None = None) -> dict:
    """HBM bytes the kernels of an optimized module read and write, by the kernel rule of
    :func:`benchmarks.hlo.count_kernels`, ``weighted`` by the trip counts of their loops (a
    scanned layer stack counts ``L`` times, the draft scan ``S - 1`` times; a loop of unknown
    trip count, like the decode loop, once) and ``once`` (each body once, as XLA's cost
    analysis).

    A kernel is charged its operands and results, except: what a fusion only slices or
    gathers is charged the slice; a dynamic-update-slice or scatter (fused or not) updating
    a buffer in place is charged its update, not the buffer; a custom call's operand that
    it aliases to an output (``output_to_operand_aliasing``: the Pallas KV write) is charged
    nothing either way, its other operands in full and once each, except a KV pool:
    ``pool_layers`` maps a pool's views (:func:`benchmarks.hlo.pool_key`) to its number of
    layers, and a custom call handed a pool is charged one layer of it (the Pallas attention
    kernels read one layer's pages per call, up to the live length: at a full cache that is
    the layer's share of the pool). Arrays placed in VMEM (TPU ``S(1)``) are not HBM
    traffic. Unlike XLA's "bytes accessed" this sees into Pallas kernels' operands and does
    not charge in-place writes the pool, so programs with and without kernels compare.
    ``detail``: a list that receives ``(weighted bytes, computation, instruction, opcode,
    result shape)`` per kernel. ``root``: count from this computation instead of ENTRY
    (``"decode loop"``: one iteration of the generate loop,
    :func:`benchmarks.hlo.decode_loop_body`)."""
    comps, entry = parse_hlo(text)
    if root == "decode loop":
        root = decode_loop_body(comps, entry)
        if root is None:
            return {"once": float("nan"), "weighted": float("nan")}
    shapes = {c: {i.name: i.shape for i in ins} for c, ins in comps.items()}
    out = {"once": 0.0, "weighted": 0.0}

    def charge(comp_name: str, ins: Instr) -> float:
        ops = operand_names(ins.attrs)
        ob = [_hbm_bytes(shapes[comp_name].get(o, "")) for o in ops]
        rb = _hbm_bytes(ins.shape)
        op = ins.opcode
        if op == "fusion":
            called = callees(ins.attrs, ("calls",))
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
                layers = (pool_layers or {}).get(shape_key(shapes[comp_name].get(o, "")))
                if layers:
                    ob[k] /= layers
                if o in ops[:k]:                   # one buffer handed in several times (the
                    ob[k] = 0.0                    # Pallas kernels' page-prefetch slots)
            at = ins.attrs.find("output_to_operand_aliasing=")
            pairs = re.findall(r"\{([\d,]*)\}:\s*\((\d+),", ins.attrs[at:]) if at >= 0 else []
            if pairs:
                skip = {int(i) for _, i in pairs}
                outs = re.findall(rf"{ELEMENT_TYPE}\[[\d,]*\](?:\{{[^}}]*\}})?", ins.shape)
                whole = any(o == "" for o, _ in pairs)           # {}: the (only) output
                out_skip = {int(o.split(",")[0]) for o, _ in pairs if o}
                rb = 0.0 if whole else sum(_hbm_bytes(x) for k, x in enumerate(outs)
                                           if k not in out_skip)
                return rb + sum(b for k, b in enumerate(ob) if k not in skip)
        return rb + sum(ob)

    def visit(name, ins, mult, first):
        op = ins.opcode
        if op in NON_KERNEL or op.endswith("-done") or op.endswith("-update"):
            return
        b = charge(name, ins)
        if detail is not None:
            detail.append((b * mult, name, ins.name, op, ins.shape[:80]))
        out["weighted"] += b * mult
        out["once"] += b if first else 0.0

    weighted_walk(comps, root or entry, out, visit, into_fusions=False)
    return out
