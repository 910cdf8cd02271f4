"""Training: the default target (:mod:`jspec.train.lm`), its data (:mod:`jspec.train.data`)
and generic optimizer / resumable-state helpers (:mod:`jspec.train.optim`)."""

from jspec.train.optim import TrainState, load_train_state, make_optimizer, save_train_state

__all__ = ["TrainState", "load_train_state", "make_optimizer", "save_train_state"]
