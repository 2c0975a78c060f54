"""The train step's gradient when the layer stack is cut into pipeline stages
(mesh.stage > 1): the batch goes through the executor (jaxpar.pipeline.executor) in
microbatches, following the configured schedule.

Each data replica accumulates its stage's gradients over the microbatches unreduced; they
are reduced over `data` once per step (ZeRO-1: reduce-scattered to the optimizer's shards),
and the loss is normalised by the whole batch's token count, as without stages. Over an
`expert` axis the executor is manual too (`by_expert`): the weights every expert-parallel
device shares are summed over it once per step, not once per microbatch and layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.config import Config
from jaxpar.kernels.quantized import entries
from jaxpar.model import axis_names
from jaxpar.pipeline.executor import EXPERT, Manual, pipeline_grads
from jaxpar.pipeline.program import Program, compile_schedule
from jaxpar.pipeline.split import StageSplit, stage_split
from jaxpar.pipeline.stages import Score, in_model_order, join_layers, model_stages, split_layers
from jaxpar.sharding import Layout, use_layout
from jaxpar.step.gradients import Gradient, GradientPath
from jaxpar.step.loss import LossFn, chunked_task_loss, reduce_sums
from jaxpar.step.microbatches import split_batch
from jaxpar.step.replicas import inner_layout, without_axis


def pipelined_grads(
    config: Config, layout: Layout, graphdef: nnx.GraphDef, names: dict[str, tuple], reduce_over_data: Callable[[Any], Any],
    loss_fn: LossFn, param_shardings: Any,
) -> tuple[GradientPath, Program]:
    """The pipeline's GradientPath (jaxpar.step.gradients; `names`: the prepared batch's), and
    the compiled schedule. `reduce_over_data` sums per-replica gradients [data, ...] into
    the optimizer's sharding; `loss_fn` scores the last stage's outputs; `param_shardings`:
    where the parameters the stages read lie (in pipeline order)."""
    p, m, v = layout.mesh.shape["stage"], layout.microbatches, layout.pipeline.chunks
    program = compile_schedule(layout.pipeline.schedule, p, m, v, layer_split(config, layout))
    stages = model_stages(graphdef, stage_score(loss_fn, config.train.loss_chunks))
    manual = by_expert(config, layout, param_shardings)
    # The executor is manual over stage and data (and expert): its rules leave them out, and
    # no kernel folds a vmapped replica axis (data is not vmapped there).
    inside = dataclasses.replace(inner_layout(layout), replica_axis=None)
    if manual is not None:
        inside = without_expert(inside)

    def grads(params: Any, batch: dict, compression: Any, frozen: Any) -> tuple[jax.Array, dict, Gradient, Any]:
        """`frozen`: LoRA's frozen weights, which the stages read beside `params`;
        `compression` passes through (refused in stages)."""
        layers, other = split_layers(params)
        frozen = split_layers(frozen) if frozen else None
        micro = split_batch(batch, m, names, layout)
        with use_layout(inside):
            total, weight, d_layers, d_other, reports = pipeline_grads(program, stages, layout.mesh, layers, other, micro,
                                                                       frozen, manual)
        summed = reduce_over_data(join_layers(d_layers, d_other))
        total, weight = total.sum(), weight.sum()
        # The layers' reports (MoE: "token_metrics" sums, per-layer "counts" in pipeline order,
        # the order the parameters a model's `update` reads are stored in), over the replicas.
        sums = reduce_sums({**reports["sums"], **reports["per_layer"]})  # MAXIMA by their largest
        return total / weight, {"weight": weight, **sums}, Gradient(summed, weight), compression

    return grads, program


def by_expert(config: Config, layout: Layout, param_shardings: Any) -> Manual | None:
    """The weights' specs over `stage` and `expert` for an executor manual over `expert`
    (jaxpar.pipeline.executor.Manual), or None where `expert` stays with the partitioner:
    a mesh without it, LoRA (whose frozen bases may be quantized into other shapes), or rules
    that put `expert` on anything but the rows and the experts' own dimension (there a
    device's share of a weight would not be a whole expert)."""
    if layout.mesh.shape[EXPERT] == 1 or config.lora.rank > 0:
        return None
    ours = axis_names(config.model)  # a model's own names -> jaxpar's
    for kind in ("storage", "compute"):
        for name, axes in layout.rules.table(kind).items():
            if EXPERT in axes and ours.get(name, name) not in ("batch", "experts"):
                return None
    layers, other = split_layers(jax.tree.map(lambda s: _only(s.spec, ("stage", EXPERT)), param_shardings))
    return Manual(layers, other)


def _only(spec: P, axes: tuple[str, ...]) -> P:
    """`spec` with only the mesh axes `axes` kept."""
    kept = [tuple(a for a in dim if a in axes) for dim in entries(spec, len(spec))]
    return P(*(None if not k else k[0] if len(k) == 1 else k for k in kept))


def without_expert(layout: Layout) -> Layout:
    """The layout inside an executor manual over `expert`: no rule names it; the experts'
    kernel exchanges over it (Layout.manual_experts) where the experts were split over it."""
    experts = (EXPERT,) if EXPERT in layout.rules.table("compute").get("experts", ()) else ()
    return dataclasses.replace(layout, rules=layout.rules.without(EXPERT), manual_experts=experts)


def layer_split(config: Config, layout: Layout) -> StageSplit:
    """The layers of each virtual stage (mesh.stage > 1)."""
    return stage_split(config.model, layout.pipeline, layout.mesh.shape["stage"], config.train.seq_len)


def unpipelined(params: Any, layout: Layout, param_shardings: Any, split: StageSplit | None) -> tuple[Any, Layout]:
    """(params, layout) for running the whole model in one program (evaluation, inference):
    the layers in model order (`split`'s padding dropped), gathered from their stages, and a
    layout whose rules shard no "layers" axis (a scan over a stage-sharded stack aborts XLA's
    partitioner). Nothing there clips: the attention reports no logits (optim.qk_clip)."""
    layout = dataclasses.replace(layout, report_logits=False)
    if split is None:
        return params, layout
    whole = jax.tree.map(lambda s: without_axis(s, "stage"), param_shardings)
    params = jax.lax.with_sharding_constraint(in_model_order(params, split), whole)
    return params, dataclasses.replace(layout, rules=layout.rules.with_overrides({"layers": ()}, {"layers": ()}))


def stage_score(loss_fn: LossFn, loss_chunks: int) -> Score:
    """How the last stage scores its hidden states: `loss_fn` of the output, or the built-in
    loss in `loss_chunks` groups of tokens."""
    if loss_chunks > 1:
        return lambda output, hidden, mb: chunked_task_loss(output, hidden, mb, loss_chunks)
    return lambda output, hidden, mb: tuple(loss_fn(output(hidden), mb)[:2])  # a loss's own metrics stay out
