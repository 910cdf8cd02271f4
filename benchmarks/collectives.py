"""The collectives of one iteration of a compiled generate loop (:func:`loop_collectives`):
what :mod:`benchmarks.plan` prints for a sharded program, read from its optimized HLO."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from benchmarks.hlo import callees, decode_loop_body, loop_trips, parse_hlo

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "all-reduce-start", "all-gather-start", "collective-permute-start")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1,
          "s64": 8, "u64": 8, "f64": 8, "u16": 2, "s16": 2}


def _array_bytes(shape: str) -> int:
    """Bytes of an HLO result shape (arrays and tuples of arrays)."""
    total = 0
    for m in re.finditer(r"([a-z]+\d*(?:e\d+m\d+[a-z]*)?)\[([\d,]*)\]", shape):
        dims = [int(d) for d in m.group(2).split(",") if d]
        per = 1 if m.group(1).startswith("f8") else _BYTES.get(m.group(1), 4)   # float8: 1
        total += per * int(np.prod(dims, dtype=np.int64))
    return total


def _group_size(attrs: str, devices: int) -> int | None:
    """Devices per replica group: explicit ``{{0,1},{2,3}}``, iota ``[groups,size]<=[...]``,
    or ``{}`` (one group of every device); None for a collective-permute's pairs."""
    m = re.search(r"replica_groups=\{\{([\d,]+)\}", attrs)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)
    if m:
        return int(m.group(2))
    return devices if "replica_groups={}" in attrs else None


def _source(attrs: str) -> str:
    """Where the op comes from: its ``op_name`` inside the loop body (jax's named scopes
    ``draft``, ``verify``, ``walk``, ``commit``, ``extend`` and the primitive)."""
    m = re.search(r'op_name="([^"]+)"', attrs)
    if not m:
        return "-"
    name = re.sub(r"^jit\([^)]*\)/", "", m.group(1))
    return re.sub(r"^(while/body/)+", "", name).replace("closed_call/", "")[:70]


def loop_collectives(text: str, devices: int = 0) -> list[dict]:
    """Collectives of one iteration of the outermost ``while`` loop of the ENTRY computation
    (the generate loop; the prefill runs before it), with multiplicity from nested loops'
    trip counts. Identical (op, shape, group, source) rows are merged."""
    comps, entry = parse_hlo(text)
    body = decode_loop_body(comps, entry)
    if body is None:
        return []
    rows: Counter = Counter()

    def visit(name: str, mult: int, seen: tuple):
        if name in seen:
            return
        for i in comps.get(name, []):
            if i.opcode in COLLECTIVES:
                key = (i.opcode.removesuffix("-start"), i.shape.split("{")[0][:80],
                       _array_bytes(i.shape), _group_size(i.attrs, devices), _source(i.attrs))
                rows[key] += mult
            if i.opcode == "while":
                trips = loop_trips(i.attrs, comps) or 1
                for c in callees(i.attrs, ("body",)):
                    visit(c, mult * trips, seen + (name,))
            elif i.opcode in ("conditional", "call"):
                for c in callees(i.attrs, ("true_computation", "false_computation",
                                           "branch_computations", "to_apply")):
                    visit(c, mult, seen + (name,))
            elif i.opcode == "fusion" or i.opcode.endswith("-start"):
                for c in callees(i.attrs, ("calls",)):
                    visit(c, mult, seen + (name,))
    visit(body, 1, ())
    out = [{"op": op, "shape": shape, "bytes": b, "group": g, "per_iter": n, "source": src}
           for (op, shape, b, g, src), n in rows.items()]
    return sorted(out, key=lambda r: -r["bytes"] * r["per_iter"])
