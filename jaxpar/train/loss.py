"""Losses as (sum over examples, total weight): the step divides once, by the tokens of the
whole global batch, so microbatching never changes the normalisation."""

from __future__ import annotations

from typing import Callable

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


def model_loss(model, batch: dict) -> tuple[jax.Array, tuple[jax.Array, dict]]:
    """(objective sum, (weight, sums)): next-token (lm) or class (classify) loss, a model
    applied to `inputs` scored against `targets`, weighted by `weights`. Optional per-token
    `positions` and `segment_ids` (reordered or packed sequences) are passed to the model.

    A model may return (logits, aux) (models.moe): aux["penalty"] [B, S] is added to each
    token's loss under the same weights, and `sums` carries, summed over the batch, the
    weighted aux["token_metrics"] and the raw aux["counts"]. Sums add up across
    microbatches and replicas, so the step reports them for the whole batch.
    """
    extra = {k: batch[k] for k in ("positions", "segment_ids") if k in batch}
    out = model(batch["inputs"], **extra)
    logits, aux = out if isinstance(out, tuple) else (out, None)
    total, weight = cross_entropy_sum(logits, batch["targets"], batch["weights"])
    if aux is None:
        return total, (weight, {})
    weights = batch["weights"].astype(jnp.float32)
    total = total + jnp.sum(aux["penalty"] * weights)
    sums = {
        "token_metrics": {k: jnp.sum(v * weights) for k, v in aux["token_metrics"].items()},
        "counts": aux["counts"],
    }
    return total, (weight, jax.lax.stop_gradient(sums))


LossFn = Callable[[object, dict], tuple[jax.Array, tuple[jax.Array, dict]]]
