"""SmolLM2 W8A8 in the serving engine, for ``tests/quant/test_w8a8_smollm2.py``: run in a
subprocess with jspec's CPU layer layout (an unrolled stack) and XLA's default options, as
a user runs it. For the committed EAGLE-3 head's chain (4, 1, 5) and default tree, the
engine (4 slots) decodes held-out chat prompts greedily; writes JSON, per spec:

- ``partings``: per prompt, the first token where the engine's output leaves plain
  ``generate``'s of the same W8A8 target (None: equal);
- ``logprob_diff``: the largest difference of the two runs' logprobs of a token they share;
- ``score_diff``: the largest difference of the engine's logprobs from its echo scoring of
  prompt + output.

Run:  python tests/helpers/w8a8_smollm2_engine.py MODEL_DIR OUT [PROMPTS [NEW_TOKENS]]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jspec
from jspec import messages
from jspec.drafters.checkpoint import load_drafter
from jspec.engine import Engine
from jspec.spec_config import SpecConfig
from w8a8_exact import engine_vs_plain  # the same measures as stories260K's engine cases

ROOT = Path(__file__).parents[2]
HEAD = ROOT / "checkpoints" / "smollm2" / "drafters" / "eagle3-wip"
PROMPTS = ROOT / "checkpoints" / "smollm2" / "prompts" / "heldout.json"


def main(argv=None) -> int:
    model, dst, *rest = argv if argv is not None else sys.argv[1:]
    n_prompts, N = (int(rest[0]) if rest else 8), (int(rest[1]) if len(rest) > 1 else 64)
    target = jspec.load_target(model, quantize="w8a8")
    convs = json.loads(PROMPTS.read_text())[:n_prompts]
    prompts = [messages.render(target, c) for c in convs]
    plain = jspec.generate(target, prompts, max_new_tokens=N, stop_ids=[], logprobs=0)
    drafter = load_drafter(HEAD, target.config)
    doc = {}
    for name, spec in (("chain", SpecConfig(4, 1, 5)), ("tree", None)):
        eng = Engine(target, drafter, slots=4, spec=spec, max_new_tokens=N, chunk=4,
                     logprobs_k=0, max_len=512)
        doc[name] = engine_vs_plain(eng, prompts, [N] * len(prompts), plain)
    Path(dst).write_text(json.dumps(doc))
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
