"""Tiny random Llama targets (vocabulary 48, two layers) and a byte-level llama2.c tokenizer,
for checkpoint round trips that need no trained weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.common import expected_shapes, unflatten
from jspec.config import LlamaConfig
from jspec.target import Target
from jspec.tokenizer import Llama2cTokenizer


def tiny_cfg(tied=True, dtype="float32", **kw):
    base = dict(vocab_size=48, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=4, tie_word_embeddings=tied, max_position_embeddings=32,
                bos_token_id=1, eos_token_ids=(2,), dtype=dtype)
    base.update(kw)
    return LlamaConfig(**base)


def tiny_target(tied=True, dtype="float32", tokenizer=None, **kw):
    cfg = tiny_cfg(tied, dtype, **kw)
    return Target(cfg, tiny_params(cfg), tokenizer)


@functools.lru_cache(maxsize=None)
def tiny_params(cfg):
    # Random values on the tree init_params would build (eager flax init is slow op by op;
    # test_checkpoint's test_matches_init_params covers the real thing). Norm scales are not
    # all-ones, so a swapped norm would be caught.
    rng = np.random.default_rng(0)
    shapes = expected_shapes(cfg)
    flat = {p: jnp.asarray((rng.standard_normal(s) * 0.1).astype(np.float32)).astype(cfg.dtype)
            for p, s in shapes.items()}
    return unflatten(flat)


def tiny_tokenizer():
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % b for b in range(45)]
    return Llama2cTokenizer(pieces, [0.0] * len(pieces))


def l2c_target(tied, **kw):
    """A tiny target llama2.c's format can hold (its eps and stop ids)."""
    return tiny_target(tied, rms_norm_eps=1e-5, eos_token_ids=(1, 2), **kw)


# Every drafter kind the exactness matrices run (the test oracle aside).
KINDS = ("eagle1", "eagle3", "mtp", "medusa", "ngram", "dflash")


def drafter_of(kind: str, cfg, seed: int = 3):
    """A drafter of ``kind`` for a target of ``cfg``: random weights (4 Medusa heads, a
    5-token DFlash block), or n-gram prompt lookup."""
    from jspec.drafters import ngram_drafter, random_drafter
    if kind == "ngram":
        return ngram_drafter(cfg)
    kw = {"num_heads": 4} if kind == "medusa" else {"block_size": 5} if kind == "dflash" else {}
    return random_drafter(kind, cfg, jax.random.key(seed), **kw)
