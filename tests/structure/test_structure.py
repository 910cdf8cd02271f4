"""The package's shape (issue 30): imports only point down, no module reaches another's
private names, files and functions stay small. Reads the source (AST); imports nothing."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import import_cycles  # noqa: E402

PACKAGES = [p for p in ("jspec", "pallas_kernels", "benchmarks") if (ROOT / p).is_dir()]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60       # its docstring not counted
# (file, what) pairs allowed to use a private name of another module, each with its reason.
PRIVATE_ALLOWED = {
    # It times checkouts from before the plan seam too, where admit was generate's private.
    ("tools/compile_then_now.py", "from jspec.generate import _admit"),
}


def sources(*roots):
    for root in roots:
        yield from sorted((ROOT / root).rglob("*.py"))


def test_no_import_cycles():
    r = import_cycles.report(PACKAGES)
    assert r["cycles"] == [], r["cycles"]
    assert r["mutual"] == [], r["mutual"]


def imported_modules(path: Path) -> list[str]:
    out = []
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.Import):
            out += [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0:
            out.append(n.module)
    return out


def test_pallas_kernels_import_nothing_from_jspec():
    """Like jax's own ``pallas/ops``: kernels, references and validation need jax and numpy
    only, so ``jspec`` may import them and never the reverse (imports inside functions count)."""
    bad = [(str(p.relative_to(ROOT)), m) for p in sources("pallas_kernels")
           for m in imported_modules(p) if m.split(".")[0] == "jspec"]
    assert bad == []
    assert imported_modules(ROOT / "jspec" / "kernels.py")   # the scan sees imports at all


def private_uses(path: Path) -> list[str]:
    """``from m import _x`` and ``name._x`` (not ``self``/``cls``): another module's private
    name. Dunders are not private."""
    out = []
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.ImportFrom):
            out += [f"from {n.module} import {a.name}" for a in n.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
        elif (isinstance(n, ast.Attribute) and n.attr.startswith("_")
              and not n.attr.startswith("__") and not (isinstance(n.value, ast.Name)
                                                       and n.value.id in ("self", "cls"))):
            out.append(ast.unparse(n))
    return out


def test_no_private_names_across_modules():
    bad = [(str(p.relative_to(ROOT)), u) for p in sources(*PACKAGES, "tools")
           for u in private_uses(p)]
    assert [b for b in bad if b not in PRIVATE_ALLOWED] == []


def test_the_private_name_check_catches_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from jspec.plan import _hidden\nimport jspec.plan as p\np._other()\n"
                 "class A:\n    def f(self):\n        return self._mine, obj.__dict__\n")
    assert private_uses(f) == ["from jspec.plan import _hidden", "p._other"]


@pytest.mark.parametrize("root", ["jspec"])
def test_files_stay_small(root):
    big = {str(p.relative_to(ROOT)): n for p in sources(root)
           if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert big == {}


def long_functions(path: Path) -> dict[str, int]:
    out = {}
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = n.end_lineno - n.lineno + 1
            if ast.get_docstring(n) is not None:
                lines -= n.body[0].end_lineno - n.body[0].lineno + 1
            if lines > MAX_FUNCTION_LINES:
                out[f"{path.relative_to(ROOT)}:{n.name}"] = lines
    return out


def test_functions_stay_small():
    assert {k: v for p in sources("jspec") for k, v in long_functions(p).items()} == {}


def test_every_test_slow_tests_txt_names_exists():
    """A stale line in tests/slow_tests.txt would silently keep nothing out of the default
    run: each names a file, and a test function in it."""
    from conftest import slow_node_ids
    missing = []
    for node in sorted(slow_node_ids()):
        path, _, name = node.partition("::")
        func = name.split("[")[0]
        f = ROOT / path
        if not f.exists() or f"def {func}(" not in f.read_text():
            missing.append(node)
    assert missing == []
