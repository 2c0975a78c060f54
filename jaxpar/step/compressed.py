"""The step's gradient averaged over `data` through a compressor (parallel.compression.method
= powersgd | topk; jaxpar.step.compression), one layer at a time inside the backward pass.

Each data replica computes its own gradient (jaxpar.step.replicas). A stacked parameter
that the model runs through `jaxpar.nn.scan_layers` gets a layer hook
(jaxpar.sharding.layer_hooks): an identity whose VJP, in the backward loop, averages that
layer's slice of the gradient over the replicas through the compressor, with that layer's
slice of the residuals (and of PowerSGD's factors) scanned beside the parameters. So the
compressed collectives of layer i run while the backward pass works on layer i - 1, where a
GPU overlaps them, as the uncompressed ZeRO 2-3 reduction is. The new residuals and factors
come back as the gradient of that state (the hook's VJP sends them there), and whatever the
scan does not run (embedding, head, final norm, a stack the model runs its own way) is
averaged once the backward pass ends, as before.

Error feedback mixes gradients across steps, so a hook must see each replica's gradient in
the units of the update: the loss is divided by the batch's total weight before the
backward pass, which needs that weight from the batch alone (`weight_of_batch`); a loss
whose weight depends on the model's outputs is averaged after the backward pass instead.
With microbatches the first m - 1 accumulate each replica's gradient, and the last one's
hooks add that sum to the residual they compress (one compression per step, as before).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.extend import core

from jaxpar.sharding import Layout, use_layout
from jaxpar.sharding.layer_hooks import Hook, LayerHooks
from jaxpar.step.compression import Compressor
from jaxpar.step.gradients import Gradient, GradientPath, LossSum, accumulate
from jaxpar.step.loss import LossFn
from jaxpar.step.microbatches import split_batch
from jaxpar.step.replicas import AXIS, inner_layout, split_replicas, without_data
from jaxpar.step.zero import StateShardings

# ------------------------------------------------------------------ the hook


def layer_hooks(compressor: Compressor, names: dict[str, tuple]) -> LayerHooks:
    """A hook for every stacked parameter (leading name `layers`); the trainer keeps those
    the model's scan takes once (`hooked_paths`)."""
    return LayerHooks({path: layer_hook(compressor, path) for path, n in names.items() if n[:1] == ("layers",)})


def layer_hook(compressor: Compressor, path: str) -> Hook:
    """(a layer's slice of parameter `path`, that slice's state {"residual": [..], "q": ..})
    -> the slice, unchanged; its VJP averages the slice's gradient over the replicas
    through the compressor (the compute dtype's cotangent, in float32) and sends the new
    state back as the state's cotangent."""
    block = compressor.blocks[path].layer()

    @jax.custom_vjp
    def hook(value, state):
        return value

    def forward(value, state):
        return value, state

    def backward(state, ct):
        mean, new = _average_layer(compressor, block, ct, state)
        return mean.astype(ct.dtype), new

    hook.defvjp(forward, backward)
    return hook


def _average_layer(compressor: Compressor, block, ct: jax.Array, state: dict) -> tuple[jax.Array, dict]:
    """Inside the per-replica vmap: each replica's `ct` -> (the compressed mean, unbatched;
    the new state, residual per replica, q shared). The kernels are shard_maps over the
    replicas stacked, which a vmap with spmd_axis_name may not trace inside: its batching
    rule, which sees them stacked, runs them once, outside."""

    @custom_vmap
    def average(ct, state):  # traced for its output types only: the vmap rule below is what runs
        return ct.astype(jnp.float32), state

    @average.def_vmap
    def _(axis_size, in_batched, ct, state):
        if not in_batched[0] or not in_batched[1]["residual"] or in_batched[1].get("q"):
            raise ValueError("a layer hook averages each replica's own gradient and residual, with a shared q")
        estimate = ct.astype(jnp.float32) * compressor.replicas  # each replica's estimate of the sum
        mean, residual, q = compressor.average(block, estimate, state["residual"], state.get("q"))
        new = {"residual": residual, **({"q": q} if q is not None else {})}
        return (mean, new), (False, {"residual": True, **({"q": False} if q is not None else {})})

    return average(ct, state)


# ------------------------------------------------------------------ which parameters, which weight


def hooked_paths(loss_sum: LossSum, hooks: LayerHooks, params: Any, batch: dict) -> frozenset[str]:
    """The stacked parameters the model's layer scan takes exactly once, found by tracing
    the loss (abstract `params` and `batch`, nothing computed): those a hook can average."""
    before = dict(hooks.taken)
    jax.eval_shape(lambda p, b: loss_sum(p, b, {path: None for path in hooks.hooks}), params, batch)
    return frozenset(p for p in hooks.hooks if hooks.taken[p] - before.get(p, 0) == 1)


def weight_of_batch(loss_fn: LossFn, outputs: Any, batch: dict) -> Callable[[dict], jax.Array] | None:
    """batch -> the total weight `loss_fn` gives it, where that weight depends on the batch
    alone (read off its jaxpr: no equation leads from the model's outputs to it); else None.
    `outputs` and `batch` are abstract, for the check."""
    jaxpr = jax.make_jaxpr(lambda o, b: loss_fn(o, b)[1])(outputs, batch)
    if _depends_on(jaxpr, len(jax.tree.leaves(outputs))):
        return None
    return lambda b: loss_fn(jax.tree.map(lambda o: jnp.zeros(o.shape, o.dtype), outputs), b)[1]


def _depends_on(jaxpr: core.ClosedJaxpr, inputs: int) -> bool:
    """Whether an output of `jaxpr` depends on its first `inputs` inputs (conservatively: an
    equation's outputs depend on each of its inputs)."""
    reached = set(jaxpr.jaxpr.invars[:inputs])
    for eqn in jaxpr.jaxpr.eqns:
        if any(isinstance(v, core.Var) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return any(isinstance(v, core.Var) and v in reached for v in jaxpr.jaxpr.outvars)


# ------------------------------------------------------------------ the gradient


def compressed_gradients(loss_sum: LossSum, layout: Layout, shardings: StateShardings, names: dict[str, tuple],
                         microbatches: int, compressor: Compressor,
                         weight_of: Callable[[dict], jax.Array] | None) -> GradientPath:
    """The compressed GradientPath (jaxpar.step.gradients): the gradient averaged over data
    by the compressor and normalised by the batch's weight (a `Gradient` whose divisor is 1),
    and the new compression state. LoRA is refused with compression, so `frozen` is None."""
    per_layer = compressor.per_layer if weight_of is not None else frozenset()
    hooked = _replica_grads(loss_sum, layout, shardings.grads, per_layer)
    plain = _replica_grads(loss_sum, layout, shardings.grads, frozenset())
    data = layout.mesh.shape[AXIS]

    def split(batch):
        return {k: split_replicas(v, names[k], layout) for k, v in batch.items()}

    def grads(params, batch, state, frozen=None):
        weight = weight_of(batch) if weight_of is not None else None
        scale = 1.0 / weight if weight is not None else jnp.ones((), jnp.float32)
        layer_state = {p: s for p, s in compressor.layer_state(state).items() if p in per_layer}
        if microbatches == 1:
            total, (weight_sum, sums), g, new_layer_state = hooked(params, layer_state, split(batch), scale)
            total, weight_sum, sums = total.sum(), weight_sum.sum(), jax.tree.map(lambda x: x.sum(0), sums)
        else:  # the first m - 1 accumulate per replica; the last one's hooks compress their sum too
            micro = split_batch(batch, microbatches, names, layout)
            first, last = jax.tree.map(lambda x: x[:-1], micro), jax.tree.map(lambda x: x[-1], micro)
            step = lambda p, mb: _summed(plain(p, {}, split(mb), scale)[:3])  # noqa: E731
            total, (weight_sum, sums), acc = accumulate(step, params, first, shardings.grads, True, data)
            acc = dict(zip(compressor.blocks, jax.tree.leaves(acc)))
            # in the residual's units: each replica's estimate of the sum, n x its own gradient
            layer_state = {p: {**s, "residual": s["residual"] + data * acc[p]} for p, s in layer_state.items()}
            t, (w, s), g, new_layer_state = hooked(params, layer_state, split(last), scale)
            g = jax.tree.unflatten(compressor.treedef, [x if p in per_layer else x + acc[p]
                                                        for p, x in zip(compressor.blocks, jax.tree.leaves(g))])
            total, weight_sum = total + t.sum(), weight_sum + w.sum()
            sums = jax.tree.map(lambda a, b: a + b.sum(0), sums, s)
        if weight is None:  # normalised now: the loss's weight came out of the forward pass
            weight, g = weight_sum, jax.tree.map(lambda x: x / weight_sum, g)
        done = {p: (x, new_layer_state[p]) for p, x in zip(compressor.blocks, jax.tree.leaves(g)) if p in per_layer}
        means, state = compressor.reduce(g, state, done)
        return total / weight, {"weight": weight, **sums}, Gradient(means, jnp.ones((), jnp.float32)), state

    return grads


def _summed(found: tuple) -> tuple:
    """A replica-stacked microbatch result (loss [data], (weight [data], sums), grads
    [data, ...]) -> the loss and sums over the replicas, gradients per replica in float32."""
    total, (weight, sums), g = found
    return total.sum(), (weight.sum(), jax.tree.map(lambda x: x.sum(0), sums)), jax.tree.map(
        lambda x: x.astype(jnp.float32), g)


def _replica_grads(loss_sum: LossSum, layout: Layout, grad_shardings: Any, per_layer: frozenset[str]) -> Callable:
    """(params, layer state, replica batch [data, b, ...], scale) -> (loss sums [data],
    (weights [data], sums), gradients, new layer state): each replica's gradient of its
    loss x scale in float32, [data, ...] reduced inside the replica, except the `per_layer`
    parameters', averaged over the replicas by their hooks (unbatched, float32)."""
    inner = inner_layout(layout)
    paths = jax.tree_util.tree_flatten_with_path(grad_shardings)[0]
    keys = [jax.tree_util.keystr(k, simple=True, separator=".") for k, _ in paths]
    treedef = jax.tree.structure(grad_shardings)
    inside = [without_data(s) for _, s in paths]

    def objective(params, layer_state, batch, scale):
        total, (weight, sums) = loss_sum(params, batch, layer_state)
        return total * scale, (total, weight, sums)

    grad_fn = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)

    def one(params, layer_state, batch, scale):
        with use_layout(inner):
            (_, (total, weight, sums)), (g, new_state) = grad_fn(params, layer_state, batch, scale)
        g = [x.astype(jnp.float32) if k in per_layer else jax.lax.with_sharding_constraint(x, s).astype(jnp.float32)
             for k, x, s in zip(keys, jax.tree.leaves(g), inside)]
        return total, (weight, sums), jax.tree.unflatten(treedef, g), new_state

    grad_axes = jax.tree.unflatten(treedef, [None if k in per_layer else 0 for k in keys])
    state_axes = {p: {"residual": 0, "q": None} for p in per_layer}

    def run(params, layer_state, batch, scale):
        axes = {p: {k: state_axes[p][k] for k in s} for p, s in layer_state.items()}
        mapped = jax.vmap(one, in_axes=(None, axes, 0, None), out_axes=(0, 0, grad_axes, axes), spmd_axis_name=AXIS)
        return mapped(params, layer_state, batch, scale)

    return run
