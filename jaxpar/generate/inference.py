"""Applying a trained model: its outputs (logits) on new inputs.

  forward(trainer)                -> jitted (params, batch) -> outputs, on the trainer's mesh,
                                     the parameters where they rest (TrainState.params), any
                                     layout, pipeline stages included: `Trainer.forward`
                                     (jaxpar.step.forward)
  unsharded_model(trainer, state) -> the nnx.Module with the trained float32 weights, whole,
                                     on this process's default device (one process only)

docs/evaluation.md shows both.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.sharding import Layout
from jaxpar.step.pipelined import unpipelined


def whole_model(trainer, params: Any) -> tuple[Any, Layout]:
    """(params, layout) for running the whole model in one program (inside jit): without a
    pipeline the trainer's own; with one, jaxpar.step.pipelined.unpipelined."""
    return unpipelined(params, trainer.layout, trainer.weight_shardings, trainer.stage_split)


def forward(trainer) -> Callable[[Any, dict], Any]:
    """jit((params, batch) -> the model's outputs): logits [B, S, vocab] for a language
    model, [B, classes] for a classifier, the trainer's own (`Trainer.forward`, compiled once
    per batch shape). `params` as `trainer.weights(state)` gives them; `batch` holds
    "inputs" (and "positions", "segment_ids" if the model reads them), sharded as the
    trainer's batches (jaxpar.step.forward.make_forward)."""
    return trainer.forward


def unsharded_model(trainer, state: Any) -> nnx.Module:
    """The model with `state`'s float32 weights (the master copy under mixed precision),
    gathered into this process and merged in model order: call it like any nnx.Module,
    `model(inputs)`, on one device, with no layout. One process only: with several, no
    process holds every shard (use `forward`)."""
    if jax.process_count() > 1:
        raise ConfigError(f"unsharded_model gathers every weight into one process, but this run has "
                          f"{jax.process_count()} processes; use jaxpar.generate.inference.forward(trainer)")
    weights = trainer.model_order(jax.device_get(trainer.master_weights(state)))
    return nnx.merge(trainer.graphdef, jax.tree.map(jnp.asarray, weights))
