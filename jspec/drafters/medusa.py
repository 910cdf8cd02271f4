"""Medusa: K independent heads on the target's last hidden state, one call, no loop.

Head i is ``num_layers`` residual blocks ``x + SiLU(W x + b)`` then an LM head (its own,
or the target's shared head), and predicts the token ``i + 2`` places after the
position whose hidden state it reads. In the driver that hidden state is the target's
at the last accepted node, whose own prediction is the bonus token (the tree root), so
head 0 proposes the root's children, head 1 the grandchildren, and so on.

The tree is static (:mod:`jspec.tree.static`): Medusa's 63-path ``mc_sim_7b_63`` by
default (truncated to the heads there are), a chain of the heads' top-1 tokens when
``topk == 1``, and otherwise the N-1 paths of the per-head top-K product with the
smallest rank sums (a deterministic stand-in for a calibrated tree).

Draft vocabulary (:mod:`jspec.drafters.vocab`): ``vocab_size`` is the own heads' width
(0: the target's shared head). A truncated vocabulary (vLLM; ``truncated=True``) keeps
``token_map [Vd]``: draft id -> target id (absolute, vLLM's convention, where the other
drafters keep ``d2t`` offsets; both are checked and mapped by the shared code).

Checkpoints: FasterDecoding ``{i}.{j}.linear.{weight,bias}`` and ``{i}.{L}.weight``;
vLLM ``blocks.{i}.layers.{j}.{weight,bias}`` and ``lm_heads.{i}.weight``.
"""

from __future__ import annotations

import dataclasses
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from jspec.config import LlamaConfig
from jspec.drafters.base import DrafterMismatchError, target_head
from jspec.drafters.vocab import check_draft_vocab, to_target_ids
from jspec.shapes import Float
from jspec.spec_config import SpecConfig
from jspec.tree.static import MC_SIM_7B_63, StaticTree, static_tree_tokens


class MedusaHeads(nn.Module):
    num_heads: int
    num_layers: int
    hidden: int
    vocab: int            # 0: use the target's head
    dtype: str = "float32"

    @nn.compact
    def __call__(self, h, shared_head=None):
        outs = []
        for i in range(self.num_heads):
            x = h
            for j in range(self.num_layers):
                x = x + nn.silu(nn.Dense(self.hidden, dtype=self.dtype, param_dtype=self.dtype,
                                         kernel_init=nn.initializers.normal(0.02),
                                         name=f"head_{i}_block_{j}")(x))
            if self.vocab:
                logits = nn.Dense(self.vocab, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                                  kernel_init=nn.initializers.normal(0.02), name=f"head_{i}_lm")(x)
            else:
                logits = x @ shared_head.astype(x.dtype)
            outs.append(logits.astype(jnp.float32))
        return jnp.stack(outs, axis=1)           # [B, heads, V]


@struct.dataclass
class MedusaState:
    feature: Float["B H"]    # the target's hidden state at the last accepted node


def default_tree_paths(num_heads: int, spec: SpecConfig | None):
    if spec is None:
        return tuple(p for p in MC_SIM_7B_63 if len(p) <= num_heads)
    if spec.num_steps > num_heads:
        raise DrafterMismatchError(
            f"medusa has {num_heads} heads, a tree of depth num_steps={spec.num_steps} needs that many")
    if spec.is_chain:
        return tuple((0,) * d for d in range(1, spec.num_steps + 1))
    paths = [p for d in range(1, spec.num_steps + 1)
             for p in itertools.product(range(spec.topk), repeat=d)]
    paths.sort(key=lambda p: (sum(p), len(p), p))
    return tuple(paths[:spec.num_draft_tokens - 1])


@dataclasses.dataclass(frozen=True)
class Medusa:
    num_heads: int
    num_layers: int
    hidden: int
    target_vocab: int
    vocab_size: int = 0           # own heads' vocabulary; 0 = the target's shared head
    truncated: bool = False       # own heads over a truncated vocab with a token_map
    dtype: str = "float32"
    kind = "medusa"
    feature_source = "final"
    aux_layers = ()
    map_key = "token_map"

    @property
    def draft_vocab(self) -> int:
        return self.vocab_size or self.target_vocab

    @property
    def draft_head_paths(self):
        if not self.vocab_size:
            return ()
        return tuple(("net", f"head_{i}_lm", "kernel") for i in range(self.num_heads))

    def to_target_ids(self, params, draft_ids):
        return to_target_ids(params, draft_ids)

    @property
    def net(self):
        return MedusaHeads(self.num_heads, self.num_layers, self.hidden, self.vocab_size, self.dtype)

    def tree(self, spec: SpecConfig | None) -> StaticTree:
        return StaticTree.from_paths(default_tree_paths(self.num_heads, spec))

    def init_params(self, key, target_cfg: LlamaConfig):
        head = jnp.zeros((self.hidden, target_cfg.vocab_size), self.dtype)
        p = {"net": self.net.init(key, jnp.zeros((1, self.hidden), self.dtype), head)["params"]}
        if self.truncated:
            p["token_map"] = jnp.arange(self.vocab_size, dtype=jnp.int32)
        return p

    def validate(self, target_cfg: LlamaConfig, params=None) -> None:
        if target_cfg.hidden_size != self.hidden:
            raise DrafterMismatchError(
                f"medusa heads have hidden size {self.hidden}, the target {target_cfg.hidden_size}")
        if target_cfg.vocab_size != self.target_vocab:
            raise DrafterMismatchError(
                f"medusa drafter was built for a vocabulary of {self.target_vocab} tokens, the "
                f"target has {target_cfg.vocab_size}")
        check_draft_vocab(self, target_cfg.vocab_size, params)

    def cache_slots(self, spec) -> int:
        return 0

    def init_state(self, batch, page_table, num_pages, page_size) -> MedusaState:
        return MedusaState(feature=jnp.zeros((batch, self.hidden), self.dtype))

    def _last(self, feats, n):
        idx = jnp.maximum(n - 1, 0)[:, None, None]
        return jnp.take_along_axis(feats, idx, axis=1)[:, 0]

    def prefill(self, params, target, state, feats, next_tokens, lens):
        return MedusaState(feature=self._last(feats, lens).astype(self.dtype))

    def extend(self, params, target, state, feats, next_tokens, n):
        return MedusaState(feature=jnp.where((n > 0)[:, None], self._last(feats, n).astype(self.dtype),
                                             state.feature))

    def propose(self, params, target, state: MedusaState, root, spec):
        cfg, tparams = target
        tree = self.tree(spec)
        head = None if self.vocab_size else target_head(cfg, tparams)
        logits = self.net.apply({"params": params["net"]}, state.feature, head)  # [B, heads, V]
        _, top = jax.lax.top_k(logits[:, :tree.depth], tree.topk)
        top = self.to_target_ids(params, top)
        return static_tree_tokens(tree, root, top)
