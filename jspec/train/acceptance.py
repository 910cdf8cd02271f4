"""Acceptance of trained draft heads (greedy), two ways.

End to end: :func:`jspec.generate` with the drafter on held-out prompts; the mean accept
length is tokens emitted per verify pass (accepted drafts + the bonus), pooled over rows.

Teacher forced: on held-out *sampled* sequences ``x``, at each committed length ``L`` the
drafter is prefilled with the target's features of ``x[:L]`` (pairs (feature i, x[i+1]) for
i < L, exactly as the driver's prefill does) and proposes a tree under the root ``x[L]``
through its real ``propose``; the accept length is 1 + the longest tree path matching the
target's greedy continuation of ``x[:L+1]`` (computed once with :func:`jspec.generate`),
found with the driver's own :func:`~jspec.verify.greedy_walk`. Averaged over all (x, L).

Modes per drafter kind (``chain`` has the depth of ``default``, so tree-vs-chain compares
equal depths): EAGLE-1/3 chain(5), (5,4,8), (6,8,32); MTP chain(3), (3,2,6), (6,8,32);
Medusa chain(4), its default 63-path tree (truncated to its heads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters import Drafter
from jspec.verify import greedy_walk

def modes_of(drafter: Drafter) -> dict:
    """``{mode: spec}`` the acceptance table compares for a drafter (its registry entry)."""
    return {name: drafter.entry.mode(name, drafter.module) for name in drafter.entry.modes}


def spec_name(spec, module=None) -> str:
    if spec is None:
        if module is None:
            return "default tree"
        S, N = module.tree_shape(None)          # the drafter's own default shape
        return f"({S},1,{N})" if N == S + 1 else f"{N}-node static tree"
    return f"({spec.num_steps},{spec.topk},{spec.num_draft_tokens})"


def random_like(d: Drafter, target, key) -> Drafter:
    """Same architecture, random weights (EAGLE-3 keeps its d2t): the baseline."""
    p = d.module.init_params(key, target.config)
    for k in ("d2t", "token_map"):
        if k in d.params:
            p[k] = d.params[k]
    return Drafter(d.module, p)


def _depth(module, spec) -> int:
    return module.tree_shape(spec)[0]


def aux_layers_of(module):
    """The aux layers a drafter reads (EAGLE-3), for :class:`TeacherForced`; None otherwise."""
    return module.target_layers or None


# ------------------------------------------------------------------ end to end
def e2e_accept(target, drafter: Drafter, prompts, spec, max_new_tokens: int = 128) -> float:
    import jspec
    res = jspec.generate(target, prompts, max_new_tokens=max_new_tokens, temperature=0.0,
                         drafter=drafter, spec=spec)
    h = np.sum([s["accept_hist"] for s in res.stats], axis=0)
    return float((h * np.arange(len(h))).sum() / max(1, h.sum()))


# ------------------------------------------------------------------ teacher forced
class TeacherForced:
    """Held-out sequences, their target features and greedy continuations, prepared once."""

    def __init__(self, target, seqs, aux_layers=None, max_depth: int = 6, stride: int = 1,
                 chunk: int = 256, page_size: int = 16, starts=None):
        """``starts``: per sequence, the first committed length L to evaluate (default 1;
        e.g. the prompt length, to evaluate only where generation drafts)."""
        import jspec
        from jspec.train.features import aux_layers_for, make_target_pass, pad_sequences
        cfg = target.config
        self.target, self.chunk, self.page_size = target, chunk, page_size
        self.aux_layers = tuple(aux_layers or aux_layers_for(cfg.num_layers))
        self.tokens, self.lens = pad_sequences(seqs)
        N, T = self.tokens.shape
        run = make_target_pass(cfg, self.aux_layers, 1)
        hid, aux = [], []
        for b in range(0, N, 32):
            tb = self.tokens[b:b + 32]
            n = len(tb)
            tb = np.concatenate([tb, np.zeros((32 - n, T), np.int32)])
            h, a, _, _ = jax.device_get(run(target.params, jnp.asarray(tb)))
            hid.append(h[:n])
            aux.append(a[:n])
        self.hidden, self.aux = np.concatenate(hid), np.concatenate(aux)
        # Rows: (sequence, committed length L); root = x[L]; L in [1, len - 1].
        first = [1] * N if starts is None else [max(1, int(x)) for x in starts]
        self.rows = np.array([(s, L) for s in range(N)
                              for L in range(first[s], int(self.lens[s]), stride)], np.int32)
        # Greedy continuation of x[:L+1]: g[r, d] is the target's token after depth d.
        g = np.zeros((len(self.rows), max_depth + 1), np.int32)
        for lo in range(0, len(self.rows), chunk):
            part = self.rows[lo:lo + chunk]
            prompts = [self.tokens[s, :L + 1].tolist() for s, L in part]
            prompts += [prompts[0]] * (chunk - len(prompts))
            res = jspec.generate(target, prompts, max_new_tokens=max_depth + 1, temperature=0.0,
                                 stop_ids=[])
            g[lo:lo + len(part)] = np.array(res.tokens[:len(part)], np.int32)
        self.greedy = g
        self.max_depth = max_depth

    def _pool_fn(self, module, spec):
        """``(dparams, tparams, feats, nxt, lens, root) -> CandidatePool``: the drafter's own
        prefill and draft loop; ``module=None``: the target as its own drafter."""
        if module is None:
            return self._self_pool_fn(spec)
        cfg, ps, B = self.target.config, self.page_size, self.chunk
        slots = self.tokens.shape[1] + max(module.cache_slots(spec), 1) + 1
        pages = -(-slots // ps)
        table = jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages)

        def pool(dparams, tparams, feats, nxt, lens, root):
            state = module.init_state(B, table, B * pages, ps)
            state = module.prefill(dparams, (cfg, tparams), state, feats, nxt, lens)
            return module.draft_pool(dparams, (cfg, tparams), state, spec)
        return pool

    def _self_pool_fn(self, spec):
        """EAGLE-2's loop with the target as the drafter: every frontier path is scored by a
        full (uncached) target pass over the sequence with the path written after the root.
        For the acceptance ceiling only; it costs K target passes per tree step."""
        from jspec import kv_cache as kvc
        from jspec.drafters.base import top_k_logprobs
        from jspec.llama import Llama
        from jspec.tree.select import grow_pool
        cfg, ps, B = self.target.config, self.page_size, self.chunk
        S, K = spec.num_steps, spec.topk
        Tt = self.tokens.shape[1] + S
        model = Llama(cfg)
        pages = kvc.pages_needed(Tt, ps)
        table = jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages)

        def logits_at(tparams, seqs, at):                       # [B, Tt], [B] -> [B, V]
            cache = kvc.init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, table,
                                   B * pages, ps, cfg.dtype)
            pos = jnp.broadcast_to(jnp.arange(Tt, dtype=jnp.int32), (B, Tt))
            hidden, _, _ = model.apply({"params": tparams}, seqs, pos, cache)
            h = jnp.take_along_axis(hidden, at[:, None, None], axis=1)
            return model.apply({"params": tparams}, h, method=Llama.logits)[:, 0].astype(jnp.float32)

        def pool(dparams, tparams, x, lens, root):
            x = jnp.pad(x, ((0, 0), (0, S)))                    # root = x[L] sits at L = lens
            j = jnp.arange(Tt)[None] - (lens + 1)[:, None]         # path offset of each position

            def children(s, paths):                              # paths [B, K, s] after the root
                inside = ((j >= 0) & (j < s))[:, None]
                seqs = jnp.where(inside, jnp.take_along_axis(
                    paths, jnp.clip(j, 0, s - 1)[:, None].repeat(K, 1), axis=2), x[:, None])
                logits = jax.lax.map(lambda q: logits_at(tparams, q, lens + s),
                                     jnp.moveaxis(seqs, 1, 0))
                return top_k_logprobs(jnp.moveaxis(logits, 0, 1), K)          # [B, K, K]
            logq0, tok0 = top_k_logprobs(logits_at(tparams, x, lens), K)
            return grow_pool(tok0, logq0, children, S, spec.selection, dparams)
        return pool

    def _fn(self, module, spec, what: str):
        """A jitted run over one chunk: ``what="accept"`` -> accept lengths ``[B]``;
        ``"records"`` -> ``(parent_on_path, hit, logq, x, token_key, pair_key)`` over the
        pool ``[B, M]`` for calibration."""
        from jspec.tree.calibration import pool_features
        from jspec.tree.select import CandidatePool, select_pool
        S = _depth(module, spec) if module is not None else spec.num_steps
        cfg, B = self.target.config, self.chunk
        if module is not None and not module.has_pool:
            if what != "accept":
                raise ValueError(f"a {module.kind} drafter has no candidate pool to calibrate")
            slots = self.tokens.shape[1] + max(module.cache_slots(spec) if spec else 0, 1) + 1
            pages = -(-slots // self.page_size)
            table = jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages)

            def tree_of(dparams, tparams, feats, nxt, lens, root):
                state = module.init_state(B, table, B * pages, self.page_size)
                state = module.prefill(dparams, (cfg, tparams), state, feats, nxt, lens)
                return module.propose(dparams, (cfg, tparams), state, root, spec)
        else:
            pool_of = self._pool_fn(module, spec)

            def tree_of(*args):
                return select_pool(args[-1], pool_of(*args), spec.num_draft_tokens, S)[0]

        @jax.jit
        def run(g, *args):
            if what == "accept":
                tree = tree_of(*args)
                argmax = jnp.take_along_axis(g, jnp.clip(tree.depths, 0, g.shape[1] - 1), axis=1)
                return greedy_walk(tree, argmax, S)[1]
            pool = pool_of(*args)
            step, _ = CandidatePool.depth_rank(pool.tokens.shape[1], spec.topk)
            # A node at tree step s (depth s + 1) is accepted iff it is the target's greedy token
            # after its parent, g[s], and its parent was accepted.
            match = pool.tokens == jnp.take_along_axis(g, jnp.broadcast_to(step, pool.tokens.shape),
                                                       axis=1)
            root_child = pool.parents < 0
            on = match & root_child
            par = jnp.clip(pool.parents, 0, None)
            for _ in range(S - 1):
                on = match & (root_child | jnp.take_along_axis(on, par, axis=1))
            parent_on = root_child | jnp.take_along_axis(on, par, axis=1)
            x, token_key, pair_key = pool_features(pool.logq, pool.parents, pool.tokens,
                                                   spec.topk)
            return parent_on, on, pool.logq, x, token_key, pair_key
        return run

    def _chunks(self, module, dparams):
        """Per chunk of rows: ``(n, run args after g)``; chunks padded to ``self.chunk``."""
        nxt_all = np.concatenate([self.tokens[:, 1:], np.zeros_like(self.tokens[:, :1])], 1)
        if module is not None and module.target_layers:
            if tuple(module.target_layers) != self.aux_layers:
                raise ValueError(f"drafter reads aux layers {module.target_layers}, features "
                                 f"were computed for {self.aux_layers}")

        def feats(s):             # self.aux holds the aux states already concatenated
            aux = (self.aux[s],) if module.target_layers else ()
            return module.features(jnp.asarray(self.hidden[s]), aux, jnp.asarray(self.tokens[s]))
        for lo in range(0, len(self.rows), self.chunk):
            part = self.rows[lo:lo + self.chunk]
            n = len(part)
            idx = np.concatenate([part, np.repeat(part[:1], self.chunk - n, 0)])
            s, L = idx[:, 0], idx[:, 1]
            g = np.concatenate([self.greedy[lo:lo + n],
                                np.repeat(self.greedy[lo:lo + 1], self.chunk - n, 0)])
            root = jnp.asarray(self.tokens[s, L])
            if module is None:       # the target as its own drafter reads the tokens themselves
                x = np.where(np.arange(self.tokens.shape[1])[None] <= L[:, None], self.tokens[s], 0)
                args = (dparams, self.target.params, jnp.asarray(x), jnp.asarray(L), root)
            else:
                args = (dparams, self.target.params, feats(s), jnp.asarray(nxt_all[s]),
                        jnp.asarray(L), root)
            yield n, (jnp.asarray(g),) + args

    def _check_depth(self, module, spec):
        depth = _depth(module, spec) if module is not None else spec.num_steps
        if depth > self.max_depth:
            raise ValueError(f"tree depth {depth} > max_depth {self.max_depth}")

    def accept(self, drafter: Drafter | None, spec, calibration=None) -> float:
        """Mean accept length of ``drafter`` (None: the target as its own drafter, for the
        ceiling; ``calibration``: its model when ``spec.selection == "calibrated"``)."""
        module = None if drafter is None else drafter.module
        self._check_depth(module, spec)
        dparams = drafter.params if drafter is not None else _self_params(calibration)
        run = self._fn(module, spec, "accept")
        total, count = 0, 0
        for n, args in self._chunks(module, dparams):
            total += int(np.asarray(run(*args))[:n].sum())
            count += n
        return total / max(1, count)

    def records(self, drafter: Drafter | None, spec) -> dict:
        """Calibration records from the EAGLE-2 candidate pools of ``spec`` at every row:
        for each candidate whose parent is on the target's greedy path, its tree ``step``,
        sibling ``rank``, drafter probability ``q``, calibration features ``x [n, F]`` and
        keys ``token_key``, ``pair_key`` (:func:`jspec.tree.calibration.pool_features`), and
        whether it is the greedy token (``hit``)."""
        from jspec.tree.select import CandidatePool
        module = None if drafter is None else drafter.module
        self._check_depth(module, spec)
        dparams = drafter.params if drafter is not None else {}
        run = self._fn(module, spec, "records")
        step, rank = (np.asarray(x) for x in CandidatePool.depth_rank(spec.pool_size, spec.topk))
        out = {k: [] for k in ("step", "rank", "q", "x", "token_key", "pair_key", "hit")}
        for n, args in self._chunks(module, dparams):
            elig, hit, logq, x, token_key, pair_key = (np.asarray(a)[:n] for a in run(*args))
            rows, cols = np.nonzero(elig)
            out["step"].append(step[cols])
            out["rank"].append(rank[cols])
            out["q"].append(np.exp(logq[rows, cols]))
            out["x"].append(x[rows, cols])
            out["token_key"].append(token_key[rows, cols])
            out["pair_key"].append(pair_key[rows, cols])
            out["hit"].append(hit[rows, cols])
        return {k: np.concatenate(v) for k, v in out.items()}


def _self_params(calibration):
    from jspec.tree.calibration import PARAM_KEY
    if calibration is None:
        return {}
    return {PARAM_KEY: {k: jnp.asarray(v, jnp.float32) for k, v in calibration.items()}}


# ------------------------------------------------------------------ table
def acceptance_table(target, drafters: dict, prompts, heldout_seqs, *, max_new_tokens=128,
                     stride: int = 1, modes=("chain", "default", "wide"), log=print) -> list[dict]:
    rows = []
    tf_cache = {}
    for name, d in drafters.items():
        aux = aux_layers_of(d.module)
        specs = {m: s for m, s in modes_of(d).items() if m in modes}
        # The greedy continuations reach the deepest shape compared (DFlash's block: 15).
        depth = max([6] + [_depth(d.module, s) for s in specs.values()])
        for mode, spec in specs.items():
            row = {"drafter": name, "mode": mode, "spec": spec_name(spec, d.module)}
            if prompts:
                row["e2e"] = e2e_accept(target, d, prompts, spec, max_new_tokens)
            if len(heldout_seqs):
                key = (aux, depth)
                if key not in tf_cache:
                    tf_cache[key] = TeacherForced(target, heldout_seqs, aux_layers=aux,
                                                  max_depth=depth, stride=stride)
                row["teacher_forced"] = tf_cache[key].accept(d, spec)
            log(f"  {row}")
            rows.append(row)
    return rows


def format_table(rows) -> str:
    head = f"| {'drafter':<18} | {'mode':<7} | {'spec':<11} | {'e2e':>6} | {'teacher-forced':>14} |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        e2e = f"{r['e2e']:.3f}" if "e2e" in r else "-"
        tf = f"{r['teacher_forced']:.3f}" if "teacher_forced" in r else "-"
        lines.append(f"| {r['drafter']:<18} | {r['mode']:<7} | {r['spec']:<11} | {e2e:>6} | {tf:>14} |")
    return "\n".join(lines)
