from benchmarks import kernels


def test_kernel_bench_smoke_on_reference():
    rows = kernels.run([1], [40], 8, "reference", repeats=1)
    assert len(rows) == 1 and set(kernels.COLUMNS) <= set(rows[0])
    assert rows[0]["kernel ms"] > 0 and rows[0]["copy GB/s"] > 0
