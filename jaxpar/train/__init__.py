"""Training: sharded state, the jitted step, optimizers, losses, the loop."""

from jaxpar.train.loop import run
from jaxpar.train.loss import LossFn, task_loss
from jaxpar.train.trainer import Trainer, TrainState, build

__all__ = ["LossFn", "TrainState", "Trainer", "build", "run", "task_loss"]
