"""Count the import cycles among a package's modules, imports inside functions included.

    python tools/import_cycles.py [jspec pallas_kernels]

Prints the strongly connected components of the module import graph (every module of a
component can reach every other one through imports), the number of module pairs that import
each other directly, and the number of imports placed inside functions. An import of a package
counts as an import of its ``__init__``; ``from pkg import name`` counts as an import of
``pkg.name`` when that is a module, else of ``pkg``. Reads the source only (AST); imports
nothing.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules(packages) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _resolve(name: str, mods) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def edges(mods: dict[str, Path]) -> tuple[dict[str, set], int]:
    graph, inner = {m: set() for m in mods}, 0
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        funcs = [n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        in_func = {id(x) for f in funcs for x in ast.walk(f)}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            hit = False
            for t in targets:
                r = _resolve(t, mods)
                if r and r != mod:
                    graph[mod].add(r)
                    hit = True
            inner += hit and id(node) in in_func
    return graph, inner


def components(graph: dict[str, set]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def report(packages) -> dict:
    mods = modules(packages)
    graph, inner = edges(mods)
    comps = components(graph)
    mutual = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph[b]})
    return {"modules": len(mods), "cycles": comps, "mutual": mutual, "function_imports": inner}


def main(argv) -> int:
    packages = argv or ["jspec", "pallas_kernels"]
    r = report(packages)
    print(f"{r['modules']} modules in {', '.join(packages)}")
    print(f"strongly connected components (import cycles): {len(r['cycles'])}, "
          f"{sum(map(len, r['cycles']))} modules in them")
    for c in r["cycles"]:
        print(f"  {len(c)}: {', '.join(c)}")
    print(f"module pairs importing each other directly: {len(r['mutual'])}")
    for a, b in r["mutual"]:
        print(f"  {a} <-> {b}")
    print(f"imports inside functions (of package modules): {r['function_imports']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
