"""Data regeneration: the target's own continuations of a prompt set.

A drafter is trained to imitate the target, so its training text is best written by the
target itself (Medusa-2 / EAGLE "self-distillation"): each prompt is continued with
:func:`jspec.generate` at a moderate temperature, several times with different seeds, and
the full sequences (prompt + continuation, stop token included) are kept.

Sequences are stored as one ``.npz`` with a flat ``tokens`` array, per-sequence
``offsets`` (length + 1 entries) and ``prompt_lens``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from jspec import atomic

# Story openings for TinyStories-style targets (stories260K). The last HELDOUT are
# never regenerated for training: acceptance is measured on them.
STORY_OPENINGS = [
    "Once upon a time, there was a",
    "Once upon a time, there was a little girl named",
    "Once upon a time, in a big forest, there lived a",
    "Once upon a time, a little boy named",
    "One day, a little",
    "One day, a girl named Lily",
    "One day, Tim went to the park",
    "One sunny day, a",
    "One morning, a small dog",
    "Tom and Mia",
    "Tom and Mia were playing in the",
    "Lily and Ben went to the",
    "Sam had a red ball",
    "There was a big, friendly",
    "There once was a little cat named",
    "In a small town, there was a",
    "In the garden, a tiny bug",
    "Anna wanted to go to the",
    "Max was a happy dog who",
    "The sun was shining and",
    "Sue liked to play with her",
    "Mom said, \"Let's go to the",
    "Tim saw a big tree",
    "A little bird was sitting on",
    "The little girl was very sad because",
    "Ben had a new toy",
    "Once there was a boy who loved",
    "Lucy found a shiny",
    "Timmy was playing with his",
    "The cat and the dog",
    "It was a rainy day and",
    "Amy and her mom went to the store",
    "Jack liked to run fast",
    "The little fish swam",
    "Once upon a time, there was a big bear who",
    "A girl named Sara had a",
    "The boy looked at the sky and",
    "Grandma made a cake for",
    "One night, the moon",
    "Billy was scared of the",
    "Kitty wanted to climb the",
    "Once upon a time, there was a kind king",
    "The duck went to the pond",
    "Emma had a pretty dress",
    "A small mouse lived in a",
    "Joe and his dad built a",
    "The children were playing in the snow",
    "Once upon a time, a princess",
    "Ella loved to sing",
    "Zoe had a little brother named",
    "The old man had a",
    "Once upon a time, there was a car named",
    "On a hot summer day,",
    "Rosie the rabbit",
    "Peter wanted a cookie",
    "The farmer had many",
    "Bob the frog jumped",
    "Lily saw a butterfly",
    "Once upon a time, in a land far away,",
    "A boy named Leo found a",
    "Mia and her friend",
    "The big truck",
    "One day, the wind",
    "Tom was hungry, so he",
    "Daisy the cow",
    "The toy robot",
    "Sally went to school and",
    "Once upon a time, there was a lazy",
    "Spot the dog liked to",
    "The little girl wanted to help her mom",
    "Ben and Lily were best friends.",
    "One day, a big storm",
    "Molly had a balloon",
    "Once upon a time there was a tiny ant",
    "Jenny liked to draw",
    "The teddy bear",
    "Once upon a time, a little girl found a box",
    "Tim and his sister",
    "The baby was crying because",
    "A brave knight",
    # ------------------------------------------------------------ held out
    "Once upon a time, there was a little dog named",
    "One day, a boy named Tim",
    "Lily and her mom",
    "The little bird wanted to fly",
    "There was a happy girl who",
    "Once upon a time, in a small house,",
    "Sam and Max went to the",
    "A big cat sat on",
    "One day, Sue found a",
    "The sun was hot, so",
    "Once upon a time, there was a shy",
    "Ben wanted to play with",
    "Mom and Dad took",
    "The little boy liked his",
    "Anna saw a big",
    "Once there was a kind girl",
    "A small frog lived",
    "One day, a little girl named Amy",
    "Tom had a blue",
    "The dog ran to the",
]
HELDOUT = 20


def story_prompts(split: str = "train") -> list[str]:
    """``"train"``: the openings used for regeneration; ``"heldout"``: the last 20."""
    if split == "train":
        return STORY_OPENINGS[:-HELDOUT]
    if split == "heldout":
        return STORY_OPENINGS[-HELDOUT:]
    if split == "all":
        return list(STORY_OPENINGS)
    raise ValueError(f"split must be train, heldout or all, got {split!r}")


def regenerate(target, prompts: Sequence, num_samples: int, *, max_new_tokens: int = 192,
               temperature: float = 0.8, seed: int = 0, batch_size: int = 64,
               progress: bool = True) -> tuple[list[np.ndarray], list[int]]:
    """Sample ``num_samples`` continuations cycling over ``prompts``; each with its own key.

    Returns ``(sequences, prompt_lens)``: ``prompt + continuation`` token arrays (int32),
    in sample order, and each one's prompt length. Sample ``i``
    uses prompt ``i % len(prompts)`` and seed ``seed + batch index``; rows in a batch draw
    from their own keys, so the result does not depend on the batch size's padding.
    """
    import jspec

    if not prompts:
        raise ValueError("regenerate() needs at least one prompt")
    ids = [target.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]
           for p in prompts]
    nb = math.ceil(num_samples / batch_size)
    bar = _bar(nb, "regen", progress)
    out: list[np.ndarray] = []
    plens: list[int] = []
    for b in range(nb):
        rows = [ids[i % len(ids)] for i in range(b * batch_size,
                                                 min(num_samples, (b + 1) * batch_size))]
        n = len(rows)
        rows = rows + [rows[0]] * (batch_size - n)    # keep one compiled shape
        res = jspec.generate(target, rows, max_new_tokens=max_new_tokens,
                             temperature=temperature, seed=seed + b)
        for r in range(n):
            out.append(np.asarray(rows[r] + res.tokens[r], np.int32))
            plens.append(len(rows[r]))
        bar.update(1)
    bar.close()
    return out, plens


def regenerate_with_runner(target_dir, prompts: Sequence, num_samples: int, out, *,
                           max_new_tokens: int = 192, temperature: float = 0.8, seed: int = 0,
                           runner_args: Sequence[str] = ()):
    """Sample ``num_samples`` continuations through the dataset runner and save them.

    Sample ``i`` continues prompt ``i % len(prompts)`` with seed ``seed + i`` (its output
    depends on nothing else: not the slot, the batch or the process). The runner's input
    ``OUT.requests.jsonl`` and output ``OUT.results.jsonl`` sit beside ``out``; rerunning
    resumes the output (each id exactly once). Returns ``(sequences, prompt_lens)`` in sample
    order once every sample is in, after writing ``out``; ``(None, None)`` when the run was
    stopped (SIGTERM: rerun to finish) or on processes other than 0 of a multi-host run.
    """
    import argparse
    import json

    from jspec import distributed, load_target, messages
    from jspec.engine import runner

    if not prompts:
        raise ValueError("regeneration needs at least one prompt")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    requests = out.with_name(out.name + ".requests.jsonl")
    results = out.with_name(out.name + ".results.jsonl")
    p = argparse.ArgumentParser()
    runner.add_args(p)
    extra = list(runner_args)[1:] if list(runner_args)[:1] == ["--"] else list(runner_args)
    args = p.parse_args(["--model", str(target_dir), "--input", str(requests), "--output",
                         str(results), "--max-new-tokens", str(max_new_tokens),
                         "--temperature", str(temperature), "--on-error", "write", *extra])
    distributed.join(args)              # a multi-host run: before anything starts a backend
    import jax

    target = load_target(target_dir)    # once: the runner serves with it too
    ids = [prompt_ids(target, p) for p in prompts]
    # A chat's reply ends at the template's end of turn, whatever the model's EOS.
    stops = [{"stop": messages.stop_ids(target)} if is_chat(p) else {} for p in prompts]
    lines = [json.dumps({"id": i, "prompt_ids": ids[i % len(ids)], "seed": seed + i,
                         **stops[i % len(ids)]}) for i in range(num_samples)]
    text = "\n".join(lines) + "\n"
    if not requests.exists() or requests.read_text() != text:
        if results.exists():
            raise ValueError(f"{results} holds results for other requests; remove it or "
                             f"choose another --out")
        # Every process of a pod writes the same file: whole, by rename, never read half.
        atomic.write_text(requests, text)
    runner.run(args, target)
    if jax.process_index() != 0:
        return None, None
    done = {}
    for line in results.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:            # a cut last line: the run was killed
            continue
        if "error" in r:
            raise ValueError(f"regeneration request {r['id']}: {r['error']}")
        done[r["id"]] = r["token_ids"]
    if len(done) < num_samples:
        return None, None
    seqs = [np.asarray(ids[i % len(ids)] + done[i], np.int32) for i in range(num_samples)]
    plens = [len(ids[i % len(ids)]) for i in range(num_samples)]
    save_sequences(out, seqs, plens)
    return seqs, plens


def is_chat(prompt) -> bool:
    """A conversation (a list of message dicts), not text or token ids."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)


def prompt_ids(target, prompt) -> list[int]:
    """A prompt's ids: text encoded by the target's tokenizer, a conversation rendered through
    its chat template (with the assistant's header), token ids as they are."""
    from jspec import messages
    if isinstance(prompt, str):
        return target.tokenizer.encode(prompt)
    if is_chat(prompt):
        return messages.render(target, prompt)
    return [int(t) for t in prompt]


def save_sequences(path, seqs: Sequence[np.ndarray], prompt_lens: Sequence[int] | None = None):
    """One ``.npz`` (flat tokens, offsets, prompt lengths), written to a temporary sibling
    and renamed."""
    lens = np.array([len(s) for s in seqs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    pl = np.zeros(len(seqs), np.int32) if prompt_lens is None else np.asarray(prompt_lens, np.int32)
    with atomic.atomic_open(path, "wb") as f:
        np.savez(f, tokens=np.concatenate(seqs).astype(np.int32), offsets=offsets, prompt_lens=pl)


def load_sequences(path, with_prompt_lens: bool = False):
    z = np.load(path)
    t, o = z["tokens"], z["offsets"]
    seqs = [t[o[i]:o[i + 1]] for i in range(len(o) - 1)]
    return (seqs, z["prompt_lens"].tolist()) if with_prompt_lens else seqs


def _bar(total, desc, enabled):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True)
