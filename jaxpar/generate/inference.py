"""Applying a trained model: its outputs (logits) on new inputs.

  forward(trainer)                -> jitted (params, batch) -> outputs, on the trainer's mesh,
                                     the parameters where they rest (TrainState.params), any
                                     layout, pipeline stages included
  unsharded_model(trainer, state) -> the nnx.Module with the trained float32 weights, whole,
                                     on this process's default device (one process only)

Under a pipeline the layers rest stage-sharded and, with interleaved chunks, in pipeline
order; `forward` runs the whole model at once, as `trainer.evaluate` does: the layers put
back in model order and gathered from their stages, under rules that leave "layers" unsharded
(a scan over a stage-sharded stack aborts XLA's partitioner). docs/evaluation.md shows both.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.kernels.attention import sequence_order
from jaxpar.sharding import Layout, sequence_degree, use_layout
from jaxpar.step.loss import apply_model
from jaxpar.step.pipelined import unpipelined
from jaxpar.step.sequence import lay_out_sequences

MODEL_FIELDS = ("inputs", "positions", "segment_ids")  # what a forward pass reads of a batch


def whole_model(trainer, params: Any) -> tuple[Any, Layout]:
    """(params, layout) for running the whole model in one program (inside jit): without a
    pipeline the trainer's own; with one, jaxpar.step.pipelined.unpipelined."""
    return unpipelined(params, trainer.layout, trainer.weight_shardings)


def forward(trainer) -> Callable[[Any, dict], Any]:
    """jit((params, batch) -> the model's outputs): logits [B, S, vocab] for a language
    model, [B, classes] for a classifier (a model that returns (outputs, aux) gives outputs).

    `params` as `trainer.weights(state)` gives them (`state.params` in the trainer's parameter
    sharding, with LoRA's frozen weights joined);
    `batch` holds "inputs" (and "positions", "segment_ids" if the model reads them; other
    fields are ignored), numpy or jax arrays, sharded as the trainer's batches: B must split
    over the batch axes (mesh.data x fsdp x expert) and, under context parallelism, S over
    mesh.context. Outputs come back in the inputs' sequence order."""
    task = trainer.config.model.task

    def apply(params: Any, batch: dict) -> Any:
        batch = {k: v for k, v in batch.items() if k in MODEL_FIELDS and k in trainer.batch.shardings}
        _check_batch(batch, trainer.batch.shardings)
        batch = {k: jax.lax.with_sharding_constraint(v, trainer.batch.shardings[k]) for k, v in batch.items()}
        params, layout = whole_model(trainer, params)
        with use_layout(layout):
            order = _sequence_order(layout, batch["inputs"].shape[1]) if task == "lm" else None
            if order is not None:
                batch = lay_out_sequences(batch, layout)
            out = apply_model(nnx.merge(trainer.graphdef, params), batch)
        outputs = out[0] if isinstance(out, tuple) else out
        return outputs if order is None else jnp.take(outputs, jnp.argsort(order), axis=1)

    return jax.jit(apply, in_shardings=(trainer.weight_shardings, None))


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


def _sequence_order(layout: Layout, seq_len: int) -> jax.Array | None:
    """The order lay_out_sequences puts a sequence in, or None where it keeps it."""
    n = sequence_degree(layout)
    if n == 1 or layout.context.seq_layout == "contiguous":
        return None
    return jnp.asarray(sequence_order(layout.context.seq_layout, n, seq_len), jnp.int32)


def _check_batch(batch: dict, shardings: dict) -> None:
    """At trace time: one line naming what does not split, rather than the partitioner's error."""
    if "inputs" not in batch:
        raise ConfigError(f"forward: the batch has no 'inputs' (it has {', '.join(batch) or 'nothing'})")
    for name, value in batch.items():
        try:
            shardings[name].shard_shape(value.shape)
        except ValueError:
            spec = shardings[name].spec
            raise ConfigError(f"forward: batch field {name!r} of shape {tuple(value.shape)} does not split as the "
                              f"trainer's batches do ({spec} over mesh {dict(shardings[name].mesh.shape)}); "
                              "give a batch size that the batch axes divide") from None
