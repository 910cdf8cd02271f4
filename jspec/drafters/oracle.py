"""An oracle drafter that knows the answer: it proposes a known continuation (e.g. the
target's own greedy output) as the best path of an EAGLE-2 tree, with decoys around it.

For tests and benchmarks only: with the target's greedy continuation it must reach the
maximum accept length S + 1 on every iteration, which proves the acceptance plumbing
end to end; with ``miss_rate`` it corrupts the path at random depths to force shorter
accepts while the output stays exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jspec.drafters.protocol import DraftModuleDefaults
from jspec.drafters.registry import DrafterKind, register
from jspec.shapes import Int
from jspec.spec_config import SpecConfig
from jspec.tree.select import eagle2_tree


@struct.dataclass
class OracleState:
    length: Int["B"]           # committed target length (the root sits at this position)
    key: jax.Array


@dataclasses.dataclass(frozen=True)
class Oracle(DraftModuleDefaults):
    vocab: int
    miss_rate: float = 0.0      # probability that each planted token is replaced by a decoy
    kind = "oracle"
    per_row_params = True       # params["future"] has one row per batch row
    prefill_is_extend = False   # extend folds its key

    def validate(self, target_cfg, params=None):
        pass

    def cache_slots(self, spec) -> int:
        return 0

    def init_state(self, batch, page_table, num_pages, page_size):
        return OracleState(length=jnp.zeros((batch,), jnp.int32), key=jax.random.key(1234))

    # kernels=: the protocol's attention mode; the oracle does not attend.
    def prefill(self, params, target, state, feats, next_tokens, lens, *,
                kernels: str = "reference"):
        return state.replace(length=lens.astype(jnp.int32))

    def extend(self, params, target, state, feats, next_tokens, n, *, kernels: str = "reference"):
        return state.replace(length=state.length + n, key=jax.random.fold_in(state.key, 1))

    def propose(self, params, target, state: OracleState, root, spec, *,
                kernels: str = "reference"):
        S, K, N = spec.num_steps, spec.topk, spec.num_draft_tokens
        future = params["future"]                                    # [B, max_len]
        B = root.shape[0]
        k1, k2, k3 = jax.random.split(state.key, 3)
        idx = state.length[:, None] + 1 + jnp.arange(S)[None]
        planted = jnp.take_along_axis(future, jnp.clip(idx, 0, future.shape[1] - 1), axis=1)
        decoys = jax.random.randint(k1, (B, S, K, K), 0, self.vocab)
        miss = jax.random.uniform(k2, (B, S)) < self.miss_rate
        planted = jnp.where(miss, (planted + 1) % self.vocab, planted)
        # The planted path is child 0 of frontier slot 0 at every step, with probability 1.
        toks = decoys.at[:, :, 0, 0].set(planted)
        logp = -1.0 - jax.random.uniform(k3, (B, S, K, K))
        logp = logp.at[:, :, 0, 0].set(0.0)
        tree, _ = eagle2_tree(root, toks, logp, N)
        return tree


def _build(target_cfg, key=None, future=None, miss_rate: float = 0.0):
    """``future [B, max_len]``: the continuation it plants (e.g. the target's greedy output)."""
    if future is None:
        raise ValueError("an oracle drafter needs future= (the continuation it proposes)")
    return Oracle(target_cfg.vocab_size, miss_rate), {"future": jnp.asarray(future, jnp.int32)}


ENTRY = register(DrafterKind(
    name="oracle", module=Oracle, default_spec=SpecConfig(5, 4, 8), build=_build,
    modes={"chain": SpecConfig.chain(4), "default": SpecConfig(5, 4, 8)},
    features="none", needs_weights=False, saveable=False))
