"""The Pallas kernels compiled for real accelerators on this host, without one (jspec.aot,
``python -m jspec.bench aot-kernels``; DESIGN.md section 6).

The compiling tests are marked ``tpu_aot`` / ``gpu_aot`` and also ``slow`` (they are not part
of the default run: run them with ``python -m pytest -n 0 -m "tpu_aot or gpu_aot"``). Each
skips with the reason when its compiler is absent. TPU compiles run in this process (libtpu);
GPU compiles run in a subprocess with ``$JSPEC_GPU_AOT_PYTHON`` (the CUDA plugin is kept out
of the main environment). The unmarked tests here compile nothing.
"""

from __future__ import annotations

import pytest

from helpers.gpu_aot import gpu_python_or_skip

from jspec import aot
from benchmarks import aot_kernels as ak


# A representative subset of the matrix: decode (N = 1), EAGLE-3's default tree, the widest
# tree with GQA, both page sizes and dtypes; both walks at Llama-3's vocabulary; and one cell
# each target's validation refuses (never compiled).
def subset(platform: str) -> list[dict]:
    D = 64 if platform == "gpu" else 128
    return [ak.tree_cell(1, 16, 4, D, "bfloat16"), ak.tree_cell(8, 16, 4, D, "bfloat16"),
            ak.tree_cell(64, 32, 4, 128, "float32"), ak.tree_cell(64, 16, 1, D, "float32"),
            {"kernel": "walk_greedy", "N": 8, "S": 5},
            {"kernel": "walk_sample", "N": 8, "S": 5, "V": 128256},
            *ak.kv_write_cells((1, 8), (16,), (4,), ("bfloat16",), platform=platform),
            *ak.prefill_cells(platform)[:1],
            ak.tree_cell(8, 16, 4, 64 if platform == "tpu" else 24, "bfloat16")]


def _check(rows, cells):
    assert len(rows) == len(cells)
    bad = [(r["config"], r["status"], r.get("error")) for r in rows
           if r["status"] not in ("compiled", "refused")]
    assert not bad, bad                     # validate-accepted == compiled
    assert [r["status"] for r in rows] == ["compiled"] * (len(cells) - 1) + ["refused"]


# ------------------------------------------------------------------ no compiler needed
def test_matrix_covers_the_issue():
    """Tree attention: N 1/8/64 x pages 16/32 x G 1/4 x fp32/bf16, head_dim 128 on TPU and
    64/128 on the GPU; both walks at Llama-3's and Llama-2's vocabularies."""
    assert len(ak.tree_cells(platform="tpu")) == 24
    assert len(ak.tree_cells(platform="gpu")) == 48
    for platform in ("tpu", "gpu"):
        walks = ak.walk_cells(platform=platform)
        vocabs = {c["V"] for c in walks if c["kernel"] == "walk_sample"}
        assert {128256, 32000} <= vocabs
        assert any(c["kernel"] == "walk_greedy" for c in walks)
    assert len(ak.kv_write_cells(platform="tpu")) == 24 and not ak.kv_write_cells(platform="gpu")


def test_refused_cells_are_not_compiled():
    """A configuration the kernel's validate refuses is reported as refused (no device used)."""
    row = ak.compile_cell(ak.tree_cell(8, 16, 4, 64, "float32"), "v5e", device=None)
    assert row["status"] == "refused" and "multiple of 128" in row["error"]
    row = ak.compile_cell(ak.tree_cell(8, 8, 4, 128, "bfloat16"), "v6e", device=None)
    assert row["status"] == "refused" and "sublane" in row["error"]
    cell = {"kernel": "kv_write", "T": 8, "page_size": 8, "G": 4, "head_dim": 128, "dtype": "bfloat16"}
    row = ak.compile_cell(cell, "v5e", device=None)
    assert row["status"] == "refused" and "sublane tile" in row["error"]
    row = ak.compile_cell({"kernel": "walk_sample", "N": 8, "S": 5, "V": (1 << 18) + 1}, "v5e", None)
    assert row["status"] == "refused" and "vocabulary" in row["error"]


def test_absent_compiler_rows(monkeypatch):
    monkeypatch.setattr(aot, "missing", lambda name: "no compiler in this test")
    rows = ak.compile_matrix("v5p", subset("tpu")[:2])
    assert [r["status"] for r in rows] == ["absent", "absent"]
    assert "no compiler in this test" in rows[0]["error"]
    with pytest.raises(aot.CompilerMissing, match="no compiler in this test"):
        aot.device("h200")
    with pytest.raises(ValueError, match="choose one of"):
        aot.target("v4")


def test_h200_target_config_is_test_data():
    text = aot.gpu_target_config()
    assert str(aot.H200_CONFIG).endswith("tests/data/aot/h200_target_config.pbtxt")
    assert "Where the numbers come from" in text                  # its provenance, in the file
    for field in ("core_count: 132", "major: 9", 'device_description_str: "NVIDIA H200"'):
        assert field in text


# ------------------------------------------------------------------ compiled
@pytest.mark.slow
@pytest.mark.tpu_aot
@pytest.mark.parametrize("target", ["v5e", "v6e", "v5p"])
def test_tpu_kernels_compile(target):
    why = aot.missing(target)
    if why:
        pytest.skip(why)
    cells = subset("tpu")
    _check(ak.compile_matrix(target, cells), cells)


@pytest.mark.slow
@pytest.mark.gpu_aot
def test_h200_kernels_compile():
    python = gpu_python_or_skip()
    cells = subset("gpu") + [ak.tree_cell(8, 32, 1, 128, "bfloat16")]
    cells.append(cells.pop(-2))             # the refused cell last
    _check(ak.compile_matrix_in(python, "h200", cells, timeout=900), cells)
