"""The run's starting state: its step-0 weights (the seed's initialisation, or a Hugging
Face checkpoint's: checkpoint.init_from), a restored state completed with LoRA's frozen
base (which checkpoints point to rather than hold), and DPO's reference log-probabilities
from the starting weights. A resumed run reads the same start an uninterrupted one did."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxpar.step.preference import reference_logps
from jaxpar.step.trainer import Trainer


def starting_state(trainer: Trainer, fresh: Callable[[], Any], restored: Any | None,
                   preference_source: Any | None) -> Any:
    """The state the run's first step takes: `restored` (a checkpoint's, or None for a fresh
    run) completed with LoRA's frozen base, else the start's (`fresh`: start_of's). The start
    is read once, and on resume only if LoRA's base or DPO's reference needs it; with
    `preference_source` (DPO on the config's data) it gets its reference log-probabilities
    from the starting weights. A second whole state is not kept once it has served."""
    needed = restored is None or trainer.frozen_shardings is not None or preference_source is not None
    started = fresh() if needed else None
    state = started if restored is None else with_base(trainer, restored, lambda: started)
    if preference_source is not None:  # DPO's reference: the starting weights, frozen
        attach_reference(preference_source, trainer, trainer.weights(started))
    return state


def start_of(trainer: Trainer) -> Callable[[], Any]:
    """() -> the run's state at step 0: the weights of its Hugging Face checkpoint
    (checkpoint.init_from: checked now, read when called), else its seed's initialisation."""
    if trainer.config.checkpoint.init_from:
        from jaxpar.hf import prepare_import

        return prepare_import(trainer, trainer.config.checkpoint.init_from)
    return trainer.init


def with_base(trainer: Trainer, state: Any, start: Callable[[], Any]) -> Any:
    """A restored state with LoRA's frozen weights, which checkpoints do not hold (they point
    to them: jaxpar.loop.checkpoint.base_of), read again from where the run started."""
    if trainer.frozen_shardings is None or state.frozen is not None:
        return state
    return dataclasses.replace(state, frozen=start().frozen)


def attach_reference(source, trainer: Trainer, weights: Any) -> None:
    """Give a preference source its reference log-probabilities, from `weights` (the run's
    starting weights, as Trainer.weights gives them)."""
    everywhere = trainer.layout.sharding((None, None))  # each process reads them whole
    source.reference = reference_logps(trainer.forward, everywhere, trainer.batch.global_batch, weights, source)
