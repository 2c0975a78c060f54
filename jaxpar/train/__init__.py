"""Training: sharded state, the jitted step, optimizers, losses, the loop."""

from jaxpar.train.trainer import Trainer, TrainState, build

__all__ = ["TrainState", "Trainer", "build"]
