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
from jspec.spec_config import SpecConfig
from jspec.verify import greedy_walk

MODES = {
    "eagle3": {"chain": SpecConfig.chain(5), "default": SpecConfig(5, 4, 8),
               "wide": SpecConfig(6, 8, 32)},
    "eagle1": {"chain": SpecConfig.chain(5), "default": SpecConfig(5, 4, 8),
               "wide": SpecConfig(6, 8, 32)},
    "mtp": {"chain": SpecConfig.chain(3), "default": SpecConfig(3, 2, 6),
            "wide": SpecConfig(6, 8, 32)},
    "medusa": {"chain": SpecConfig.chain(4), "default": None},
}


def spec_name(spec) -> str:
    if spec is None:
        return "medusa tree"
    return f"({spec.num_steps},{spec.topk},{spec.num_draft_tokens})"


def random_like(d: Drafter, target, key) -> Drafter:
    """Same architecture, random weights (EAGLE-3 keeps its d2t): the baseline."""
    p = d.module.init_params(key, target.config)
    for k in ("d2t", "token_map"):
        if k in d.params:
            p[k] = d.params[k]
    return Drafter(d.module, p)


def _depth(module, spec) -> int:
    if module.kind == "medusa":
        return module.tree(spec).depth
    return spec.num_steps


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

    def _fn(self, module, spec):
        cfg = self.target.config
        T = self.tokens.shape[1]
        ps = self.page_size
        B = self.chunk
        slots = T + max(module.cache_slots(spec) if spec is not None else 0, 1) + 1
        pages = -(-slots // ps)
        table = jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages)

        @jax.jit
        def run(dparams, tparams, feats, nxt, lens, root, g):
            state = module.init_state(B, table, B * pages, ps)
            state = module.prefill(dparams, (cfg, tparams), state, feats, nxt, lens)
            tree = module.propose(dparams, (cfg, tparams), state, root, spec)
            argmax = jnp.take_along_axis(g, jnp.clip(tree.depths, 0, g.shape[1] - 1), axis=1)
            _, n, _ = greedy_walk(tree, argmax, _depth(module, spec))
            return n
        return run

    def accept(self, drafter: Drafter, spec) -> float:
        module = drafter.module
        if _depth(module, spec) > self.max_depth:
            raise ValueError(f"tree depth {_depth(module, spec)} > max_depth {self.max_depth}")
        fsrc = self.aux if getattr(module, "feature_source", "final") == "aux" else self.hidden
        if fsrc is self.aux and tuple(module.aux_layers) != self.aux_layers:
            raise ValueError(f"drafter reads aux layers {module.aux_layers}, features were "
                             f"computed for {self.aux_layers}")
        run = self._fn(module, spec)
        nxt_all = np.concatenate([self.tokens[:, 1:], np.zeros_like(self.tokens[:, :1])], 1)
        total, count = 0, 0
        for lo in range(0, len(self.rows), self.chunk):
            part = self.rows[lo:lo + self.chunk]
            n = len(part)
            idx = np.concatenate([part, np.repeat(part[:1], self.chunk - n, 0)])
            s, L = idx[:, 0], idx[:, 1]
            g = np.concatenate([self.greedy[lo:lo + n],
                                np.repeat(self.greedy[lo:lo + 1], self.chunk - n, 0)])
            acc = run(drafter.params, self.target.params, jnp.asarray(fsrc[s]),
                      jnp.asarray(nxt_all[s]), jnp.asarray(L), jnp.asarray(self.tokens[s, L]),
                      jnp.asarray(g))
            total += int(np.asarray(acc)[:n].sum())
            count += n
        return total / max(1, count)


# ------------------------------------------------------------------ table
def acceptance_table(target, drafters: dict, prompts, heldout_seqs, *, max_new_tokens=128,
                     stride: int = 1, modes=("chain", "default", "wide"), log=print) -> list[dict]:
    rows = []
    tf_cache = {}
    for name, d in drafters.items():
        kind = d.module.kind
        aux = tuple(d.module.aux_layers) if d.module.feature_source == "aux" else None
        for mode, spec in MODES[kind].items():
            if mode not in modes:
                continue
            row = {"drafter": name, "mode": mode, "spec": spec_name(spec)}
            if prompts:
                row["e2e"] = e2e_accept(target, d, prompts, spec, max_new_tokens)
            if len(heldout_seqs):
                key = aux
                if key not in tf_cache:
                    tf_cache[key] = TeacherForced(target, heldout_seqs, aux_layers=aux,
                                                  stride=stride)
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
