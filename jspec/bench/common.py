"""Helpers shared by the benchmarks: their common flags, table printing, random weights, the
jitted target forward they time, HF twins.

The HF helpers build a transformers ``LlamaForCausalLM`` holding exactly the weights of a
jspec parameter tree (fp32), so a benchmark can run both implementations on the same model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jspec import kv_cache as kvc
from jspec.config import LlamaConfig
from jspec.llama import Llama, forward, logits as lm_logits
from jspec.serving_layout import pack_params


# --------------------------------------------------------------------------- flags
def add_common_args(s: argparse.ArgumentParser, default_batch, default_repeats) -> None:
    """The flags ``plain``, ``spec`` and ``forward`` share."""
    s.add_argument("--random-config", metavar="NAME",
                   help="a named random config from jspec.bench.configs (tiny, 100m)")
    s.add_argument("--batch", type=int, nargs="+", default=default_batch)
    s.add_argument("--repeats", type=int, default=default_repeats,
                   help="timed calls after warm-up (the median is reported)")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", metavar="OUT", help="also write the rows as JSON")


# --------------------------------------------------------------------------- timing (jspec.timing)
def load_avg() -> str:
    """The 1/5/15-minute load average: other processes on a small machine skew timings."""
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "?"


# --------------------------------------------------------------------------- tables
def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        a = abs(v)
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 10:
            return f"{v:.2f}"
        return f"{v:.3f}"
    return str(v)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A plain-text table: one header line, a rule, one line per row (missing cells: ``-``)."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))
    out = [line(columns), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in cells]
    return "\n".join(out)


def write_json(path: str, payload: dict) -> None:
    def default(o):
        if isinstance(o, (np.integer, np.floating)):
            return o.item()
        return str(o)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=default)


# --------------------------------------------------------------------------- weights
def param_count(params) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(params)))


def _init_all(module: Llama, tok, pos, cache):
    hidden, _, _ = module(tok, pos, cache)
    return module.logits(hidden)


def param_shapes(cfg: LlamaConfig):
    """Shape tree of every parameter the model uses, ``lm_head`` included."""
    cache = kvc.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                           np.zeros((1, 1), np.int32), 1, 8, cfg.dtype)
    tok = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(
        lambda k: nn.unbox(Llama(cfg).init(k, tok, tok, cache, method=_init_all)["params"]),
        jax.random.key(0))


def random_params(cfg: LlamaConfig, seed: int = 0):
    """Random weights with O(1) activations (so greedy argmax has clear margins):
    embeddings ~ N(0, 1), ``[in, out]`` kernels ~ N(0, 1/in), norm scales ~ 1 + 0.2 N(0, 1)."""
    rng = np.random.default_rng(seed)
    flat, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg))
    leaves = []
    for path, s in flat:
        name = path[-1].key
        x = rng.standard_normal(s.shape, dtype=np.float32)
        if name == "scale":
            x = 1.0 + 0.2 * x
        elif name == "kernel":
            x *= np.float32(1.0 / math.sqrt(s.shape[0]))
        leaves.append(jnp.asarray(x.astype(s.dtype)))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def params_to_hf_state_dict(cfg: LlamaConfig, params) -> dict[str, np.ndarray]:
    """jspec tree (``[in, out]`` kernels) -> HF ``LlamaForCausalLM`` state dict (``[out, in]``)."""
    g = lambda x: np.asarray(jax.device_get(x), np.float32)
    sd = {"model.embed_tokens.weight": g(params["embed_tokens"]["embedding"]),
          "model.norm.weight": g(params["norm"]["scale"])}
    for i in range(cfg.num_layers):
        p, pre = params[f"layers_{i}"], f"model.layers.{i}."
        for n in "qkvo":
            sd[pre + f"self_attn.{n}_proj.weight"] = g(p["self_attn"][f"{n}_proj"]["kernel"]).T
        for n in ("gate", "up", "down"):
            sd[pre + f"mlp.{n}_proj.weight"] = g(p["mlp"][f"{n}_proj"]["kernel"]).T
        sd[pre + "input_layernorm.weight"] = g(p["input_layernorm"]["scale"])
        sd[pre + "post_attention_layernorm.weight"] = g(p["post_attention_layernorm"]["scale"])
    sd["lm_head.weight"] = (sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings
                            else g(params["lm_head"]["kernel"]).T)
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


# --------------------------------------------------------------------------- a timed target forward
def step_fn(cfg: LlamaConfig, block_mask=None):
    """A jitted target forward + logits over packed params (pass them packed: packing
    inside would copy the weights on every call)."""
    def step(params, tokens, positions, cache):
        params = pack_params(cfg, params)
        mask = None if block_mask is None else jnp.broadcast_to(
            block_mask, (tokens.shape[0],) + block_mask.shape[1:])
        hidden, _, cache = forward(cfg, params, tokens, positions, cache, block_mask=mask)
        return lm_logits(cfg, params, hidden), cache          # [B, T, V]
    return jax.jit(step, donate_argnums=(3,))


def make_cache(cfg: LlamaConfig, batch: int, context: int, block: int, page_size: int = 16,
               seed: int = 0) -> kvc.PagedKVCache:
    """A cache holding ``context`` committed positions per row (random contents) and room
    for ``block`` more."""
    max_len = context + block
    max_pages = kvc.pages_needed(max_len, page_size)
    num_pages = batch * max_pages
    table = kvc.allocate_page_table([max_len] * batch, page_size, num_pages, max_pages)
    cache = kvc.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, table, num_pages,
                           page_size, cfg.dtype)
    kk, kv = jax.random.split(jax.random.key(seed))
    shape, dt = cache.k_pages.shape, cache.k_pages.dtype
    return cache.replace(k_pages=jax.random.normal(kk, shape, dt),
                         v_pages=jax.random.normal(kv, shape, dt),
                         lengths=jnp.full((batch,), context, jnp.int32))


def timed_call(v: dict, params) -> float:
    """One call of a prepared variant (``compiled``, ``tok``, ``pos``, ``cache``; the cache
    is donated and threaded back): its own seconds, for ``round_robin(seconds=own_seconds)``."""
    t0 = time.perf_counter()
    logits, v["cache"] = v["compiled"](params, v["tok"], v["pos"], v["cache"])
    jax.block_until_ready((logits, v["cache"]))
    v["logits_shape"] = logits.shape
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- HF twin
def hf_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        return True
    except Exception:  # pragma: no cover - depends on the environment
        return False


def disable_eos(model) -> None:
    # No EOS anywhere: HF then neither stops early nor masks EOS for min_new_tokens, so its
    # greedy choice is the plain argmax, like jspec with stop_ids=[].
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None


def hf_model_from_params(cfg: LlamaConfig, params):
    """A float32 transformers ``LlamaForCausalLM`` holding ``params``."""
    import torch
    import transformers
    d = cfg.to_hf()
    d.pop("torch_dtype", None)
    hf_cfg = transformers.LlamaConfig(**d)
    model = transformers.LlamaForCausalLM(hf_cfg).to(torch.float32).eval()
    sd = {k: torch.from_numpy(np.array(v)) for k, v in params_to_hf_state_dict(cfg, params).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"HF state dict mismatch: missing {missing}, unexpected {unexpected}")
    disable_eos(model)
    return model


def hf_model_from_dir(path: str):
    import torch
    import transformers
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    disable_eos(model)
    return model


def hf_greedy(model, prompts: np.ndarray, new_tokens: int) -> Callable[[], np.ndarray]:
    """A zero-argument callable running HF greedy ``generate`` on ``prompts [B, T]`` (no
    padding); returns the ``[B, new_tokens]`` generated ids."""
    import torch
    import transformers
    ids = torch.from_numpy(np.asarray(prompts, np.int64))
    mask = torch.ones_like(ids)
    gc = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        eos_token_id=None, pad_token_id=0, num_beams=1)

    def call():
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        return out[:, ids.shape[1]:].numpy()
    return call
