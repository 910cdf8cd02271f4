"""An oracle drafter that knows a constrained greedy answer, for the device- and host-path
grammar tests: every verify keeps its whole path, so the states of accepted nodes and bonus
tokens are exercised, not only rejections."""

import jax.numpy as jnp
import numpy as np

import jspec
from jspec.drafters import Drafter
from jspec.drafters.oracle import Oracle


def oracle_run(target, prompts, fmts, spec, new: int, eos: int):
    """``(constrained greedy plain result, the same requests drafted by an oracle of it)``."""
    want = jspec.generate(target, prompts, max_new_tokens=new, stop_ids=[eos],
                          response_format=fmts)
    fut = np.zeros((len(prompts), 256), np.int32)
    for r, p in enumerate(prompts):
        ids = target.tokenizer.encode(p) + want.tokens[r] + [eos] * 8
        fut[r, :len(ids)] = ids
    oracle = Drafter(Oracle(target.config.vocab_size), {"future": jnp.asarray(fut)})
    res = jspec.generate(target, prompts, max_new_tokens=new, stop_ids=[eos],
                         response_format=fmts, drafter=oracle, spec=spec)
    return want, res
