"""The optimizer's half of the step: gradients in, new state and the step's metrics out.
A step whose loss or gradients hold NaN or Inf is not applied.

The gradient is read twice, never copied: once for its squared norm (which also tells a
finite step from one that is not), once for the update, where dividing by the batch's
weight, clipping, the update rule, adding the update to the weights and keeping the old
state after a non-finite step are one elementwise expression per parameter. A GPU compile
makes that one multi-output fusion per parameter, which writes each piece of state once
and no whole-model float32 temporary. XLA:CPU fuses no multi-output loops (each new piece
of state is a loop of its own), so there the update stays inside a branch
(`keep_if_finite`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxpar.errors import ConfigError
from jaxpar.model import declared, has
from jaxpar.step.gradients import Gradient
from jaxpar.step.loss import MAXIMA, source_metrics
from jaxpar.step.state import StatePlacement, TrainState, cast_floats, to_device
from jaxpar.step.zero import StateShardings

UpdateFn = Callable[..., tuple[TrainState, dict]]  # (state, loss, sums, gradient, compression=None)
# step_metrics' counts and flags: float32 on the device, integers in the rows the loop logs
COUNTS = ("nonfinite", "first_nonfinite_grad", "nonfinite_grads")


def update_fn(tx: optax.GradientTransformation, lr_schedule: optax.Schedule | None, clip_norm: float,
              shardings: StateShardings, placement: StatePlacement, compute_dtype: Any, offload: bool,
              model: Any, fused: bool = True, model_layers: Callable[[Any], Any] | None = None,
              qk_clip: float = 0.0, offload_params: bool = False) -> UpdateFn:
    """(state, loss, sums, gradient, compression) -> (new state, metrics). `clip_norm` > 0:
    the gradient is clipped to that global norm first, with optax.clip_by_global_norm's
    arithmetic. The model may adjust its weights after the optimizer (`update(master,
    counts)`, e.g. MoE bias balancing) and turn the step's counts into metrics
    (`summarise(counts)`). `compression`: the gradient compressor's new state
    (jaxpar.step.compression), kept only with the step. `fused`: the backend fuses
    multi-output loops (GPUs; XLA:CPU does not), see `keep_if_finite`. `model_layers`: the
    step's per-layer counts as the model's layers (a pipeline's padding rows dropped, for
    `summarise`; `update` reads them as the weights rest). `qk_clip` > 0: after the update
    the model scales back the query and key weights of each head whose largest attention
    logit this step (sums["maxima"]) passed it (the model's clip_qk). `offload` (the
    optimizer state) and `offload_params` (the parameters and master): what rests in host
    memory is fetched for the update, and the new state returns there at the step's edge."""
    mixed = jnp.dtype(compute_dtype) != jnp.float32

    def params_of(master: Any) -> Any:
        # ZeRO 1-2: each device updated its shard; gathering the new weights is the
        # all-gather half of the step's 2x(N-1)/N traffic.
        return jax.lax.with_sharding_constraint(cast_floats(master, compute_dtype), shardings.params)

    def apply(state: TrainState, grad: Gradient, norm: jax.Array, counts: dict, compression: Any,
              logits: Any) -> TrainState:
        # in float32 the parameters are the master weights
        master = state.master if mixed else jax.lax.with_sharding_constraint(state.params, shardings.optimizer)
        updates, opt_state = tx.update(clipped(grad, norm, clip_norm), state.opt_state, master)
        master = optax.apply_updates(master, updates)
        if counts and has(model, "update"):
            master = model.update(master, counts)
        if logits is not None:
            master = declared(model, "clip_qk")(master, logits, qk_clip)
        return TrainState(step=state.step + 1, params=params_of(master) if mixed else master,
                          master=master if mixed else None, opt_state=opt_state, compression=compression,
                          frozen=state.frozen)

    def update(state: TrainState, loss: jax.Array, sums: dict, grad: Gradient, compression: Any = None
               ) -> tuple[TrainState, dict]:
        if offload or offload_params:  # fetch from host memory for the update
            state = dataclasses.replace(state, master=to_device(state.master, placement.working.master))
        if offload:
            state = dataclasses.replace(state, opt_state=to_device(state.opt_state, placement.working.opt_state))
        if offload_params and not (mixed and fused):  # the master in float32; XLA:CPU's branch keeps them as they are
            state = dataclasses.replace(state, params=to_device(state.params, placement.working.params))
        counts = sums.get("counts", {})
        # A non-finite loss or gradient leaves the state as it was, and the schedule
        # (state.step, the optimizer's count) where the weights are; the loop then stops or
        # skips (train.on_nonfinite), naming the first bad gradient. Each gradient's squared
        # sum is finite exactly when the gradient is (or when it overflows float32, and then
        # its norm, which clipping divides by, is infinite too).
        squares = [jnp.sum(jnp.square((g / grad.divisor).astype(jnp.float32))) for g in jax.tree.leaves(grad.summed)]
        finite_grads = jnp.isfinite(jnp.stack(squares))
        finite = jnp.isfinite(loss) & jnp.all(finite_grads)
        if compression is not None:  # what a compressor left out of the gradients must be finite too
            residual = jax.tree.leaves(compression.residual)
            finite &= jnp.isfinite(sum(jnp.sum(jnp.square(r)) for r in residual))
        else:
            compression = state.compression
        grad_norm = jnp.sqrt(sum(squares))
        if qk_clip > 0 and MAXIMA not in sums:
            raise ConfigError(f"optim.qk_clip={qk_clip}: {type(model).__name__}'s attention reported no largest logits; "
                              "its attention must return them where jaxpar.sharding.reports_logits() asks, and its "
                              "clip_qk be None otherwise; set optim.qk_clip=0")
        logits = sums[MAXIMA]["attn_logit_max"] if qk_clip > 0 else None
        new = keep_if_finite(finite, apply, state, (grad, grad_norm, counts, compression, logits), fused,
                             params_of if mixed else None)
        shown = {**sums, "counts": model_layers(sums["counts"])} if model_layers and "counts" in sums else sums
        return new, step_metrics(loss, shown, grad_norm, finite, finite_grads, lr_schedule, state.step, model)

    return update


def fuses_multi_output_loops(platform: str) -> bool:
    """Whether XLA's backend for `platform` fuses loops with several outputs (GPUs do;
    XLA:CPU does not): `update_fn`'s `fused`."""
    return platform != "cpu"


def keep_if_finite(finite: jax.Array, apply: Callable, state: TrainState, args: tuple, fused: bool,
                   params_of: Callable[[Any], Any] | None = None) -> TrainState:
    """`apply(state, *args)` if `finite`, else `state`. Fused: a select per element, which a
    GPU compile folds into the update's one multi-output loop per parameter, where it costs
    nothing (a conditional's results are buffers of their own, written by separate loops).
    There `params_of(master)` (mixed precision, where the parameters are always the master's
    cast) makes the parameters from the kept master instead of selecting them, so the update
    never reads the old ones (2 of its 30 bytes a parameter under AdamW) nor, when they rest
    in host memory, fetches them. Not fused (XLA:CPU): a branch, which a finite step pays
    only for the test, where a select is one more pass over the state (docs/performance.md,
    framework overhead); its other side keeps the state as it is, gathering nothing."""
    if not fused:
        return jax.lax.cond(finite, apply, lambda state, *_: state, state, *args)
    new, old = apply(state, *args), state
    if params_of is not None:  # the parameters left out of the select
        new, old = dataclasses.replace(new, params=None), dataclasses.replace(old, params=None)
    kept = jax.tree.map(lambda new, old: jax.lax.select(finite, new, old), new, old)
    return kept if params_of is None else dataclasses.replace(kept, params=params_of(kept.master))


def clipped(grad: Gradient, norm: jax.Array, clip_norm: float) -> Any:
    """The gradient divided by its divisor and, with `clip_norm` > 0, clipped to that global
    norm (`norm`: the divided gradient's), as optax.clip_by_global_norm computes it: values
    equal to that transformation's, which the trainer no longer chains (it would read the
    whole gradient again for a norm this step already has)."""
    if clip_norm <= 0:
        return grad.value()
    within = norm < clip_norm
    return jax.tree.map(lambda g: jax.lax.select(within, g / grad.divisor, (g / grad.divisor / norm.astype(g.dtype))
                                                 * clip_norm), grad.summed)


def step_metrics(loss, sums: dict, grad_norm, finite, finite_grads, lr_schedule, step, model: Any) -> dict:
    """What the loop shows and logs. The learning rate only where the schedule is known:
    a custom optax `tx` passed to `build` without its `lr_schedule` reports none."""
    counts = sums.get("counts", {})
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        **({"learning_rate": jnp.asarray(lr_schedule(step), jnp.float32)} if lr_schedule is not None else {}),
        "nonfinite": (~finite).astype(jnp.float32),
        # which gradient leaf (in tree order) is the first non-finite one, -1 if none
        "first_nonfinite_grad": jnp.where(jnp.all(finite_grads), -1, jnp.argmin(finite_grads)).astype(jnp.float32),
        "nonfinite_grads": jnp.sum(~finite_grads).astype(jnp.float32),
        **{k: v / sums["weight"] for k, v in sums.get("token_metrics", {}).items()},
        **(model.summarise(counts) if counts and has(model, "summarise") else {}),
        **({"attn_logit_max": jnp.max(sums[MAXIMA]["attn_logit_max"])} if MAXIMA in sums else {}),
    }
    return source_metrics(metrics, sums["weight"])  # a mixture's sources' losses and tokens (jaxpar.step.loss.by_source)
