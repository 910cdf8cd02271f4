"""Write ``tests/data/parity_golden.npz``: transformers' fp32 logits for a tiny random Llama.

Needs torch + transformers (the ``hf`` extra); the test that reads the file
(``tests/model/test_llama_parity.py::test_golden_parity``) does not.

Config: untied embeddings, GQA 2 (4 query heads, 2 KV heads), head_dim 16 with
hidden 48 (so head_dim != hidden / heads), llama3 RoPE scaling with
original_max_position_embeddings=32 and 48 input tokens, so positions run past it.

The npz holds:
  config_json  the HF config (``LlamaConfig.to_dict()``) as a JSON string
  input_ids    int32 [T]
  logits       float32 [T, vocab]: ``LlamaForCausalLM(input_ids).logits[0]``
  <hf name>    float32 weights under their transformers state-dict names
               (``model.layers.0.self_attn.q_proj.weight`` ..., ``[out, in]``)

Run:  python tests/data/make_parity_golden.py
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import transformers

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "model"))
from test_llama_parity import randomize_  # noqa: E402  (the parity test's own initialisation)

SEED = 1234
T = 48
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parity_golden.npz")


def main(out: str = OUT) -> None:
    torch.manual_seed(SEED)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32},
        bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).float().eval()

    # O(1) activations instead of HF's 0.02-std init, so the logits are not all ~0.
    g = torch.Generator().manual_seed(SEED)
    randomize_(model, g)

    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    with torch.no_grad():
        logits = model(ids).logits[0].float().numpy()

    d = cfg.to_dict()
    d["dtype"] = "float32"
    d.pop("transformers_version", None)
    arrays = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    arrays.update(config_json=np.array(json.dumps(d, sort_keys=True)),
                  input_ids=ids[0].numpy().astype(np.int32),
                  logits=logits.astype(np.float32))
    np.savez_compressed(out, **arrays)
    print(f"wrote {out}: {os.path.getsize(out) / 1024:.0f} KiB, "
          f"{len(arrays) - 3} weights, logits {logits.shape}, |logits| max {np.abs(logits).max():.2f}")


if __name__ == "__main__":
    main()
