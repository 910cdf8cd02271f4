"""Token selection: greedy, or sampling with temperature, top-k and top-p.

Static and runtime settings. :class:`SamplingConfig` is static (hashable, compiled in): its
values are the defaults, and it decides whether any sampling is traced at all
(:attr:`SamplingConfig.may_sample`). A greedy config (the default) compiles an argmax and
nothing else: the fast path. A config that may sample (its defaults sample, or
``per_request=True``) gives every row its own settings as runtime values, a
:class:`RowSampling` of ``[B]`` arrays that lives in the decode state beside the row's PRNG
key (the serving engine writes a slot's at insert, a static batch broadcasts the config's),
so greedy and sampled rows share one batch and one compiled program. A row with temperature
0 or top_k 1 is greedy: its distribution is the one-hot of the argmax and its token the
argmax, so verification against it keeps exactly the greedy tokens.

A row's result depends only on its own logits, settings and key, never on its neighbours:
where one row needs more than the static candidates (a top-k past them, a nucleus past
them), a full sort runs for the batch, but only that row takes its answer from it.

:func:`target_probs` is the one place that turns logits into the distribution a sampler draws
from; speculative verification must compare drafts against exactly this distribution, so it
reuses it rather than re-deriving the filters.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
from flax import struct

from jspec import topk

# Top-k and top-p look at a candidate set first: the best TOP_P_CANDIDATES (or the static
# top_k when larger). When a row's top-k and nucleus end inside it, as they nearly always do,
# nothing is sorted over the whole vocabulary; otherwise a full sort decides that row, so the
# result is exact.
TOP_P_CANDIDATES = 256


def check(temperature, top_k, top_p, who: str = "") -> None:
    """``ValueError`` (prefixed by ``who``) for settings no sampler takes."""
    pre = f"{who}: " if who else ""
    real = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)
    if not real(temperature) or not temperature >= 0:
        raise ValueError(f"{pre}temperature must be a number >= 0, got {temperature!r}")
    if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"{pre}top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if not real(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"{pre}top_p must be in (0, 1], got {top_p!r}")


def is_greedy(temperature: float, top_k: int) -> bool:
    return temperature == 0.0 or top_k == 1


@struct.dataclass
class RowSampling:
    """One row's settings per leaf, as runtime values (a pytree of ``[B]`` arrays, or
    scalars for every row alike)."""

    temperature: jax.Array           # f32; 0: greedy
    top_k: jax.Array                 # i32; 0: no top-k filter; 1: greedy
    top_p: jax.Array                 # f32; 1: no nucleus filter

    @classmethod
    def full(cls, temperature: float, top_k: int, top_p: float, batch: int | None = None
             ) -> "RowSampling":
        shape = () if batch is None else (batch,)
        return cls(jnp.full(shape, temperature, jnp.float32), jnp.full(shape, top_k, jnp.int32),
                   jnp.full(shape, top_p, jnp.float32))

    @property
    def greedy(self) -> jax.Array:
        return (self.temperature == 0.0) | (self.top_k == 1)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static (hashable) sampling settings. ``temperature == 0`` means greedy.
    ``per_request``: rows may carry other settings (:class:`RowSampling`), so sampling is
    compiled in even when these defaults are greedy."""

    temperature: float = 0.0
    top_k: int = 0        # 0: no top-k filter
    top_p: float = 1.0    # 1.0: no nucleus filter
    per_request: bool = False

    def __post_init__(self):
        check(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        """These defaults are greedy."""
        return is_greedy(self.temperature, self.top_k)

    @property
    def may_sample(self) -> bool:
        """Some row may sample: the sampling machinery is traced (else an argmax alone)."""
        return self.per_request or not self.greedy

    @property
    def candidates(self) -> int:
        return max(TOP_P_CANDIDATES, self.top_k)

    def rows(self, batch: int | None = None) -> RowSampling | None:
        """Every row with these settings (runtime values); None when nothing may sample."""
        if not self.may_sample:
            return None
        return RowSampling.full(self.temperature, self.top_k, self.top_p, batch)

    def resolve(self, temperature=None, top_k=None, top_p=None, who: str = "") -> dict:
        """A request's settings (``temperature``, ``top_k``, ``top_p``; None: these defaults),
        checked: ``ValueError`` for a value no sampler takes, or for sampled settings when
        this config compiles no sampling (:attr:`may_sample`)."""
        out = dict(temperature=self.temperature if temperature is None else temperature,
                   top_k=self.top_k if top_k is None else top_k,
                   top_p=self.top_p if top_p is None else top_p)
        check(**out, who=who)
        if not self.may_sample and not is_greedy(out["temperature"], out["top_k"]):
            raise ValueError(f"{who + ': ' if who else ''}temperature={out['temperature']} "
                             f"samples, and this engine compiles greedy decoding only; make "
                             f"it with sampling=SamplingConfig(per_request=True) to serve "
                             f"sampled requests")
        return dict(temperature=float(out["temperature"]), top_k=int(out["top_k"]),
                    top_p=float(out["top_p"]))

    def row(self, temperature=None, top_k=None, top_p=None) -> RowSampling | None:
        """One row's settings as ``[1]`` runtime values (None: these defaults); None when
        nothing may sample."""
        if not self.may_sample:
            return None
        v = self.resolve(temperature, top_k, top_p)
        return RowSampling.full(v["temperature"], v["top_k"], v["top_p"], 1)


def _per_row(rows: RowSampling, lead: tuple) -> RowSampling:
    """``rows`` (``[B]`` or scalar leaves) broadcast to ``lead + (1,)`` (``lead``: the logits'
    shape less the vocabulary, e.g. ``[B, N]`` of a verified tree)."""
    def one(a):
        a = jnp.asarray(a)
        return jnp.broadcast_to(a.reshape(a.shape + (1,) * (len(lead) - a.ndim)), lead)[..., None]
    return jax.tree.map(one, rows)


def _per_row_or_full(rows_thr, need, full_thr):
    """Each row's threshold from the candidates, or, for the rows that ``need [..., 1]`` it,
    from a full sort (run only when some row does)."""
    return jax.lax.cond(jnp.any(need), lambda: jnp.where(need, full_thr(), rows_thr),
                        lambda: rows_thr)


def filtered_logits(logits: jax.Array, s: SamplingConfig, rows: RowSampling | None = None
                    ) -> jax.Array:
    """Temperature-scaled fp32 logits with filtered-out tokens at -inf, ``[..., V]``, each row by
    its own settings (``rows``; None: ``s``'s for every row). A greedy row comes back unscaled
    and unfiltered (callers take its argmax)."""
    r = _per_row(RowSampling.full(s.temperature, s.top_k, s.top_p) if rows is None else rows,
                 logits.shape[:-1])
    greedy = r.greedy
    # A multiply by the reciprocal, not a divide: XLA may turn a divide by a compile-time
    # constant (a static batch's settings) into this multiply, and a slot's runtime settings
    # must give the same bits.
    x = logits.astype(jnp.float32) * (1.0 / jnp.where(greedy, 1.0, r.temperature))
    V = x.shape[-1]
    k = jnp.where(greedy | (r.top_k >= V), 0, r.top_k)
    top_p = jnp.where(greedy, 1.0, r.top_p)
    C = min(V, s.candidates)
    vals = topk.top_k(x, C)[0]                                    # [..., C] descending
    kth = lambda v: jnp.take_along_axis(v, jnp.clip(k - 1, 0, v.shape[-1] - 1), axis=-1)
    thr = kth(vals)
    if C < V:
        thr = _per_row_or_full(thr, k > C, lambda: kth(-jnp.sort(-x, axis=-1)))
    thr = jnp.where(k > 0, thr, -jnp.inf)
    x = jnp.where(x < thr, -jnp.inf, x)
    vals = jnp.where(vals < thr, -jnp.inf, vals)                  # the top C of the filtered x
    return jnp.where(_top_p_keep(x, vals, top_p), x, -jnp.inf)


def _top_p_keep(x: jax.Array, vals: jax.Array, top_p: jax.Array) -> jax.Array:
    """Which tokens the nucleus keeps (every token where ``top_p [..., 1]`` is 1): in
    descending order, a token stays while the mass strictly before it is below ``top_p`` (so
    the best token always stays); tokens tied with the last one kept stay too. ``vals``: the
    best ``C`` of ``x``, descending."""
    C, V = vals.shape[-1], x.shape[-1]
    logz = jax.nn.logsumexp(x, axis=-1, keepdims=True)

    def threshold(v):                    # v: sorted descending, a prefix of all logits
        p = jnp.exp(v - logz)
        n = jnp.sum((jnp.cumsum(p, axis=-1) - p) < top_p, axis=-1, keepdims=True)
        return jnp.take_along_axis(v, n - 1, axis=-1), n

    off = top_p >= 1.0
    thr, n = threshold(vals)
    if C < V:
        # The nucleus is inside the candidates when it stops before their end, or when they
        # hold every finite logit (the top-k filter already dropped the rest).
        inside = off | (n < C) | (jnp.isfinite(x).sum(-1, keepdims=True) <= C)
        thr = _per_row_or_full(thr, ~inside, lambda: threshold(-jnp.sort(-x, axis=-1))[0])
    return off | (x >= thr)


def target_probs(logits: jax.Array, s: SamplingConfig, rows: RowSampling | None = None
                 ) -> jax.Array:
    """The distribution tokens are drawn from, ``[..., V]``; one-hot of the argmax for a
    greedy row. ``rows``: each row's settings (None: ``s``'s for every row)."""
    onehot = lambda: jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1],
                                    dtype=jnp.float32)
    if rows is None and s.greedy:
        return onehot()
    r = RowSampling.full(s.temperature, s.top_k, s.top_p) if rows is None else rows
    greedy = _per_row(r, logits.shape[:-1]).greedy
    return jnp.where(greedy, onehot(), jax.nn.softmax(filtered_logits(logits, s, r), axis=-1))


def sample(logits: jax.Array, keys: jax.Array, s: SamplingConfig,
           rows: RowSampling | None = None) -> jax.Array:
    """One token per row. ``logits: [..., V]``, ``keys`` one PRNG key per row (``[...]``),
    ``rows``: each row's settings (None: ``s``'s for every row). A batch of greedy rows
    costs an argmax alone (nothing else runs)."""
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if rows is None and s.greedy:
        return argmax
    r = RowSampling.full(s.temperature, s.top_k, s.top_p) if rows is None else rows
    greedy = _per_row(r, logits.shape[:-1]).greedy[..., 0]
    lead, V = logits.shape[:-1], logits.shape[-1]

    def draw():
        x = filtered_logits(logits, s, r).reshape(-1, V)
        tok = jax.vmap(jax.random.categorical)(keys.reshape(-1), x).astype(jnp.int32)
        return jnp.where(greedy, argmax, tok.reshape(lead))

    return jax.lax.cond(jnp.all(greedy), lambda: argmax, draw)
