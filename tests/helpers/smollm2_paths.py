"""Greedy tokens of the SmolLM2 golden prompts through every serving path, for
``tests/checkpoint/test_smollm2.py``; run in a subprocess with XLA's full optimisation.

The suite compiles with LLVM's optimisations off (``tests/conftest.py``), which is right for its
tiny models and wrong for a 135M one: a SmolLM2 decode step takes ~13x longer that way. This
script runs four paths (``generate`` plain and with EAGLE-3, the engine and the dataset runner
with a random EAGLE-3 head) in one process and writes their tokens as JSON. ``generate``'s head
is the one in training (``checkpoints/smollm2/drafters/eagle3-wip``): it accepts more than one
token a pass (a random head almost never does), so the golden also checks what accepting does.

Run:  python tests/helpers/smollm2_paths.py GGUF GOLDEN OUT [generate|served|all]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

# A short chain: exactness is what is tested, not speed.
CHAIN = (2, 1, 3)
SLOTS = 2          # fewer slots than prompts: the engine refills slots as rows finish
# The engine and the runner serve the rows two at a time, so they decode the first third of the
# golden's tokens only (a prefix of it, compared as one); generate decodes all of them.
SERVED_TOKENS = 32


def run_paths(model: str, rows: list[dict], n: int, which: str = "all") -> dict[str, list[list[int]]]:
    """``which``: ``"generate"`` (generate, plain and EAGLE-3), ``"served"`` (the engine and
    the runner) or ``"all"``."""
    import jax

    import jspec
    from jspec.drafters import random_drafter
    from jspec.engine import Engine, Request
    from jspec.spec_config import SpecConfig

    target = jspec.load_target(model)
    spec = SpecConfig(*CHAIN)
    prompts = [r["prompt_ids"] for r in rows]
    out = {}
    if which != "served":
        for name, kw in (("plain", {}), ("eagle3", {"drafter": trained_head(target), "spec": spec})):
            res = jspec.generate(target, prompts, max_new_tokens=n, stop_ids=[], **kw)
            out[f"generate-{name}"] = [list(map(int, t)) for t in res.tokens]
        # res: the EAGLE-3 run's, the loop's last
        out["generate-eagle3-accept"] = float(np.mean([s["mean_accept_len"] for s in res.stats]))
    if which == "generate":
        return out
    # Served speculatively only (plain: checked on small models), with a random head.
    m = min(n, SERVED_TOKENS)
    eagle3 = random_drafter("eagle3", target.config, jax.random.key(3))
    eng = Engine(target, slots=SLOTS, max_new_tokens=m, drafter=eagle3, spec=spec)
    done = eng.generate([Request(p, m, stop_ids=[], id=i) for i, p in enumerate(prompts)])
    out["engine-eagle3"] = [c.tokens for c in done]
    # The runner reads records: chat rows as messages (rendered by jspec's template), text rows
    # as text (encoded by jspec's tokenizer), so this path also checks both against the golden
    # (speculative only: the rendering is the same for plain decoding, which the engine covers).
    out["runner-eagle3"] = run_records(target, model, rows, m,
                                       ["--drafter", "random:eagle3", "--spec",
                                        ",".join(map(str, CHAIN))])
    return out


def trained_head(target):
    from jspec.drafters.checkpoint import load_drafter
    return load_drafter(ROOT / "checkpoints/smollm2/drafters/eagle3-wip", target)


def run_records(target, model: str, rows: list[dict], n: int, flags: list[str]) -> list:
    """``python -m jspec run`` in process over the rows as records; each row's tokens."""
    from jspec.engine import runner
    with tempfile.TemporaryDirectory() as d:
        lines = []
        for i, r in enumerate(rows):
            rec = {"id": i, "max_new_tokens": n, "stop": []}
            rec.update({"messages": r["messages"]} if "messages" in r else {"prompt": r["text"]})
            lines.append(json.dumps(rec))
        src, dst = Path(d) / "in.jsonl", Path(d) / "out.jsonl"
        src.write_text("\n".join(lines) + "\n")
        p = argparse.ArgumentParser()
        runner.add_args(p)
        args = p.parse_args(["--model", model, "--input", str(src), "--output", str(dst),
                             "--slots", str(SLOTS), "--no-progress", *flags])
        assert runner.run(args, target=target) == 0
        recs = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    return [recs[i]["token_ids"] for i in range(len(rows))]


def main(argv=None) -> int:
    model, golden, dst, *which = (argv if argv is not None else sys.argv[1:])
    doc = json.loads(Path(golden).read_text())
    Path(dst).write_text(json.dumps(run_paths(model, doc["rows"], doc["new_tokens"],
                                              *which)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
