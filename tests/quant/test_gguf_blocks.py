"""A GGUF's Q8_0 / Q4_0 blocks kept quantized (load_target(..., quantize="int8")): every layer
weight equals gguf's dequantization of the file's blocks exactly (Q/K unpermuted, norm scales
carried as in_scale), and the logits equal the dequantized fp32 target's to float tolerance.
Q4_1 is requantized (not a QArray: docs/quantization.md)."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.gguf_files import SMALL_CFG as CFG, SMALL_VOCAB as VOCAB, write_llama_gguf

from jspec.checkpoint import load_target
from jspec.llama import init_params
from jspec.quant import mode_of
from jspec.checkpoint.hf import state_dict_from_params
from jspec.scoring import teacher_forced
from jspec.serving_layout import pack_params

@pytest.mark.parametrize("qtype,kept", [("Q8_0", True), ("Q4_0", True), ("Q4_1", False)])
def test_blocks_kept_exactly(tmp_path, qtype, kept):
    sd = state_dict_from_params(CFG, init_params(CFG, jax.random.key(0)))
    f = tmp_path / "m.gguf"
    write_llama_gguf(f, CFG, sd, VOCAB, qtype=gguf.GGMLQuantizationType[qtype])
    ref = load_target(f)                                    # dequantized to fp32
    q = load_target(f, quantize="int8")
    assert mode_of(q.params) == "int8"
    want = pack_params(ref.config, ref.params, stacked=False)["layers"]
    got = pack_params(q.config, q.params, stacked=False)["layers"]
    for i in range(CFG.num_layers):
        for name in ("qkv", "o", "gate_up", "down"):
            w, g = np.asarray(want[i][name]), np.asarray(got[i][name].dequantize())
            if kept:     # the file's values and scales: equal up to one rounding of the fold
                np.testing.assert_allclose(g, w, rtol=2e-7, atol=1e-7, err_msg=f"{i} {name}")
            else:
                assert np.abs(g - w).max() < 0.01 * np.abs(w).max()
    ids = [5, 9, 11, 30, 2, 7, 44, 12]
    lp = lambda t: np.array([e.logprob for e in teacher_forced(t, ids)[1:]])
    np.testing.assert_allclose(lp(q), lp(ref), atol=1e-4 if kept else 0.05)
