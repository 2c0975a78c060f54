"""Losses as (sum over examples, total weight): the step divides once, by the tokens of the
whole global batch, so microbatching never changes the normalisation."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Weighted sum of -log softmax(logits)[target] and the sum of weights.

    Written with a logsumexp and a one-hot product, both elementwise-then-reduce over the
    vocabulary, so vocab-sharded logits are reduced in place (max and sum all-reduced over
    the tensor axis) and the full logits never sit on one device.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32), axis=-1)
    weights = weights.astype(jnp.float32)
    return jnp.sum((lse - target_logit) * weights), jnp.sum(weights)


def task_loss(outputs: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
    """The built-in loss of both tasks: cross-entropy of the outputs (logits over the
    vocabulary for lm, over the classes for classify) against `targets`, under `weights`."""
    return cross_entropy_sum(outputs, batch["targets"], batch["weights"])


LossFn = Callable[[Any, dict], tuple[jax.Array, jax.Array]]
"""(model outputs, batch) -> (sum of the per-example losses, their total weight). The step
divides the one by the other over the whole global batch, so microbatches and replicas add
up exactly. `task_loss` is the default; `jaxpar.train.build(config, loss_fn=...)` takes
another."""


def apply_model(model: Any, batch: dict) -> Any:
    """The model on a batch's `inputs`, with the optional per-token `positions` and
    `segment_ids` (reordered or packed sequences)."""
    extra = {k: batch[k] for k in ("positions", "segment_ids") if k in batch}
    return model(batch["inputs"], **extra)


def model_outputs(model: Any, batch: dict) -> Any:
    """What `loss_fn` scores: the model's outputs, without the aux a model may return beside
    them (jaxpar.models.moe)."""
    out = apply_model(model, batch)
    return out[0] if isinstance(out, tuple) else out


def model_loss(model: Any, batch: dict, loss_fn: LossFn = task_loss) -> tuple[jax.Array, tuple[jax.Array, dict]]:
    """(objective sum, (weight, sums)): `loss_fn` of the model applied to the batch.

    A model may return (outputs, aux) (jaxpar.models.moe): aux["penalty"] [B, S] is added to
    each token's loss under the batch's weights, and `sums` carries, summed over the batch,
    the weighted aux["token_metrics"] and the raw aux["counts"]. Sums add up across
    microbatches and replicas, so the step reports them for the whole batch.
    """
    out = apply_model(model, batch)
    outputs, aux = out if isinstance(out, tuple) else (out, None)
    total, weight = loss_fn(outputs, batch)
    if aux is None:
        return total, (weight, {})
    weights = batch["weights"].astype(jnp.float32)
    total = total + jnp.sum(aux["penalty"] * weights)
    sums = {
        "token_metrics": {k: jnp.sum(v * weights) for k, v in aux["token_metrics"].items()},
        "counts": aux["counts"],
    }
    return total, (weight, jax.lax.stop_gradient(sums))
