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


def model_loss(model, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Next-token (lm) or class (classify) loss: both are a model applied to `inputs`
    scored against `targets`, weighted by `weights`. Optional per-token `positions` and
    `segment_ids` (reordered or packed sequences) are passed to the model."""
    extra = {k: batch[k] for k in ("positions", "segment_ids") if k in batch}
    return cross_entropy_sum(model(batch["inputs"], **extra), batch["targets"], batch["weights"])


LossFn = Callable[[object, dict], tuple[jax.Array, jax.Array]]
