"""The optimizer's half of the step: gradients in, new state and the step's metrics out.
A step whose loss or gradients hold NaN or Inf is not applied."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxpar.model import has
from jaxpar.train.state import StatePlacement, TrainState, cast_floats, to_device
from jaxpar.train.zero import StateShardings

UpdateFn = Callable[..., tuple[TrainState, dict]]  # (state, loss, sums, grads, compression=None)


def update_fn(tx: optax.GradientTransformation, lr_schedule: optax.Schedule | None, shardings: StateShardings,
              placement: StatePlacement, compute_dtype: Any, offload: bool, model: Any) -> UpdateFn:
    """(state, loss, sums, grads, compression) -> (new state, metrics). The model may adjust
    its weights after the optimizer (`update(master, counts)`, e.g. MoE bias balancing) and
    turn the step's counts into metrics (`summarise(counts)`). `compression`: the gradient
    compressor's new state (jaxpar.train.compression), kept only with the step."""
    mixed = jnp.dtype(compute_dtype) != jnp.float32

    def apply(state: TrainState, grads: Any, counts: dict, compression: Any) -> TrainState:
        # in float32 the parameters are the master weights
        master = state.master if mixed else jax.lax.with_sharding_constraint(state.params, shardings.optimizer)
        updates, opt_state = tx.update(grads, state.opt_state, master)
        master = optax.apply_updates(master, updates)
        if counts and has(model, "update"):
            master = model.update(master, counts)
        # ZeRO 1-2: each device updated its shard; gathering the new weights is the
        # all-gather half of the step's 2x(N-1)/N traffic.
        params = jax.lax.with_sharding_constraint(cast_floats(master, compute_dtype), shardings.params)
        return TrainState(step=state.step + 1, params=params, master=master if mixed else None, opt_state=opt_state,
                          compression=compression)

    def update(state: TrainState, loss: jax.Array, sums: dict, grads: Any, compression: Any = None
               ) -> tuple[TrainState, dict]:
        if offload:  # fetch from host memory for the update
            state = dataclasses.replace(state, master=to_device(state.master, placement.working.master),
                                        opt_state=to_device(state.opt_state, placement.working.opt_state))
        counts = sums.get("counts", {})
        # A non-finite loss or gradient leaves the state as it was, and the schedule
        # (state.step, the optimizer's count) where the weights are; the loop then stops or
        # skips (train.on_nonfinite), naming the first bad gradient. A branch, not a select
        # over the whole state: a finite step pays only for the test. Each gradient's
        # squared sum is finite exactly when the gradient is (or when it overflows float32,
        # and then its norm, which clipping divides by, is infinite too).
        squares = [jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)]
        finite_grads = jnp.isfinite(jnp.stack(squares))
        finite = jnp.isfinite(loss) & jnp.all(finite_grads)
        if compression is not None:  # what a compressor left out of the gradients must be finite too
            residual = jax.tree.leaves(compression.residual)
            finite &= jnp.isfinite(sum(jnp.sum(jnp.square(r)) for r in residual))
        else:
            compression = state.compression
        new = jax.lax.cond(finite, apply, lambda state, *_: state, state, grads, counts, compression)
        grad_norm = jnp.sqrt(sum(squares))
        return new, step_metrics(loss, sums, grad_norm, finite, finite_grads, lr_schedule, state.step, model)

    return update


def step_metrics(loss, sums: dict, grad_norm, finite, finite_grads, lr_schedule, step, model: Any) -> dict:
    """What the loop shows and logs. The learning rate only where the schedule is known:
    a custom optax `tx` passed to `build` without its `lr_schedule` reports none."""
    counts = sums.get("counts", {})
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        **({"learning_rate": jnp.asarray(lr_schedule(step), jnp.float32)} if lr_schedule is not None else {}),
        "nonfinite": (~finite).astype(jnp.float32),
        # which gradient leaf (in tree order) is the first non-finite one, -1 if none
        "first_nonfinite_grad": jnp.where(jnp.all(finite_grads), -1, jnp.argmin(finite_grads)).astype(jnp.float32),
        "nonfinite_grads": jnp.sum(~finite_grads).astype(jnp.float32),
        **{k: v / sums["weight"] for k, v in sums.get("token_metrics", {}).items()},
        **(model.summarise(counts) if counts and has(model, "summarise") else {}),
    }
