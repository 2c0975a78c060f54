"""The step's gradient: the loss of a batch, accumulated over microbatches, reduced over the
replicas, returned in the optimizer's sharding as a sum and the batch's total weight that
normalises it (`Gradient`)."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.nn import layer_policy
from jaxpar.sharding import Layout, use_layout
from jaxpar.sharding.adapters import join
from jaxpar.sharding.layer_hooks import LayerHooks, use_layer_hooks
from jaxpar.step.loss import LossFn, combine_sums, model_loss, no_sums, reduce_sums
from jaxpar.step.microbatches import split_batch
from jaxpar.step.reduction import GradReduction, sum_replicas
from jaxpar.step.replicas import per_replica, split_replicas, stacked_over_data
from jaxpar.step.sequence import lay_out_sequences
from jaxpar.step.state import cast_floats, on_device
from jaxpar.step.zero import StateShardings



class Gradient(NamedTuple):
    """The step's gradient, `summed / divisor` (a scalar): the batch's weight, or 1 where the
    sum is normalised already. The division is left to the optimizer's passes over the
    gradient (jaxpar.step.update): one for the norm and one for the update, each dividing
    as it reads, so no divided whole-model copy is ever written."""

    summed: Any
    divisor: jax.Array

    def value(self) -> Any:
        return jax.tree.map(lambda g: g / self.divisor, self.summed)


# (params, batch[, layer hooks' state]) -> (loss sum, (weight, sums))
LossSum = Callable[..., tuple[jax.Array, tuple[jax.Array, dict]]]


class GradientPath(Protocol):
    """The step's gradient, one signature for every path (this module's, the pipeline's:
    jaxpar.step.pipelined, a compressor's: jaxpar.step.compressed): (params, a batch
    `prepare_batch` made, the compression state or None, LoRA's frozen weights or None) ->
    (loss, the model's sums, the gradient in the optimizer's sharding, the new compression
    state)."""

    def __call__(self, params: Any, batch: dict, compression: Any, frozen: Any
                 ) -> tuple[jax.Array, dict, Gradient, Any]: ...


def prepare_batch(batch: dict, layout: Layout, task: str) -> dict:
    """What the step does to its global batch once, before any path splits it into
    microbatches or replicas: a language model's sequences laid out as the context-parallel
    kernels expect (jaxpar.step.sequence, which adds "positions")."""
    return lay_out_sequences(batch, layout) if task == "lm" else batch


def prepared_names(names: dict[str, tuple], task: str) -> dict[str, tuple]:
    """The logical names of `prepare_batch`'s fields: "positions" is named as the inputs."""
    return {"positions": names["inputs"], **names} if task == "lm" else names


def loss_sum_fn(graphdef: nnx.GraphDef, loss_fn: LossFn, remat: str, hooks: LayerHooks | None = None,
                loss_chunks: int = 1) -> LossSum:
    """(params, prepared batch, layer state=None, frozen=None) -> (loss sum, (weight, sums)) of the
    model under `loss_fn` (the built-in one in `loss_chunks` groups of tokens: jaxpar.step.loss); with
    `hooks` and a layer state ({parameter path: its state}), those parameters' hooks run in
    the model's layer scan (jaxpar.sharding.layer_hooks); `frozen`: LoRA's frozen weights,
    read beside `params` and not differentiated (jaxpar.step.lora)."""

    def loss_sum(params, batch, layer_state=None, frozen=None):
        bound = hooks.bind(params, layer_state) if hooks is not None and layer_state else None
        with use_layer_hooks(bound):  # bound here, inside any checkpoint: to the arrays the model gets
            return model_loss(nnx.merge(graphdef, join(params, frozen)), batch, loss_fn, loss_chunks)

    if remat == "none":
        # Outside the layer scan too, a gathered parameter (embedding, head) is gathered
        # again for the backward pass rather than kept whole (ZeRO-3: 3x traffic, 1/N
        # memory). Only under "none": an outer checkpoint overrides the layers' own policy.
        loss_sum = jax.checkpoint(loss_sum, policy=layer_policy("none"), prevent_cse=True)
    return loss_sum


def batch_gradients(loss_sum: LossSum, layout: Layout, shardings: StateShardings, names: dict[str, tuple],
                    microbatches: int, reduction: GradReduction) -> GradientPath:
    """Gradient of (sum of per-example losses over the global batch) / (its weight), as
    that sum's gradient and the weight (`Gradient`), accumulated over microbatches in
    float32, in the optimizer's sharding, with the loss and the model's other sums over the
    batch (jaxpar.step.loss).

    Summed over the replicas as `reduction` says (jaxpar.step.reduction; not "compressed",
    which jaxpar.step.compressed computes): per-replica gradients are reduced over fsdp
    inside the replica, then over data once per step ("step": microbatches accumulate
    unreduced) or layer by layer inside each microbatch's backward pass ("layers":
    reduce-scattered into the sharded accumulator). Without accumulation there is no
    gradient buffer to keep whole: ZeRO-1 reduce-scatters straight to the optimizer's
    shards, like ZeRO-2.
    """
    if reduction.when == "compressed":
        raise ValueError("a compressed reduction's gradient is jaxpar.step.compressed's, not batch_gradients'")
    reduce_to = shardings.grads if microbatches > 1 else shardings.optimizer
    replicas, per_step = reduction.per_replica, reduction.when == "step"
    summed = reduction.replica_sum()  # "layers": summed over the replicas inside the backward pass
    reduce = sum_replicas(reduction, layout)

    def microbatch(grad_fn, params, mb):
        """(loss sum, (weight, sums), gradient) of one microbatch; the gradient is [data, ...]
        per replica if reduced per step, else reduced to `reduce_to`."""
        if not replicas:
            with use_layout(layout):
                (l, aux), g = grad_fn(params, mb)
            return l, aux, cast_floats(jax.lax.with_sharding_constraint(on_device(g, layout), reduce_to), jnp.float32)
        mb = {k: split_replicas(v, names[k], layout) for k, v in mb.items()}
        l, aux, g = per_replica(grad_fn, layout, shardings.grads, summed)(params, mb)
        if summed:  # reduced over the replicas layer by layer, inside the backward pass
            g = jax.lax.with_sharding_constraint(g, reduce_to)
        else:  # reduced once per step
            g = cast_floats(g, jnp.float32)
        weight, sums = aux
        return l.sum(), (weight.sum(0), reduce_sums(sums)), g

    def grads(params, batch, compression, frozen) -> tuple[jax.Array, dict, Gradient, Any]:
        """`frozen`: LoRA's frozen weights, which the loss reads and nothing differentiates;
        `compression` passes through (no compressor on this path)."""
        bound = loss_sum if frozen is None else functools.partial(loss_sum, frozen=frozen)
        one = functools.partial(microbatch, jax.value_and_grad(bound, has_aux=True))
        if microbatches == 1:
            total, (weight, sums), g = one(params, batch)
        else:
            total, (weight, sums), g = accumulate(one, params, split_batch(batch, microbatches, names, layout),
                                                  shardings.grads, per_step, layout.mesh.shape["data"])
        if per_step:
            g = reduce(g, shardings.optimizer)
        g = jax.lax.with_sharding_constraint(g, shardings.optimizer)
        return total / weight, {"weight": weight, **sums}, Gradient(g, weight), compression

    return grads


def accumulate(microbatch: Callable, params: Any, micro: dict, grad_shardings: Any, stacked: bool, data: int):
    """Sum `microbatch`'s (loss, (weight, sums), gradient) over the leading axis of `micro`
    in a scan, the gradient accumulator sharded as `grad_shardings` (stacked per replica
    over data when `stacked`)."""
    acc_shardings = jax.tree.map(stacked_over_data, grad_shardings) if stacked else grad_shardings

    def step(carry, mb):
        g_acc, l_acc, aux_acc = carry
        l, aux, g = microbatch(params, mb)
        g_acc = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, g_acc, g), acc_shardings)
        (w_acc, s_acc), (w, s) = aux_acc, aux
        return (g_acc, l_acc + l, (w_acc + w, combine_sums(s_acc, s))), None

    lead = (data,) if stacked else ()  # per-replica gradients are stacked
    zeros = jax.tree.map(lambda p, s: jnp.zeros(lead + p.shape, jnp.float32, device=s), params, acc_shardings)
    first = jax.tree.map(lambda x: x[0], micro)
    weight, sums = jax.eval_shape(microbatch, params, first)[1]
    aux_zeros = (jnp.zeros(weight.shape, weight.dtype), no_sums(sums))
    (grads, total, aux), _ = jax.lax.scan(step, (zeros, jnp.zeros((), jnp.float32), aux_zeros), micro)
    # Pin the loop's output too: otherwise the optimizer's sharding is propagated into the
    # carry, which then gathers every microbatch.
    return total, aux, jax.lax.with_sharding_constraint(grads, acc_shardings)
