"""Losses as (sum over examples, total weight): the step divides once, by the tokens of the
whole global batch, so microbatching never changes the normalisation."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxpar.model import MAXIMA


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Weighted sum of -log softmax(logits)[target] and the sum of weights.

    Written with a logsumexp and a one-hot product, both elementwise-then-reduce over the
    vocabulary, so vocab-sharded logits are reduced in place (max and sum all-reduced over
    the tensor axis) and the full logits never sit on one device.
    """
    weights = weights.astype(jnp.float32)
    return jnp.sum(token_cross_entropy(logits, targets) * weights), jnp.sum(weights)


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] of every token, in float32 (cross_entropy_sum's terms)."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32), axis=-1)


def chunked_cross_entropy_sum(hidden: jax.Array, project: Callable[[jax.Array], jax.Array], targets: jax.Array,
                              weights: jax.Array, chunks: int) -> tuple[jax.Array, jax.Array]:
    """cross_entropy_sum(project(hidden), targets, weights) without the whole logits: the
    tokens go through `project` (the model's head) and the loss in `chunks` groups, one
    group's [batch, seq / chunks, vocab] logits alive at a time, forward and backward (the
    backward recomputes each group's logits from its hidden states).

    hidden [B, S, ...], targets and weights [B, S]. Group j holds tokens j, j + chunks,
    j + 2 chunks, ... of every row: a strided split of the sequence keeps each device's
    share of a sharded sequence on that device (S / chunks must still divide by the
    sequence's shards), and a vocab-sharded head stays vocab-sharded inside each group.
    Equal to the plain loss up to float32 summation order."""
    if chunks == 1:
        return cross_entropy_sum(project(hidden), targets, weights)
    batch, seq = targets.shape
    if seq % chunks:
        raise ValueError(f"chunked_cross_entropy_sum: {chunks} chunks do not divide the sequence of {seq} tokens")

    def split(a: jax.Array) -> jax.Array:  # [B, S, ...] -> [chunks, B, S / chunks, ...]
        return jnp.moveaxis(a.reshape(batch, seq // chunks, chunks, *a.shape[2:]), 2, 0)

    @jax.checkpoint  # keep each group's inputs for the backward, not its logits
    def group(total, xs):
        h, t, w = xs
        return total + cross_entropy_sum(project(h), t, w)[0], None

    total, _ = jax.lax.scan(group, jnp.zeros((), jnp.float32), (split(hidden), split(targets), split(weights)))
    return total, jnp.sum(weights.astype(jnp.float32))


SOURCE_LOSS, SOURCE_TOKENS = "source_loss:", "source_tokens:"  # per-source sums (by_source), made metrics by step_metrics


def by_source(names: tuple[str, ...]) -> Callable[[Any, dict], tuple]:
    """The built-in loss of a mixture's language model (data.source=mix), which also sums each
    source's token losses and weights (batch["source"], a row's source), so that the step
    reports every source's own loss and tokens (jaxpar.step.update.step_metrics). The
    per-token losses are computed once (token_cross_entropy)."""

    def loss(outputs: jax.Array, batch: dict) -> tuple:
        weights = batch["weights"].astype(jnp.float32)
        tokens = token_cross_entropy(outputs, batch["targets"]) * weights
        rows_loss, rows_weight = jnp.sum(tokens, axis=-1), jnp.sum(weights, axis=-1)  # [B]
        which = jax.nn.one_hot(batch["source"], len(names), dtype=jnp.float32)  # [B, sources]
        per_loss, per_weight = rows_loss @ which, rows_weight @ which
        metrics = {**{SOURCE_LOSS + n: per_loss[i] for i, n in enumerate(names)},
                   **{SOURCE_TOKENS + n: per_weight[i] for i, n in enumerate(names)}}
        return jnp.sum(rows_loss), jnp.sum(rows_weight), jax.lax.stop_gradient(metrics)

    return loss


def source_metrics(metrics: dict, weight: jax.Array) -> dict:
    """`metrics` (each sum divided by the batch's weight) with by_source's sums turned into
    each source's mean loss, `loss_<name>` (0 where it had no tokens this step), and its
    trained tokens this step, `tokens_<name>`."""
    out = {k: v for k, v in metrics.items() if not k.startswith((SOURCE_LOSS, SOURCE_TOKENS))}
    for key in metrics:
        if key.startswith(SOURCE_LOSS):
            name = key.removeprefix(SOURCE_LOSS)
            share = metrics[SOURCE_TOKENS + name]
            out[f"loss_{name}"] = jnp.where(share > 0, metrics[key] / jnp.where(share > 0, share, 1), 0.0)
            out[f"tokens_{name}"] = share * weight
    return out


def task_loss(outputs: jax.Array, batch: dict) -> tuple[jax.Array, jax.Array]:
    """The built-in loss of both tasks: cross-entropy of the outputs (logits over the
    vocabulary for lm, over the classes for classify) against `targets`, under `weights`."""
    return cross_entropy_sum(outputs, batch["targets"], batch["weights"])


def chunked_task_loss(output: Callable[[jax.Array], jax.Array], hidden: jax.Array, batch: dict,
                      chunks: int) -> tuple[jax.Array, jax.Array]:
    """`task_loss` of `output(hidden)`, computed in `chunks` groups of tokens; `hidden` is
    what a model's layers return (jaxpar.model.PipelineStages.apply_layers), its report
    taken off by the caller."""
    return chunked_cross_entropy_sum(hidden, output, batch["targets"], batch["weights"], chunks)


LossFn = Callable[[Any, dict], tuple]
"""(model outputs, batch) -> (sum of the per-example losses, their total weight) or (sum,
weight, {metric name: its sum over the examples}). The step divides each by the weight over
the whole global batch, so microbatches and replicas add up exactly; the metrics join the
step's (jaxpar.step.preference's reward margin and accuracy, say; not under pipeline
stages, whose last stage keeps the loss and weight alone). `task_loss` is the default;
`jaxpar.train.build(config, loss_fn=...)` takes another."""


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


def model_loss(model: Any, batch: dict, loss_fn: LossFn = task_loss,
               loss_chunks: int = 1) -> tuple[jax.Array, tuple[jax.Array, dict]]:
    """(objective sum, (weight, sums)): `loss_fn` of the model applied to the batch.

    With `loss_chunks` > 1 (the built-in loss only, of a model with pipeline stages' members,
    jaxpar.model.PipelineStages): the hidden states of `apply_layers(embed(batch))` are
    scored through `output` in that many groups of tokens (`chunked_cross_entropy_sum`),
    never holding the whole logits; layers that report (x, report) add the report's loss
    and give its sums, as a pipeline's do (`chunked_model_loss`).

    A model may return (outputs, aux) (jaxpar.models.moe): aux["penalty"] [B, S] is added to
    each token's loss under the batch's weights, and `sums` carries, summed over the batch,
    the weighted aux["token_metrics"] and the raw aux["counts"]. Sums add up across
    microbatches and replicas, so the step reports them for the whole batch; aux["maxima"]
    (the attention's largest logits, for QK-clip) is carried as it is and combines by its
    largest value instead (`combine_sums`, `reduce_sums`). Each part of aux is optional.
    """
    if loss_chunks > 1:
        return chunked_model_loss(model, batch, loss_chunks)
    out = apply_model(model, batch)
    outputs, aux = out if isinstance(out, tuple) else (out, None)
    total, weight, *reported = loss_fn(outputs, batch)
    metrics = reported[0] if reported else {}  # the loss's own metric sums (LossFn)
    if aux is None:
        return total, (weight, jax.lax.stop_gradient({"token_metrics": metrics}) if metrics else {})
    weights = batch["weights"].astype(jnp.float32)
    if "penalty" in aux:
        total = total + jnp.sum(aux["penalty"] * weights)
    sums = {
        "token_metrics": {**{k: jnp.sum(v * weights) for k, v in aux.get("token_metrics", {}).items()}, **metrics},
        **({"counts": aux["counts"]} if "counts" in aux else {}),
        **({MAXIMA: aux[MAXIMA]} if MAXIMA in aux else {}),
    }
    return total, (weight, jax.lax.stop_gradient(sums))


def combine_sums(a: dict, b: dict) -> dict:
    """Two parts' sums as one: added, but MAXIMA's entries by their larger (microbatches)."""
    return {k: jax.tree.map(jnp.maximum if k == MAXIMA else jnp.add, a[k], b[k]) for k in a}


def no_sums(like: dict) -> dict:
    """The start `combine_sums` adds to: zeros, but -inf for MAXIMA's entries (`like`:
    shapes and dtypes)."""
    return {k: jax.tree.map(lambda a, k=k: jnp.full(a.shape, -jnp.inf if k == MAXIMA else 0, a.dtype), v)
            for k, v in like.items()}


def reduce_sums(sums: dict, axis: int = 0) -> dict:
    """Sums stacked on `axis` (per replica) as one: summed, but MAXIMA's entries by their largest."""
    return {k: jax.tree.map(lambda x, k=k: x.max(axis) if k == MAXIMA else x.sum(axis), v) for k, v in sums.items()}


def chunked_model_loss(model: Any, batch: dict, chunks: int) -> tuple[jax.Array, tuple[jax.Array, dict]]:
    """`model_loss` through the model's pipeline stages' members with the loss in `chunks`
    groups of tokens. Layers that return (x, report) (jaxpar.model.PipelineStages: MoE) add
    report["loss"] to the objective, and their report's "sums" and "per_layer" arrays are
    the step's sums, as the whole-logits path gives them from the model's aux."""
    hidden = model.apply_layers(model.embed(batch), batch)
    hidden, report = hidden if isinstance(hidden, tuple) else (hidden, None)
    total, weight = chunked_task_loss(model.output, hidden, batch, chunks)
    if report is None:
        return total, (weight, {})
    return total + report["loss"], (weight, jax.lax.stop_gradient({**report["sums"], **report["per_layer"]}))
