"""``bench products``, ``bench verify-cost``'s row drift and the benchmark modes on tiny
shapes: the pieces compute what they say (no assertions on times)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import products, quant, verify_cost
from helpers.tiny_targets import tiny_target


@pytest.mark.parametrize("dtype", products.DTYPES)
def test_measure_reports_every_form_and_row_count(dtype):
    r = products.measure(64, 48, dtype, [1, 3], repeats=1, cache_bytes=1 << 14, max_copies=3)
    assert r["copies"] == 3 and r["bytes"] >= 64 * 48
    from cpu_kernels.few_row_product import available
    forms = ("xla", "kernel") if available() else ("xla",)
    assert all(r[form, m] > 0 for form in forms for m in (1, 3))


def test_row_drift_is_a_logit_difference_per_block_size():
    d = verify_cost.row_drift(tiny_target(), 16, [2, 4])
    assert set(d) == {2, 4} and all(np.isfinite(v) and 0 <= v < 1 for v in d.values())


def test_unknown_modes_fail_before_loading():
    with pytest.raises(SystemExit, match="int4"):
        quant.check_modes(["fp32", "int4"])
    quant.check_modes(list(quant.MODES))
