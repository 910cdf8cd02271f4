"""Accept length by context position: how acceptance changes as a row's context grows.

Peers' users report acceptance decaying with context (sglang #6783, vLLM #47602). Every
verify pass adds its row's emitted tokens to the bucket of the row's context length when
the pass began (its committed KV: prompt plus tokens so far), so a row's stats give the mean
accept length per bucket, in the same units as ``mean_accept_len``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

#: Bucket edges in context positions: [0, 256), [256, 512), ... [65536, inf).
EDGES = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
NUM_BUCKETS = len(EDGES) + 1


def labels() -> list[str]:
    lo = (0,) + EDGES
    return [f"{a}-{b}" for a, b in zip(lo, EDGES)] + [f"{EDGES[-1]}+"]


def empty(batch: int) -> jax.Array:
    """``[B, buckets, 2]`` int32: per bucket, verify passes and the tokens they emitted."""
    return jnp.zeros((batch, NUM_BUCKETS, 2), jnp.int32)


def record(table: jax.Array, context: jax.Array, emitted: jax.Array, live: jax.Array):
    """Add one pass per live row: ``emitted [B]`` tokens at context length ``context [B]``."""
    b = jnp.searchsorted(jnp.asarray(EDGES, jnp.int32), context.astype(jnp.int32), side="right")
    live = live.astype(jnp.int32)
    return table.at[jnp.arange(table.shape[0]), b].add(
        jnp.stack([live, emitted.astype(jnp.int32) * live], -1))


def summary(table) -> dict:
    """``{bucket label: {"iterations": k, "mean_accept_len": tokens / k}}`` of one row's (or
    rows' summed) ``[buckets, 2]`` table, buckets without a pass left out."""
    t = np.asarray(table).reshape(-1, NUM_BUCKETS, 2).sum(0)
    return {lab: {"iterations": int(k), "mean_accept_len": float(n) / int(k)}
            for lab, (k, n) in zip(labels(), t) if k}


def merge(summaries) -> dict:
    """Rows' :func:`summary` dicts pooled: passes summed, accept lengths weighted by them."""
    k, n = {}, {}
    for s in summaries:
        for lab, v in s.items():
            k[lab] = k.get(lab, 0) + v["iterations"]
            n[lab] = n.get(lab, 0.0) + v["iterations"] * v["mean_accept_len"]
    return {lab: {"iterations": k[lab], "mean_accept_len": n[lab] / k[lab]}
            for lab in labels() if lab in k}


def table(rows: dict) -> str:
    """``{name: merged summary}`` as a text table: mean accept length per bucket (passes)."""
    cols = [lab for lab in labels() if any(lab in s for s in rows.values())]
    w = max([len(n) for n in rows] + [8])
    out = [f"{'':<{w}}  " + "  ".join(f"{c:>14}" for c in cols)]
    for name, s in rows.items():
        out.append(f"{name:<{w}}  " + "  ".join(
            f"{s[c]['mean_accept_len']:>7.2f} ({s[c]['iterations']:>4})" if c in s else
            f"{'-':>14}" for c in cols))
    return "\n".join(out)
