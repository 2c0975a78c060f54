"""The held-out loss during training: every train.eval_every steps and after the last step,
the loss of the trained parameters on train.eval_batches held-out global batches
(jaxpar.data.heldout), through `trainer.evaluate` (no gradient, any layout).

The loss is the sum of the per-token (per-example) losses over all the batches divided by
their total weight, as the step's loss is over one batch. Evaluating reads the parameters
and changes nothing: a run's training losses are the same with evaluation on or off.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from jaxpar.data.heldout import HeldOut, held_out_batches
from jaxpar.data.user import UserData
from jaxpar.errors import ConfigError

Sums = list[tuple[jax.Array, jax.Array]]  # (loss sum, weight) of each held-out batch, on the devices


def dispatch(evaluate: Callable, params: Any, batches: HeldOut, count: int) -> Sums:
    """Start evaluating `params` on held-out batches 0 .. count-1; nothing waits for them."""
    return [evaluate(params, batches(i)) for i in range(count)]


def collect(sums: Sums) -> float:
    """Wait for `dispatch`'s sums: total loss / total weight."""
    pairs = jax.device_get(sums)
    return sum(float(loss) for loss, _ in pairs) / sum(float(weight) for _, weight in pairs)


def held_out_loss(trainer, params: Any, batches: HeldOut | None = None, count: int | None = None) -> float:
    """The loss of `params` (as a TrainState holds them) on `count` held-out batches
    (default train.eval_batches) from `batches` (default the config's, jaxpar.data.heldout)."""
    batches = held_out_batches(trainer.batch, trainer.config) if batches is None else batches
    count = trainer.config.train.eval_batches if count is None else count
    return collect(dispatch(trainer.evaluate, params, batches, count))


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """When to evaluate during a run, on what, and the function that does it."""

    evaluate: Callable  # (params, batch) -> (loss sum, weight)
    batches: HeldOut
    count: int
    every: int

    def due(self, done: int, last: int) -> bool:
        """After `done` steps of a run that ends at `last`."""
        return done % self.every == 0 or done == last

    def start(self, weights: Any) -> Sums:
        """`weights`: Trainer.weights(state)."""
        return dispatch(self.evaluate, weights, self.batches, self.count)

    def compile(self, trainer) -> Evaluation:
        """The same, with `trainer.evaluate` compiled now rather than at the first evaluation."""
        weights = trainer.weights(trainer.abstract_state())
        return dataclasses.replace(self, evaluate=trainer.evaluate.lower(weights, trainer.abstract_batch()).compile())


def open_evaluation(trainer, data: UserData | None = None, eval_data: UserData | None = None,
                    source=None) -> Evaluation | None:
    """The run's evaluation (None when train.eval_every=0), its held-out batches set up and
    checked: call before compiling. `data` and `eval_data` as jaxpar.train.run takes them;
    `source`: the run's own batch source, whose held-out part is read (None: opened here)."""
    every = trainer.config.train.eval_every
    if not every:
        if eval_data is not None:
            raise ConfigError("run(eval_data=...) is evaluated every train.eval_every steps, but train.eval_every=0; "
                              "set train.eval_every, e.g. train.eval_every=100")
        return None
    if data is not None and eval_data is None:
        raise ConfigError(f"train.eval_every={every} evaluates on held-out batches, but run(data=...) trains on your "
                          "own batches and no eval_data was given; give run(..., eval_data=...) in the format of data "
                          "(jaxpar.data.heldout), or set train.eval_every=0")
    batches = held_out_batches(trainer.batch, trainer.config, eval_data, source)
    return Evaluation(trainer.evaluate, batches, trainer.config.train.eval_batches, every)
