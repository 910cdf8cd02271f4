"""What a quantized target's programs read on an H200, compiled deviceless (``gpu_aot``:
skipped without the gpu-aot interpreter, docs/accelerators.md).

Pins two regressions measured on Llama-3-8B (docs/quantization.md): a weight-only product
that dequantized the weight before the matmul, which XLA:GPU wrote to HBM as a bf16 copy of
every layer (1.9x bf16's bytes a step), and W8A8's dot-free CPU attention built into GPU
programs (1.2x)."""

import pytest
from helpers.gpu_aot import h200_bench_json


@pytest.mark.slow
@pytest.mark.gpu_aot
def test_quantized_layers_read_fewer_bytes_than_bf16_on_an_h200(tmp_path):
    def step_mb(*quantize):
        plan = h200_bench_json(["plan", "--config", "100m", "--topology", "h200", "--mesh", "1x1",
                                "--draft-vocab", "0", "--context", "2048", "--batch", "8",
                                "--plain-step", *quantize], tmp_path / "plan.json")
        return plan["info"]["plain_step_io_MB"], plan["info"]["iteration_io_MB"]

    bf16 = step_mb()
    for mode in ("int8", "fp8", "w8a8"):
        q = step_mb("--quantize", mode)
        assert q[0] < bf16[0] and q[1] < bf16[1], (mode, q, bf16)
