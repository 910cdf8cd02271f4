"""The drafter training loop: offline or online, on one device or a ``(data, model)`` mesh,
checkpointed with Orbax, stopped cleanly by SIGTERM.

- **Offline** (``TrainConfig.online=False``): batches come with the target's cached
  features (:mod:`jspec.train.features`).
- **Online**: batches are tokens; the target's forward runs inside the jitted step
  (:mod:`jspec.train.online`), forward only and stop-gradiented, sharded over ``model`` as
  for inference. Both modes hand the loss the same batch for the same tokens, so they
  train the same drafter; online writes nothing to disk.
- **Mesh**: rows over ``data`` (gradients reduced over ``data`` by the partitioner), the
  target over ``model``, the drafter replicated or FSDP-sharded (:mod:`jspec.train.placement`).
  Every process of a multi-host run (``jax.distributed``) runs the same command.
- **Checkpoints** (:mod:`jspec.train.checkpoints`): asynchronous, every ``ckpt_every``
  steps, the last ``keep`` kept; ``resume=True`` continues from the latest one exactly (the
  data position included: :class:`~jspec.train.sources.ArraySource` batches depend only
  on the step, a pipeline's iterator position is saved beside the state). SIGTERM (a
  preempted VM) finishes the step, saves, and returns.
- **Metrics**: one JSON line per ``log_every`` steps (step, loss, per-step agreement
  ``acc*``, tokens/s) to ``metrics_path``; a resumed run appends, so a reader keeps each
  step's last line (:func:`read_metrics`).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jspec.drafters import Drafter
from jspec.train.checkpoints import Checkpoints
from jspec.train.drafter import LossConfig, default_loss, draft_t2d, drafter_loss, split_params
from jspec.train.online import with_target_features
from jspec.train.optim import TrainState, make_optimizer
from jspec.train.placement import place, state_shardings
from jspec.train.sources import ArraySource, is_online


@dataclasses.dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    ckpt_every: int = 200
    keep: int = 3                 # checkpoints kept
    log_every: int = 50
    max_seconds: float = 0.0      # > 0: stop (and checkpoint) after this much wall time
    stop_after: int = 0           # > 0: stop (and checkpoint) after this step (interruptions)
    online: bool = False          # the target's forward inside the step (data: tokens only)
    topk: int = 16                # online: the target's top-k kept as soft labels
    fsdp: bool = False            # shard the drafter's parameters and optimizer state over data


_STEP_CACHE: dict = {}


def make_train_step(module, target_cfg, lc: LossConfig, tc: TrainConfig, state_sh=None,
                    mesh=None):
    """Jitted ``(state, frozen, t2d, target_params, batch) -> (state, metrics)``, cached per
    (module, loss, optimizer, mode, mesh) so repeated runs do not recompile. ``state_sh``:
    the state's shardings on ``mesh`` (kept across steps)."""
    key = (module, target_cfg, lc, tc.lr, tc.warmup, tc.steps, tc.weight_decay, tc.clip,
           tc.online, tc.topk, tc.fsdp, mesh)
    if key in _STEP_CACHE:
        return _STEP_CACHE[key]
    tx = make_optimizer(tc.lr, tc.warmup, tc.steps, tc.weight_decay, tc.clip)

    def step(state: TrainState, frozen, t2d, target_params, batch):
        if tc.online:
            batch = with_target_features(module, target_cfg, target_params, batch, tc.topk)

        def loss_fn(p):
            return drafter_loss(module, {**p, **frozen}, target_cfg, target_params, batch, lc, t2d)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        metrics["loss"] = loss
        metrics["grad_norm"] = optax.global_norm(grads)
        return state.apply_gradients(grads, tx), metrics

    out = None if mesh is None else (state_sh, NamedSharding(mesh, P()))
    fn = jax.jit(step, out_shardings=out, donate_argnums=0)
    _STEP_CACHE[key] = (tx, fn)
    return tx, fn


def _on_mesh(params, mesh) -> bool:
    return all(getattr(getattr(x, "sharding", None), "mesh", None) == mesh
               for x in jax.tree.leaves(params))


def _local(x):
    """A replicated value on this process (also where the array spans other processes)."""
    return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)


def host(tree):
    """Device arrays -> numpy on every process (a multi-host FSDP state is gathered)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


class _Preempted:
    """SIGTERM sets a flag the loop checks after each step (main thread only)."""

    def __init__(self):
        self.hit, self.old = False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._set)
        return self

    def _set(self, *_):
        self.hit = True

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGTERM, self.old)


def fresh_state(trainable, tc: TrainConfig) -> TrainState:
    """Step 0's state. fp32 master weights (so fp32 Adam moments) whatever the target's dtype:
    a bf16 target builds a bf16 drafter, and bf16 updates lose the small steps late in
    training. A copy, also because the step donates the state and the caller's drafter keeps
    its arrays."""
    tx = make_optimizer(tc.lr, tc.warmup, tc.steps, tc.weight_decay, tc.clip)
    trainable = jax.tree.map(lambda x: jnp.array(
        x, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, copy=True),
        trainable)
    return TrainState.create(trainable, tx, jax.random.key_data(jax.random.key(tc.seed)))


def _start(drafter: Drafter, target, tc: TrainConfig, mesh):
    """``(target, state, state shardings, frozen, frozen on the host, t2d)``: a fresh train
    state, placed on ``mesh`` with the target (None: where they are)."""
    if mesh is not None and not _on_mesh(target.params, mesh):
        from jspec.target import shard_target
        target = shard_target(target, mesh)
    trainable, frozen = split_params(drafter.params)
    frozen_host = jax.device_get(frozen)
    t2d = draft_t2d(drafter.module, frozen, target.config.vocab_size)
    state = fresh_state(trainable, tc)
    state_sh = None
    if mesh is not None:
        state_sh = state_shardings(state, mesh, tc.fsdp)
        state = place(state, state_sh)
        rep = NamedSharding(mesh, P())
        frozen = place(frozen, jax.tree.map(lambda _: rep, frozen))
        t2d = None if t2d is None else place(t2d, rep)
    return target, state, state_sh, frozen, frozen_host, t2d


def train(drafter: Drafter, target, data: dict | None, tc: TrainConfig,
          lc: LossConfig | None = None, ckpt_dir=None, *, resume: bool = False, mesh=None,
          source=None, metrics_path=None, evaluate=None, eval_every: int = 0,
          progress: bool = True, log=print):
    """Train ``drafter``; returns ``(Drafter with trained params, last metrics)``.

    ``data``: a feature cache (offline) or ``tokens / lens`` (``tc.online``), drawn by an
    :class:`~jspec.train.sources.ArraySource`; or pass ``source`` (a streaming pipeline).
    ``ckpt_dir`` holding checkpoints already is an error unless ``resume``.
    ``evaluate(drafter) -> float`` (held-out acceptance) runs every ``eval_every`` steps and
    at the end; its value is the metrics' ``accept``.
    """
    from tqdm import tqdm

    module = drafter.module
    lc = lc or default_loss(module.kind)
    if source is not None and not tc.online:
        raise ValueError("a streaming source gives tokens only: train online "
                         "(TrainConfig(online=True))")
    if source is None:
        if not tc.online and is_online(data):
            raise ValueError("these data hold tokens only (no cached features): train online "
                             "(TrainConfig(online=True); the CLI does for --seqs / --data)")
        source = ArraySource(data, module, tc.batch_size, tc.seed)
    target, state, state_sh, frozen, frozen_host, t2d = _start(drafter, target, tc, mesh)
    _, step_fn = make_train_step(module, target.config, lc, tc, state_sh, mesh)
    ckpt = Checkpoints(ckpt_dir, tc.ckpt_every, tc.keep) if ckpt_dir is not None else None
    if ckpt is not None and ckpt.latest() is not None:
        if not resume:
            raise ValueError(f"{ckpt.dir} holds a checkpoint at step {ckpt.latest()}: resume "
                             f"from it (resume=True / --resume) or train into a new directory")
        state = ckpt.restore(state, source.restore_args())
        log(f"resumed from {ckpt.dir} at step {int(state.step)}")
    start = int(state.step)
    writer = _Metrics(metrics_path, log)
    bar = tqdm(total=tc.steps, initial=start, desc=f"train {module.kind}", disable=not progress,
               dynamic_ncols=True)
    t0 = time.time()
    metrics = {}
    with _Preempted() as pre:
        for s in range(start, tc.steps):
            batch = source.batch(s)
            writer.tokens += int(np.sum(batch["lens"]))
            state, metrics = step_fn(state, frozen, t2d, target.params, source.place(batch, mesh))
            bar.update(1)
            done = s + 1
            stop = (pre.hit or tc.max_seconds and time.time() - t0 > tc.max_seconds
                    or tc.stop_after and done >= tc.stop_after)
            if done % tc.log_every == 0 or done == tc.steps or stop:
                writer.step(done, metrics, bar)
            if evaluate is not None and eval_every and (done % eval_every == 0
                                                        or done == tc.steps):
                writer.accept(done, evaluate(Drafter(module, {**host(state.params),
                                                              **frozen_host})))
            if ckpt is not None:
                ckpt.save(done, state, source.save_args, force=bool(stop or done == tc.steps))
            if stop:
                why = "SIGTERM" if pre.hit else f"max_seconds={tc.max_seconds}, " \
                                                f"stop_after={tc.stop_after}"
                log(f"stopping at step {done} ({why})")
                break
    bar.close()
    if ckpt is not None:
        ckpt.close()
    return Drafter(module, {**host(state.params), **frozen_host}), metrics


class _Metrics:
    """The log, the progress bar's figures and the metrics file (process 0 writes it);
    ``tokens`` counts the rows' real tokens since the last logged step."""

    def __init__(self, path, log):
        self.path = None if path is None or jax.process_index() else Path(path)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.log, self.tokens, self.since = log, 0, time.time()

    def step(self, done: int, metrics: dict, bar):
        m = {k: float(_local(v)) for k, v in metrics.items()}
        now = time.time()
        m["tokens_per_s"] = self.tokens / max(now - self.since, 1e-9)
        self.tokens, self.since = 0, now
        bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}",
                        **{k: f"{v:.2f}" for k, v in sorted(m.items()) if k.startswith("acc")})
        self.log(f"step {done} " + " ".join(f"{k}={v:.4f}" for k, v in sorted(m.items())))
        self.write(done, m)

    def accept(self, done: int, value: float):
        self.log(f"step {done} accept={float(value):.4f}")
        self.write(done, {"accept": float(value)})
        self.since = time.time()                 # tokens/s counts training time only

    def write(self, step: int, m: dict):
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), **m}) + "\n")


def read_metrics(path) -> list[dict]:
    """The metrics file, one record per step (its lines merged; a resumed run's later values
    win), by step."""
    rows = {}
    for line in Path(path).read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:        # a line cut by a kill
            continue
        rows.setdefault(r["step"], {}).update(r)
    return [rows[s] for s in sorted(rows)]


def write_info(path, info: dict):
    Path(path).write_text(json.dumps(info, indent=1, default=str))

