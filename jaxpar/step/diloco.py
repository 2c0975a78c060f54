"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105) and streaming DiLoCo (Douillard et al.
2025, arXiv 2501.18512) over mesh.data (parallel.diloco).

**Groups.** Each data replica is a group: it holds its own parameters, master weights and
inner optimizer state, stacked on a leading axis sharded over `data` (a device holds its
group's copy), and trains on its own rows of each batch. The step is vmapped over that axis
as jaxpar.step.replicas computes a replica's gradient, so inside a group fsdp, tensor,
context and expert work as they do without DiLoCo; no gradient is ever reduced over `data`.
`data` is the groups' axis, not an axis of its own, because it is already the one the hosts
split last (jaxpar.plan's host order) and the one whose replicas the step already knows how
to run apart; data parallelism inside a group is `fsdp` (hybrid sharding).

**The outer step.** Every `inner_steps / fragments` steps one fragment synchronises, in
turn. Its pseudo-gradient is each group's change since the last synchronisation,
anchor - local, averaged over the groups (an all-reduce over `data`: the only traffic across
groups). SGD with (Nesterov) momentum moves the anchor by it:

    m <- mu m + delta;  anchor <- anchor - lr (delta + mu m  |  m without Nesterov)

and the groups' weights of the fragment become (1 - mix) anchor + mix local. The inner
optimizers' states are kept. With one fragment and delay 0 this is DiLoCo; with H = 1, an
outer SGD step of lr 1 and inner SGD it is data parallelism (the groups' rows of equal
weight).

**Streaming.** Fragments: the layer stack (dim "layers", the one pipeline stages split)
strided, layer i in fragment i mod P; every other parameter whole, in the lightest fragment
(`fragment_plan`). With delay 1 a fragment's pseudo-gradient is taken from the weights
before the step that ends its period, and its exchange runs beside that step's compute (one
program: XLA schedules the all-reduce against the inner step's work); its outer step follows
the inner update. Each kind of step (no sync, fragment k's) is a branch of one
`lax.switch` on the step count, so a step pays only for its own exchange.

**Compression.** `int8`: each group's pseudo-gradient crosses as int8 with a float32 scale
per block (jaxpar.kernels.quantized: a reduce-scatter, then an all-gather of the mean), with
error feedback on the first half: what rounding left out of a group's share is added to its
next one (`residual`, per group). Leaves no dimension of which `data` divides cross in
float32. `topk`: each device sends its block's largest entries as (value, index) pairs
(jaxpar.kernels.compression.topk_mean), the rest kept as the residual.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.compression import topk_mean
from jaxpar.kernels.quantized import quantized_all_gather, quantized_reduce_scatter, reduce_scatter_rounding
from jaxpar.sharding.annotate import ParamNames, add_axes
from jaxpar.specs import DilocoConfig
from jaxpar.step.replicas import AXIS, split_replicas, stacked_over_data
from jaxpar.step.state import TrainState, cast_floats
from jaxpar.step.zero import StateShardings

LAYERS = "layers"  # the stack whose rows the fragments stride (jaxpar.nn.stack_layers' default name)
SCOPE = "diloco_outer"  # the name scope of the step's switch (jaxpar.inspect weighs its branches: branch_shares)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Outer:
    """DiLoCo's outer state, the same on every group (but `residual`)."""

    anchor: Any  # float32 weights at their fragment's last synchronisation, the parameters' sharding
    momentum: Any  # float32 outer momentum, as `anchor`
    residual: Any = None  # int8's error feedback: per group [data, ...], float32; None without


@dataclasses.dataclass(frozen=True)
class Rows:
    """A fragment's rows of a layer stack (dim 0 of the parameter)."""

    index: tuple[int, ...]


WHOLE, NONE = "whole", "none"  # a parameter wholly in a fragment, or not at all


def fragment_plan(names: Any, shapes: Any, fragments: int) -> list[Any]:
    """One tree per fragment, leaf for leaf with the parameters: Rows of the layer stack
    (strided: layer i in fragment i mod `fragments`), WHOLE, or NONE. Parameters outside the
    stack go whole, largest first, to the fragment with the fewest elements so far."""
    leaves, treedef = jax.tree.flatten(names, is_leaf=lambda x: isinstance(x, ParamNames))
    sizes = [math.prod(s.shape) for s in jax.tree.leaves(shapes)]
    shapes_ = [s.shape for s in jax.tree.leaves(shapes)]
    plan = [[NONE] * len(leaves) for _ in range(fragments)]
    load = [0] * fragments
    for i, n in enumerate(leaves):
        if n.names and n.names[0] == LAYERS:
            rows = shapes_[i][0]
            for k in range(fragments):
                mine = tuple(range(k, rows, fragments))
                plan[k][i] = Rows(mine) if mine else NONE
                load[k] += sizes[i] // rows * len(mine)
    heap = [(load[k], k) for k in range(fragments)]
    heapq.heapify(heap)
    for i in sorted((i for i, n in enumerate(leaves) if not (n.names and n.names[0] == LAYERS)),
                    key=lambda i: -sizes[i]):
        held, k = heapq.heappop(heap)
        plan[k][i] = WHOLE
        heapq.heappush(heap, (held + sizes[i], k))
    return [jax.tree.unflatten(treedef, p) for p in plan]


def branch_shares(spec: DilocoConfig) -> dict[str, tuple[float, ...]]:
    """For the compiled program's accounting (jaxpar.inspect.hlo.executions): how often the
    step's switch takes each branch, none (1 - fragments / H) and each fragment's (1 / H)."""
    return {SCOPE: (1 - spec.fragments / spec.inner_steps, *[1 / spec.inner_steps] * spec.fragments)}


def outer_bytes(spec: DilocoConfig, elements: float, groups: int) -> float:
    """Bytes one device sends to other groups per step, on average (the ring model of
    jaxpar.inspect): its `elements` of the weights all-reduced over the groups once every
    inner_steps (each fragment once a round), 2 x (G-1)/G of them, at 4 bytes each in
    float32, 1 + 4 / quantization_block in int8 (the reduce-scatter and the all-gather);
    top-k all-gathers topk_fraction of them as 8-byte (value, index) pairs, (G-1) x."""
    if spec.compression == "topk":
        return 8 * spec.topk_fraction * elements * (groups - 1) / spec.inner_steps
    each = 4 if spec.compression == "none" else 1 + 4 / spec.quantization_block
    return 2 * each * elements * (groups - 1) / groups / spec.inner_steps


def fragment_elements(plan: Any, shapes: Any) -> int:
    """How many of the parameters' elements a fragment holds."""
    def one(sel, s):
        return 0 if sel == NONE else math.prod(s.shape) if sel == WHOLE else math.prod(s.shape) // s.shape[0] * len(sel.index)
    return sum(jax.tree.leaves(jax.tree.map(one, plan, shapes, is_leaf=is_selection)))


def is_selection(x) -> bool:
    return isinstance(x, (Rows, str))


def take(x: jax.Array, sel, lead: int) -> jax.Array:
    """A parameter's share in a fragment (`lead` leading dims before the parameter's own)."""
    return x if sel == WHOLE else x[(slice(None),) * lead + (np.asarray(sel.index),)]


def put(x: jax.Array, sel, value: jax.Array, lead: int) -> jax.Array:
    return value if sel == WHOLE else x.at[(slice(None),) * lead + (np.asarray(sel.index),)].set(value)


@dataclasses.dataclass(frozen=True)
class OuterStep:
    """The outer step of one layout: what it reads to exchange and move each fragment. The
    parameter-shaped trees (the anchor, the groups' weights) are walked as flat lists of
    leaves, in the order jax.tree.leaves gives them."""

    spec: DilocoConfig
    plans: list  # fragment_plan's trees, flattened: per fragment, a selection per parameter
    specs: list  # per parameter, its PartitionSpec inside a group (the anchor's)
    names: list  # per parameter, its logical names
    mesh: Any

    @classmethod
    def build(cls, spec: DilocoConfig, names: Any, shapes: Any, shardings: Any, mesh) -> OuterStep:
        plans = [jax.tree.leaves(p, is_leaf=is_selection) for p in fragment_plan(names, shapes, spec.fragments)]
        return cls(spec, plans, [s.spec for s in jax.tree.leaves(shardings)],
                   [n.names for n in jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, ParamNames))], mesh)

    def pseudo_gradient(self, k: int, outer: Outer, local: Any) -> tuple[list, Any]:
        """(fragment k's pseudo-gradient, anchor - local, averaged over the groups: a list
        with an array per parameter in the fragment, None for the others; the new
        residual). `local`: the groups' float32 weights [data, ...]."""
        anchor, weights = jax.tree.leaves(outer.anchor), jax.tree.leaves(local)
        residual = jax.tree.leaves(outer.residual) if outer.residual is not None else [None] * len(anchor)
        left, means = list(residual), []
        for i, sel in enumerate(self.plans[k]):
            if sel == NONE:
                means.append(None)
                continue
            d = take(anchor[i], sel, 0)[None] - take(weights[i], sel, 1)
            if residual[i] is not None:
                d = d + take(residual[i], sel, 1)
            mean, rounding = self._mean(d, self.specs[i], self.names[i])
            means.append(mean)
            if residual[i] is not None:
                left[i] = put(residual[i], sel, rounding, 1)
        new_residual = None if outer.residual is None else jax.tree.unflatten(jax.tree.structure(outer.residual), left)
        return means, new_residual

    def _mean(self, d: jax.Array, spec: P, names) -> tuple[jax.Array, jax.Array]:
        """(the groups' mean of d [data, ...] in the anchor's sharding, what compression left
        out of each group's share: zeros in float32). int8 where `data` divides a dimension;
        top-k on each device's block (jaxpar.kernels.compression.topk_mean)."""
        groups = self.mesh.shape[AXIS]
        if self.spec.compression == "topk":
            return topk_mean(d, jnp.zeros_like(d), self.spec.topk_fraction, self.mesh, AXIS, spec)
        target = add_axes(spec, d.shape[1:], names, self.mesh, (AXIS,))
        if self.spec.compression == "none" or target == spec:
            return jax.lax.with_sharding_constraint(d.mean(0), NamedSharding(self.mesh, spec)), jnp.zeros_like(d)
        block = self.spec.quantization_block
        sent = reduce_scatter_rounding(d, self.mesh, AXIS, spec, target, block)
        total = quantized_reduce_scatter(sent, self.mesh, AXIS, spec, target, block)
        return quantized_all_gather(total / groups, self.mesh, target, spec, block), d - sent

    def apply(self, k: int, outer: Outer, means: list, local: Any) -> tuple[Outer, Any]:
        """(the outer state with fragment k moved by its pseudo-gradient `means`, the groups'
        float32 weights [data, ...] with fragment k's set to (1 - mix) anchor + mix local)."""
        spec = self.spec
        anchor, momentum, weights = (list(jax.tree.leaves(t)) for t in (outer.anchor, outer.momentum, local))
        for i, sel in enumerate(self.plans[k]):
            if sel == NONE:
                continue
            d = means[i]
            m = spec.outer_momentum * take(momentum[i], sel, 0) + d
            new = take(anchor[i], sel, 0) - spec.outer_lr * (d + spec.outer_momentum * m if spec.nesterov else m)
            mine = take(weights[i], sel, 1)
            mixed = (1 - spec.mix) * new[None] + spec.mix * mine if spec.mix else jnp.broadcast_to(new[None], mine.shape)
            anchor[i], momentum[i], weights[i] = put(anchor[i], sel, new, 0), put(momentum[i], sel, m, 0), \
                put(weights[i], sel, mixed, 1)
        tree = jax.tree.structure(outer.anchor)
        return (dataclasses.replace(outer, anchor=jax.tree.unflatten(tree, anchor),
                                    momentum=jax.tree.unflatten(tree, momentum)),
                jax.tree.unflatten(jax.tree.structure(local), weights))


# ------------------------------------------------------------------ the step


@dataclasses.dataclass(frozen=True)
class Groups:
    """What the DiLoCo step is made of: one group's gradient path and update (built for the
    layout with `data` taken out: jaxpar.step.replicas.inner_layout), run for every group at
    once, and the outer step between them."""

    grads: Callable  # jaxpar.step.gradients.GradientPath, for one group's rows
    update: Callable  # jaxpar.step.update's UpdateFn
    outer: OuterStep
    layout: Any  # the whole mesh's
    batch_names: dict  # the prepared batch's logical names
    prepare: Callable  # the global batch -> the prepared batch (jaxpar.step.gradients.prepare_batch)
    shardings: StateShardings
    compute_dtype: Any

    @property
    def spec(self) -> DilocoConfig:
        return self.outer.spec

    def inner(self, state: TrainState, rows: dict) -> tuple[TrainState, dict, Any]:
        """Every group's inner step on its rows [data, b, ...]: (the state after it, the
        groups' metrics as one, the groups' mean gradient)."""
        def one(group: TrainState, rows: dict):
            loss, sums, grad, _ = self.grads(group.params, rows, None, None)
            new, metrics = self.update(group, loss, sums, grad)
            return new, metrics, sums["weight"], grad.value()

        group = TrainState(state.step, state.params, state.master, state.opt_state)
        axes = TrainState(None, 0, 0, 0)
        new, metrics, weight, grad = jax.vmap(one, in_axes=(axes, 0), spmd_axis_name=AXIS)(group, rows)
        grad = jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g.mean(0), s), grad, self.shardings.optimizer)
        state = dataclasses.replace(state, step=state.step + 1, params=new.params, master=new.master,
                                    opt_state=new.opt_state)
        return state, group_metrics(metrics, weight), grad

    def synchronise(self, k: int, state: TrainState, means: list, residual: Any) -> TrainState:
        """Fragment k's outer step, from its pseudo-gradient `means`, and the groups' weights
        of it moved to the new anchor (mixed with their own)."""
        outer, weights = self.outer.apply(k, dataclasses.replace(state.outer, residual=residual), means, local(state))
        params = jax.tree.map(lambda w, s: jax.lax.with_sharding_constraint(w, stacked_over_data(s)),
                              cast_floats(weights, self.compute_dtype), self.shardings.params)
        return dataclasses.replace(state, params=params, master=None if state.master is None else weights, outer=outer)

    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict, Any]:
        """(the state after the step, its metrics, the groups' mean gradient). Which fragment
        synchronises (if any) is read on the device from the step count, and picks a branch
        of a lax.switch. With delay 0 the branches are the outer steps alone, after the inner
        step; with delay 1 each holds the inner step too, its exchange (from the weights
        before it) beside the inner step's work in one computation."""
        batch = self.prepare(batch)
        rows = {k: split_replicas(v, self.batch_names[k], self.layout) for k, v in batch.items()}
        period, count = self.spec.inner_steps // self.spec.fragments, self.spec.fragments
        done = state.step + 1
        which = jnp.where(done % period == 0, 1 + (done // period - 1) % count, 0)
        synced = {"outer_sync": (which > 0).astype(jnp.float32)}
        if not self.spec.delay:
            state, metrics, grad = self.inner(state, rows)

            def after(k, state):
                return self.synchronise(k, state, *self.outer.pseudo_gradient(k, state.outer, local(state)))

            branches = [lambda state: state, *(functools.partial(after, k) for k in range(count))]
            with jax.named_scope(SCOPE):
                state = jax.lax.switch(which, branches, state)
            return state, {**metrics, **synced}, grad

        def beside(k, state, rows):
            means, residual = self.outer.pseudo_gradient(k, state.outer, local(state))
            state, metrics, grad = self.inner(state, rows)
            return self.synchronise(k, state, means, residual), metrics, grad

        branches = [self.inner, *(functools.partial(beside, k) for k in range(count))]
        with jax.named_scope(SCOPE):
            state, metrics, grad = jax.lax.switch(which, branches, state, rows)
        return state, {**metrics, **synced}, grad


    def gradient(self, params: Any, batch: dict, frozen: Any = None) -> tuple[jax.Array, Any]:
        """(the loss, the groups' mean gradient) of `params` on every group's rows: the
        gradient one device gives where the groups' rows weigh the same."""
        batch = self.prepare(batch)
        rows = {k: split_replicas(v, self.batch_names[k], self.layout) for k, v in batch.items()}
        loss, sums, grad, _ = jax.vmap(lambda r: self.grads(params, r, None, None), spmd_axis_name=AXIS)(rows)
        share = sums["weight"] / sums["weight"].sum()
        mean = jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g.mean(0), s), grad.value(),
                            self.shardings.optimizer)
        return jnp.sum(loss * share), mean


def attach(trainer: Any, groups: Groups, start_from: Callable, init: Callable, batch_shardings: dict,
           options: dict) -> Any:
    """`trainer` (jaxpar.step.trainer.Trainer) training with DiLoCo: its state every group's
    (`stacked_state`), its step `groups.step`, its init and imports stacked."""
    spec, mesh = groups.spec, groups.layout.mesh
    count = mesh.shape[AXIS]
    resting = stacked_shardings(trainer.state_shardings, groups.shardings, spec)
    replicated = NamedSharding(mesh, P())
    compiler = options or None
    return dataclasses.replace(
        trainer,
        state_shardings=resting,
        init=jax.jit(lambda: stacked_state(init(), count, spec), out_shardings=resting),
        start_from=jax.jit(lambda w: stacked_state(start_from(w), count, spec), out_shardings=resting),
        step=jax.jit(lambda s, b: groups.step(s, b)[:2], in_shardings=(resting, batch_shardings),
                     out_shardings=(resting, replicated), donate_argnums=0, compiler_options=compiler),
        step_and_grads=jax.jit(groups.step, in_shardings=(resting, batch_shardings),
                               out_shardings=(resting, replicated, groups.shardings.optimizer), donate_argnums=0,
                               compiler_options=compiler),
        grads=jax.jit(groups.gradient, in_shardings=(groups.shardings.params, batch_shardings),
                      out_shardings=(replicated, groups.shardings.optimizer), compiler_options=compiler),
    )


def local(state: TrainState) -> Any:
    """The groups' float32 weights [data, ...]: the master, or in float32 the parameters."""
    return state.params if state.master is None else state.master


def group_metrics(metrics: dict, weight: jax.Array) -> dict:
    """The groups' metrics [data] as one: the non-finite flags by their worst, the largest
    logit by its largest, the rest averaged under the groups' weights (the loss as one
    device would see the batch)."""
    share = weight / weight.sum()
    worst = {"nonfinite": jnp.max, "first_nonfinite_grad": jnp.max, "nonfinite_grads": jnp.sum,
             "attn_logit_max": jnp.max}
    return {k: worst[k](v) if k in worst else jnp.sum(v * share) for k, v in metrics.items()}


def stacked_state(state: TrainState, groups: int, spec: DilocoConfig) -> TrainState:
    """One device's TrainState as DiLoCo's: every group's copy of the parameters, master and
    inner optimizer state, and the outer state at its start (the anchor the float32 weights,
    no momentum, no residual)."""
    copies = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x[None], (groups, *x.shape)), tree)  # noqa: E731
    master = state.params if state.master is None else state.master
    residual = copies(jax.tree.map(jnp.zeros_like, master)) if spec.compression != "none" and spec.error_feedback \
        else None
    return TrainState(state.step, copies(state.params), copies(state.master), copies(state.opt_state),
                      outer=Outer(master, jax.tree.map(jnp.zeros_like, master), residual))


def stacked_shardings(resting: TrainState, shardings: StateShardings, spec: DilocoConfig) -> TrainState:
    """The shardings of `stacked_state`'s state: each group's copies over `data`, the outer
    state as the float32 weights inside a group (the same on every group)."""
    over_data = lambda tree: jax.tree.map(stacked_over_data, tree)  # noqa: E731
    residual = over_data(shardings.optimizer) if spec.compression != "none" and spec.error_feedback else None
    return TrainState(resting.step, over_data(resting.params), over_data(resting.master),
                      over_data(resting.opt_state),
                      outer=Outer(shardings.optimizer, shardings.optimizer, residual))
