"""The whole model's outputs on the trainer's mesh: `Trainer.forward`, jitted (params, batch)
-> logits [B, S, vocab] for a language model ([B, classes] for a classifier), any layout,
pipeline stages included. DPO's reference log-probabilities (jaxpar.step.preference),
sampling (jaxpar.generate) and users' own inference read it.

Under a pipeline the layers rest stage-sharded and, with interleaved chunks, in pipeline
order; the forward pass runs the whole model at once, as `Trainer.evaluate` does: the layers
put back in model order and gathered from their stages, under rules that leave "layers"
unsharded (a scan over a stage-sharded stack aborts XLA's partitioner)."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from jaxpar.errors import ConfigError
from jaxpar.sharding import use_layout
from jaxpar.step.loss import apply_model
from jaxpar.step.sequence import lay_out_sequences, sequence_permutation

MODEL_FIELDS = ("inputs", "positions", "segment_ids")  # what a forward pass reads of a batch


def make_forward(task: str, graphdef: nnx.GraphDef, whole: Any, weight_shardings: Any,
                 batch_shardings: Mapping[str, NamedSharding]) -> Any:
    """jit((weights, batch) -> the model's outputs; a model that returns (outputs, aux)
    gives outputs). `whole`: weights -> (params, layout) for running the whole model in one
    program (jaxpar.step.pipelined.unpipelined with the trainer's layout). `weights` as
    `Trainer.weights(state)` gives them; `batch` holds "inputs" (and "positions",
    "segment_ids" if the model reads them; other fields are ignored), numpy or jax arrays
    sharded as the trainer's batches: B must split over the batch axes and, under context
    parallelism, S over mesh.context. Outputs come back in the inputs' sequence order."""

    def apply(weights: Any, batch: dict) -> Any:
        batch = {k: v for k, v in batch.items() if k in MODEL_FIELDS and k in batch_shardings}
        _check_batch(batch, batch_shardings)
        batch = {k: jax.lax.with_sharding_constraint(v, batch_shardings[k]) for k, v in batch.items()}
        params, layout = whole(weights)
        with use_layout(layout):
            order = sequence_permutation(layout, batch["inputs"].shape[1]) if task == "lm" else None
            if order is not None:
                batch = lay_out_sequences(batch, layout)
            out = apply_model(nnx.merge(graphdef, params), batch)
        outputs = out[0] if isinstance(out, tuple) else out
        return outputs if order is None else jnp.take(outputs, jnp.argsort(order), axis=1)

    return jax.jit(apply, in_shardings=(weight_shardings, None))


def _check_batch(batch: dict, shardings: Mapping[str, NamedSharding]) -> None:
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
