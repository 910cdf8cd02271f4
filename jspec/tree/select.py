"""EAGLE-2 dynamic draft trees: frontier expansion inside the draft loop, then a
global top-(N-1) selection that is ancestor-closed by construction.

Scores are cumulative log-probabilities. The draft loop keeps a frontier of K paths;
each step scores their K*K children (:func:`expand_frontier`), keeps the best K and
appends all K*K to the candidate pool. Pool layout, per row (M = K + (S-1) K^2):

    [0, K)                     step 0: the root's K children, parent -1 (the root)
    [K + (s-1) K^2, K + s K^2)  step s >= 1: child j of frontier slot k at offset k*K + j

so a parent's pool index is always smaller than its children's, and siblings sit in
the drafter's rank order.

Ancestor closure. Selection ranks candidates by an *effective* score: the minimum of
the scores along the candidate's path, ties broken by depth, then pool index. For
true cumulative log-probabilities the effective score is the score itself (a child
never beats its parent), and the tie rule puts a parent before its children when
an edge has probability 1 or everything underflows to -inf. For arbitrary scores
(a drafter bug, NaN) the min-along-path makes the rule hold anyway, so the top N-1
are always ancestor-closed; ``closed`` reports it and tests assert it. A node whose
parent is not selected would get parent -1, never the root.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jspec.shapes import Float, Int
from jspec.tree.build import build_tree


@struct.dataclass
class CandidatePool:
    """A draft loop's candidates, in the pool layout above (M = K + (S-1) K^2)."""
    tokens: Int["B M"]         # target vocabulary ids
    scores: Float["B M"]       # cumulative path scores under the selection policy
    logq: Float["B M"]         # the drafter's log-probability of the node given its parent
    parents: Int["B M"]        # pool index of the parent, -1 for the root's children

    @staticmethod
    def depth_rank(M: int, K: int):
        """Static ``(step, sibling rank)`` of every pool index (step 0: the root's children)."""
        m = jnp.arange(M, dtype=jnp.int32)
        return jnp.where(m < K, 0, 1 + (m - K) // (K * K)), m % K


def expand_frontier(path_scores: jax.Array, child_logp: jax.Array):
    """One EAGLE-2 step.

    ``path_scores [B, K]`` of the frontier; ``child_logp [B, K, K]`` (log q of each
    frontier path's top-K children). Returns ``(child_scores [B, K*K], keep [B, K])``:
    all children's cumulative scores in pool order, and the flat indices (into K*K)
    of the K kept for the next step, best first.
    """
    B, K, _ = child_logp.shape
    scores = (path_scores[:, :, None] + child_logp).reshape(B, K * K)
    # + 0.0 turns -0.0 into +0.0: top_k orders -0.0 below +0.0, which would break the tie rule.
    scores = jnp.where(jnp.isnan(scores), -jnp.inf, scores) + 0.0
    _, keep = jax.lax.top_k(scores, K)   # ties -> lower index, i.e. better-ranked parent
    return scores, keep.astype(jnp.int32)


def pool_parent_index(frontier_idx: jax.Array, K: int) -> jax.Array:
    """Pool indices of the parents of a step's K*K children, given the pool indices
    ``[B, K]`` of the frontier entering that step."""
    return jnp.repeat(frontier_idx, K, axis=1)


def pool_offset(step, K: int):
    """First pool index of step ``step`` (>= 1; may be traced). Step 0 starts at 0."""
    return K + (step - 1) * K * K


def select_tree(root_token: jax.Array, pool_tokens: jax.Array, pool_scores: jax.Array,
                pool_parents: jax.Array, num_nodes: int, max_depth: int):
    """Global top-(N-1) of the candidate pool plus the root -> ``(DraftTree, closed)``.

    ``pool_*: [B, M]`` with ``pool_parents`` -1 for the root's children and otherwise a
    smaller pool index. ``closed [B]`` is True when every kept node's parent is kept.
    """
    B, M = pool_scores.shape
    n_draft = num_nodes - 1
    scores = jnp.where(jnp.isnan(pool_scores), -jnp.inf, pool_scores.astype(jnp.float32))
    parents = pool_parents.astype(jnp.int32)
    has_parent = parents >= 0
    safe_par = jnp.clip(parents, 0, M - 1)
    # Effective score and depth by pointer jumping over at most max_depth levels.
    eff, depth = scores, jnp.ones_like(parents)
    for _ in range(max_depth - 1):
        par_eff = jnp.take_along_axis(eff, safe_par, axis=1)
        par_depth = jnp.take_along_axis(depth, safe_par, axis=1)
        eff = jnp.where(has_parent, jnp.minimum(scores, par_eff), scores)
        depth = jnp.where(has_parent, par_depth + 1, 1)
    idx = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B, M))
    # Rank in (higher effective score, then shallower, then earlier) order by pairwise
    # comparison over the pool (M = K + (S-1) K^2: 68 at (5, 4, 8)): with a three-key lexsort
    # and a sort of the kept indices, select_tree took XLA:TPU 1.8 s to compile, now 0.9 s
    # (deviceless v5p). -0.0 counts as +0.0 (+ 0.0 below).
    e = eff + 0.0
    ei, ej, di, dj = e[:, :, None], e[:, None, :], depth[:, :, None], depth[:, None, :]
    ahead = (ej > ei) | ((ej == ei) & ((dj < di) | ((dj == di) & (idx[:, None, :] < idx[:, :, None]))))
    kept = jnp.sum(ahead, axis=2) < n_draft                 # [B, M]: among the best N-1
    # The kept indices in pool order (= topological order): top-k of -index over the kept.
    _, chosen = jax.lax.top_k(jnp.where(kept, -idx, -M - idx), n_draft)
    node_of = jnp.full((B, M), -1, jnp.int32).at[jnp.arange(B)[:, None], chosen].set(
        jnp.arange(1, num_nodes, dtype=jnp.int32))
    ppar = jnp.take_along_axis(parents, chosen, axis=1)
    par_node = jnp.where(ppar < 0, 0, jnp.take_along_axis(node_of, jnp.clip(ppar, 0, M - 1), axis=1))
    closed = jnp.all(par_node >= 0, axis=1)
    tokens = jnp.concatenate([root_token[:, None], jnp.take_along_axis(pool_tokens, chosen, axis=1)], 1)
    parents_n = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), par_node], axis=1)
    return build_tree(tokens, parents_n, max_depth), closed


def select_pool(root_token: jax.Array, pool: CandidatePool, num_nodes: int, max_depth: int):
    """:func:`select_tree` over a :class:`CandidatePool`."""
    return select_tree(root_token, pool.tokens, pool.scores, pool.parents, num_nodes, max_depth)


def grow_pool(tok0: jax.Array, logq0: jax.Array, children, num_steps: int,
              selection: str = "eagle2", params=None) -> CandidatePool:
    """EAGLE-2's frontier recurrence, unrolled in Python, for drafters without a loop of their
    own (tests, the target-as-drafter ceiling). ``tok0, logq0 [B, K]``: the root's children;
    ``children(s, paths)`` -> ``(logq, tokens) [B, K, K]``: the top-K children of the frontier
    paths ``paths [B, K, s]`` (their tokens, root excluded) at step ``s``. Scores under
    ``selection`` (:func:`jspec.tree.calibration.node_scores`)."""
    from jspec.tree.calibration import node_scores
    B, K = tok0.shape
    score0 = node_scores(selection, logq0, 0, params, tok0)
    parts = [(tok0, score0, logq0, jnp.full((B, K), -1, jnp.int32))]
    f_idx = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K))
    f_scores, f_logq, paths = score0, logq0, tok0[:, :, None]
    for s in range(1, num_steps):
        c_logq, c_tok = children(s, paths)
        scores, keep = expand_frontier(
            f_scores, node_scores(selection, c_logq, s, params, c_tok, f_idx % K, f_logq))
        toks, logqs = c_tok.reshape(B, K * K), c_logq.reshape(B, K * K)
        parts.append((toks, scores, logqs, pool_parent_index(f_idx, K)))
        paths = jnp.concatenate([jnp.take_along_axis(paths, (keep // K)[..., None], axis=1),
                                 jnp.take_along_axis(toks, keep, 1)[..., None]], axis=2)
        f_scores, f_idx = jnp.take_along_axis(scores, keep, 1), pool_offset(s, K) + keep
        f_logq = jnp.take_along_axis(logqs, keep, 1)
    tok, score, logq, par = (jnp.concatenate(x, 1) for x in zip(*parts))
    return CandidatePool(tokens=tok, scores=score, logq=logq, parents=par)


def eagle2_tree(root_token: jax.Array, step_tokens: jax.Array, step_logp: jax.Array,
                num_nodes: int):
    """EAGLE-2 from a whole draft run at once (tests, and drafters without a loop).

    ``step_tokens, step_logp: [B, S, K, K]``: at step s, the top-K children of each of
    the K frontier paths (at step 0 only row 0 is used: the root's children). Runs the
    same frontier recurrence as the draft loop and returns ``(tree, closed)``.
    """
    S = step_tokens.shape[1]
    pool = grow_pool(step_tokens[:, 0, 0], step_logp[:, 0, 0],
                     lambda s, _: (step_logp[:, s], step_tokens[:, s]), S)
    return select_pool(root_token, pool, num_nodes, S)
