"""Preference tuning: DPO (Rafailov et al., arXiv 2305.18290) on data.source=preference.

Each row holds one pair: the prompt with the chosen answer (segment 0), then the prompt with
the rejected one (segment 1); the weights cover the answers' tokens (jaxpar.data.chat). The
loss of a pair is

    -log sigmoid(beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))))

where log pi is the sum of the policy's log-probabilities of the answer's tokens and log ref
the reference model's. The reference is the run's starting weights, frozen: its
log-probabilities of every pair are computed once, before the first step, by a forward pass
over the data (`reference_logps`, called by jaxpar.loop.start), and ride in the batches ("reference" [B, 2]). No second
model is held in memory while training; a resumed run computes them again from the same
starting weights (its seed's initialisation, or checkpoint.init_from), so it reads what an
uninterrupted run read.

The loss goes through the trainer's loss seam (`jaxpar.train.build(config, loss_fn=...)`,
jaxpar.step.loss.LossFn), with its metrics: the mean reward margin, the share of pairs whose
chosen answer the policy prefers more than the reference does (reward accuracy), and the
mean chosen and rejected rewards (beta times the log-ratio). Another preference loss is
written the same way, from `answer_logps`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxpar.step.loss import LossFn


def answer_logps(logits: jax.Array, batch: dict) -> jax.Array:
    """[B, 2]: each row's summed log-probabilities of its chosen (segment 0) and rejected
    (segment 1) answer's tokens, those the weights cover. The vocabulary's logsumexp and the
    target's logit reduce in place, so vocab-sharded logits stay sharded."""
    logits = logits.astype(jnp.float32)
    target = jnp.sum(logits * jax.nn.one_hot(batch["targets"], logits.shape[-1], dtype=jnp.float32), axis=-1)
    token = (target - jax.nn.logsumexp(logits, axis=-1)) * batch["weights"].astype(jnp.float32)
    segments = batch["segment_ids"]
    return jnp.stack([jnp.sum(token * (segments == s), axis=-1) for s in (0, 1)], axis=-1)


def dpo_loss(beta: float) -> LossFn:
    """The DPO loss of a batch of pairs: (its sum over pairs, the number of pairs, the metrics'
    sums over pairs)."""

    def loss(logits: jax.Array, batch: dict):
        rewards = beta * (answer_logps(logits, batch) - batch["reference"])  # [B, 2]
        margin = rewards[:, 0] - rewards[:, 1]
        metrics = {"reward_margin": jnp.sum(margin), "reward_accuracy": jnp.sum((margin > 0).astype(jnp.float32)),
                   "chosen_reward": jnp.sum(rewards[:, 0]), "rejected_reward": jnp.sum(rewards[:, 1])}
        return jnp.sum(-jax.nn.log_sigmoid(margin)), jnp.float32(margin.shape[0]), metrics

    return loss


def reference_logps(forward: Callable, everywhere: NamedSharding, rows: int, weights: Any, source: Any) -> np.ndarray:
    """[pairs, 2]: the log-probabilities of every pair's answers of a preference `source`
    (jaxpar.data.chat.PreferenceSource) under `weights`, `rows` pairs (a global batch) at a
    time through `forward` (Trainer.forward: any layout), gathered `everywhere` so that each
    process reads them whole."""

    @jax.jit
    def logps(w, batch):
        return jax.lax.with_sharding_constraint(answer_logps(forward(w, batch), batch), everywhere)

    pairs, local = source.pairs, source.batch.rows
    out = np.zeros((len(pairs), 2), np.float32)
    for start in range(0, len(pairs), rows):
        ids = np.arange(start, start + rows) % len(pairs)  # the last batch wraps round
        fields = {k: v[local] for k, v in pairs.fields(ids).items()}
        batch = source.batch.to_global({**fields, "reference": np.zeros((len(fields["inputs"]), 2), np.float32)})
        take = min(rows, len(pairs) - start)
        out[start:start + take] = np.asarray(jax.device_get(logps(weights, batch)))[:take]
    return out
