"""EAGLE-1: ``fc(cat(embed(x), h))`` then one decoder layer without an input norm.

The feature h is the target's final post-norm hidden state; the layer's output is
fed back as the next feature and read by the target's own LM head (no norm).

Checkpoint (SafeAILab layout): ``fc.weight [H, 2H]`` (+ ``fc.bias`` when the config's
``bias`` is true), ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.post_attention_layernorm.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``;
an ``embed_tokens.weight`` is ignored (the target's embedding is used).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from jspec.config import LlamaConfig
from jspec.drafters.base import RecurrentDrafter, target_embedding, target_head
from jspec.llama import MLP, Attention, RMSNorm
from jspec.attention import paged_attention_ref


class Eagle1Net(nn.Module):
    cfg: LlamaConfig
    fc_bias: bool = False

    @nn.compact
    def __call__(self, emb, feats, positions, cache, block_mask, valid, offset):
        c = self.cfg
        fc = nn.Dense(c.hidden_size, use_bias=self.fc_bias, dtype=c.dtype, param_dtype=c.dtype,
                      kernel_init=nn.initializers.normal(0.02), name="fc")
        x = fc(jnp.concatenate([emb, feats.astype(emb.dtype)], -1))
        h, cache = Attention(c, name="self_attn")(x, positions, cache, 0, block_mask, valid,
                                                  paged_attention_ref, offset)
        x = x + h
        x = x + MLP(c, name="mlp")(RMSNorm(c.hidden_size, c.rms_norm_eps, c.dtype,
                                           name="post_attention_layernorm")(x))
        return x, cache


@dataclasses.dataclass(frozen=True)
class Eagle1(RecurrentDrafter):
    fc_bias: bool = False
    kind = "eagle1"

    @property
    def net(self):
        return Eagle1Net(self.layer, self.fc_bias)

    def init_params(self, key, target_cfg):
        emb, feats, pos, cache = self._dummy(target_cfg, target_cfg.hidden_size)
        return {"net": self.net.init(key, emb, feats, pos, cache, None, None, 0)["params"]}

    def net_apply(self, params, target_cfg, target_params, tokens, feats, step, positions,
                  cache, block_mask, valid, offset):
        emb = target_embedding(target_params)[tokens]
        out, cache = self.net.apply({"params": params["net"]}, emb, feats, positions, cache,
                                    block_mask, valid, offset)
        logits = (out @ target_head(target_cfg, target_params).astype(out.dtype)).astype(jnp.float32)
        return out, logits, cache
