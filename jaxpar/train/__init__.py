"""Training, as users call it: `build(config)` makes the jitted program (jaxpar.step) and
`run(trainer)` trains it (jaxpar.loop). The program, the host run and generation live in
jaxpar.step, jaxpar.loop and jaxpar.generate; this package only names their entry points."""

from jaxpar.loop.run import run
from jaxpar.step.loss import LossFn, task_loss
from jaxpar.step.trainer import Trainer, TrainState, build

__all__ = ["LossFn", "TrainState", "Trainer", "build", "run", "task_loss"]
