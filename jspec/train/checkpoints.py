"""Training checkpoints through Orbax's CheckpointManager.

``DIR/<step>/`` holds the train state (parameters, optimizer state, step, data position)
and, for a streaming pipeline, its iterator position (``data``). Saves are asynchronous
(training goes on while the arrays are written; Orbax writes to a temporary directory and
renames it when complete, so a run killed mid-save resumes from the last whole one), one
every ``every`` steps, the last ``keep`` kept. Sharded arrays are written by the processes
that own them, so the same code saves a pod's FSDP state.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class Checkpoints:
    def __init__(self, directory, every: int, keep: int = 3):
        self.dir = Path(directory).absolute()
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=max(1, every),
                                            enable_async_checkpointing=True, create=True)
        self.mgr = ocp.CheckpointManager(self.dir, options=opts)

    def latest(self) -> int | None:
        return self.mgr.latest_step()

    def save(self, step: int, state, data=None, force: bool = False) -> bool:
        """Start saving when ``step`` is a save step (or ``force``) and return at once;
        ``data()``: Orbax args of the iterator's position, taken only when saving."""
        if not force and not self.mgr.should_save(step):
            return False
        if jax.default_backend() == "cpu":
            # On CPU a "host copy" can be a view of the array's buffer, which the next step
            # (donating the state) may overwrite before the background write reads it; a
            # copy of our own costs one state's memory on the one platform it is cheap.
            state = jax.tree.map(lambda x: x.copy(), state)
        items = {"state": ocp.args.StandardSave(state)}
        if data is not None and (position := data()) is not None:
            items["data"] = position
        return self.mgr.save(step, args=ocp.args.Composite(**items), force=force)

    def restore(self, template, data=None, step: int | None = None):
        """The state saved at ``step`` (default: the latest) in ``template``'s structure and
        placement; ``data``: Orbax restore args for the iterator (restored in place)."""
        step = self.latest() if step is None else step
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template)
        items = {"state": ocp.args.StandardRestore(abstract)}
        if data is not None:
            items["data"] = data
        return self.mgr.restore(step, args=ocp.args.Composite(**items))["state"]

    def close(self):
        self.mgr.wait_until_finished()
        self.mgr.close()
