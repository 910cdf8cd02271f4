"""Shapes and helpers of the device benchmark's sections (:mod:`benchmarks.device`).

:class:`Plan` holds every size a section uses (full or ``--smoke``); the rest builds what the
sections time (random weights and drafters drawn on the device, the verify forward as the
driver runs it), counts the bytes a decode step reads, compiles programs in parallel threads
and times them round-robin. JAX is imported inside the functions: the parent process that
imports this module never starts a backend.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import time


# ====================================================================== shapes
class Plan:
    """Every size a section uses, full or ``--smoke``."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.config = "tiny" if smoke else "llama3-8b"
        self.dtype = "bfloat16"
        self.context = 64 if smoke else 2048
        self.batches = (1, 2) if smoke else (1, 8)
        self.nodes = (1, 8) if smoke else (1, 4, 8, 16, 32, 64)
        self.page_size = 16
        self.draft_vocab = 128 if smoke else 32768
        self.spec = (5, 4, 8)
        self.accepts = (2,) if smoke else (2, 3, 4)
        self.new_tokens = 16 if smoke else 128
        self.repeats = 3 if smoke else 20
        self.e2e_repeats = 2 if smoke else 3
        self.copy_bytes = (1 << 24) if smoke else (1 << 31)
        self.kernel_nodes = (1, 4) if smoke else (1, 8, 64)
        self.walk_vocab = 256 if smoke else 128256

    def target_config(self):
        from jspec.bench.configs import RANDOM_CONFIGS, random_config
        if self.config in RANDOM_CONFIGS:
            return random_config(self.config, self.dtype)
        # Only when configs.py lacks the entry (it has it since the anatomy bench).
        from jspec.bench.configs import LLAMA3_ROPE
        from jspec.config import LlamaConfig
        return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                           num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                           rope=LLAMA3_ROPE, tie_word_embeddings=False,
                           max_position_embeddings=131072, bos_token_id=128000,
                           eos_token_ids=(128001, 128009), dtype=self.dtype)


# ====================================================================== device helpers
def device_info() -> dict:
    import jax
    d = jax.devices()[0]
    return {"jax": jax.__version__, "backend": jax.default_backend(), "platform": d.platform,
            "device_kind": d.device_kind, "num_devices": jax.device_count()}


def device_random_params(cfg, seed: int = 0):
    """Random checkpoint-layout parameters drawn on the device (no host copy), distributed
    like :func:`jspec.bench.common.random_params`: embeddings ~ N(0, 1), ``[in, out]``
    kernels ~ N(0, 1/in), norm scales ~ 1 + 0.2 N(0, 1). One jitted program."""
    import jax

    from jspec import llama

    abstract = jax.eval_shape(lambda k: llama.init_params(cfg, k), jax.random.key(0))
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)

    def draw(key):
        leaves = []
        for k, (path, s) in zip(jax.random.split(key, len(flat)), flat):
            name = str(getattr(path[-1], "key", path[-1]))
            x = jax.random.normal(k, s.shape, s.dtype)
            if name == "scale":
                x = 1.0 + 0.2 * x
            elif name == "kernel":
                x = x * (1.0 / math.sqrt(s.shape[0]))
            leaves.append(x.astype(s.dtype))
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return jax.jit(draw)(jax.random.key(seed))


def device_random_drafter(kind: str, cfg, seed: int = 0, **kw):
    """:func:`jspec.drafters.random_drafter`, its initialisation compiled as one program
    (run eagerly, every initialiser op would compile on its own)."""
    import jax

    from jspec.drafters import Drafter, random_drafter

    box = {}

    def init(key):
        d = random_drafter(kind, cfg, key, **kw)
        box["module"] = d.module
        return d.params

    params = jax.jit(init)(jax.random.key(seed))
    return Drafter(box["module"], params)


def make_target(plan: Plan, seed: int = 0):
    """``(cfg, target)`` with random device weights in the layout the decoders run (the
    checkpoint-layout copy is dropped once packed, where the library packs)."""
    import jax

    from jspec.target import Target

    cfg = plan.target_config()
    target = Target(cfg, device_random_params(cfg, seed))
    packed = getattr(target, "serving_params", None)
    if packed is not None:
        target = Target(cfg, packed)
    jax.block_until_ready(target.params)
    return cfg, target


def weight_bytes(cfg, params) -> int:
    """Bytes of weights one decode step reads: every parameter except the input embedding
    (only B rows of it are read), unless it doubles as the (tied) LM head."""
    import jax
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if not cfg.tie_word_embeddings:
        total -= cfg.vocab_size * cfg.hidden_size * jax.tree.leaves(params)[0].dtype.itemsize
    return int(total)


def kv_bytes(cfg, batch: int, positions: int) -> int:
    import jax.numpy as jnp
    return int(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
               * batch * positions)


def binary_parents(n: int):
    import numpy as np
    return np.concatenate([[-1], np.arange(n - 1) // 2]).astype(np.int32)


def compile_all(jobs: dict, log=print) -> dict:
    """``{name: (fn, args, donate)}`` -> ``{name: (compiled, seconds)}``: lowered one by one
    (tracing holds the GIL), compiled in parallel threads (XLA releases it)."""
    import jax
    lowered, t_lower = {}, {}
    for name, (fn, args, donate) in jobs.items():
        t0 = time.perf_counter()
        lowered[name] = jax.jit(fn, donate_argnums=donate).lower(*args)
        t_lower[name] = time.perf_counter() - t0

    def comp(name):
        t0 = time.perf_counter()
        c = lowered[name].compile()
        return name, c, time.perf_counter() - t0 + t_lower[name]

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max(1, min(8, len(jobs)))) as ex:
        out = {n: (c, s) for n, c, s in ex.map(comp, list(jobs))}
    log(f"  compiled {len(jobs)} programs in {time.perf_counter() - t0:.1f}s "
        f"(+{sum(t_lower.values()):.1f}s lowering)")
    return out


class VerifyBench:
    """The driver's verify forward (``SpecDecoder.verify``: target forward over a tree with
    its mask, logits, features) for given (batch, N), on a random cache of ``context``
    committed positions; the cache is donated and threaded back as the decode loop does."""

    def __init__(self, plan: Plan, cfg, target, seed: int = 0):
        from benchmarks.anatomy import abstract_drafter
        self.plan, self.cfg, self.target, self.seed = plan, cfg, target, seed
        self.modes = {}
        # verify() reads only the drafter's feature layout (EAGLE-1: the final hidden state,
        # no aux layers), so abstract drafter params do.
        self.drafter = abstract_drafter("eagle1", cfg)

    def job(self, batch: int, N: int):
        import jax
        import numpy as np

        from jspec import kernels
        from jspec.bench import common
        from jspec.sampling import SamplingConfig
        from jspec.spec_config import SpecConfig
        from jspec.spec_decode import SpecDecoder
        from jspec.tree.build import build_tree

        cfg, plan = self.cfg, self.plan
        cache = jax.jit(common.make_cache, static_argnums=(0, 1, 2, 3, 4, 5))(
            cfg, batch, plan.context, N, plan.page_size, self.seed)
        mode = kernels.resolve("auto", cfg, page_size=plan.page_size, num_nodes=N, batch=batch,
                               max_pages=cache.page_table.shape[1], num_pages=cache.num_pages)
        self.modes[f"b{batch} N{N}"] = mode
        # verify() uses none of the tree knobs: a valid (5, 4, 8) stands in for them.
        dec = SpecDecoder(cfg, self.drafter.module, SpecConfig(5, 4, 8), SamplingConfig(0.0), 1,
                          plan.page_size, cache.num_pages, 0.0, None, mode)
        depth = max(1, int(np.ceil(np.log2(N + 1))))
        rng = np.random.default_rng(self.seed + N)
        tokens = rng.integers(0, cfg.vocab_size, (batch, N)).astype(np.int32)
        parents = np.broadcast_to(binary_parents(N), (batch, N))
        tree = jax.jit(build_tree, static_argnums=2)(tokens, parents, depth)
        fn = lambda p, c, t: dec.verify(p, c, t)
        return fn, (self.target.params, cache, tree), (1,)

    def runner(self, compiled, args):
        import jax
        state = {"cache": args[1]}
        params, tree = args[0], args[2]

        def call():
            logits, feats, state["cache"] = compiled(params, state["cache"], tree)
            jax.block_until_ready((logits, state["cache"]))
        return call
