"""``pallas_kernels`` needs jax and numpy only, as jax's own ``pallas/ops`` do: nothing in it
imports ``jspec`` (read from the source, imports inside functions included)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pallas_kernels_import_nothing_from_jspec():
    offenders = []
    for path in sorted((ROOT / "pallas_kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n == "jspec" or n.startswith("jspec.")]
    assert not offenders, offenders
