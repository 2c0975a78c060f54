"""Sharded init and the one jitted train step, composed from their parts:

  config --checks--> sizes --layout_for--> Layout (jaxpar.step.layout)
         --the model's abstract parameters--> shardings of params, grads, optimizer state
         (jaxpar.step.zero, jaxpar.step.state)
         --> gradients, summed over data as the GradReduction says (jaxpar.step.reduction):
             jaxpar.step.gradients, the pipeline's (jaxpar.step.pipelined) or a
             compressor's (jaxpar.step.compressed)
         --> the update (jaxpar.step.update) --> jax.jit at the edge, here.

`build(config) -> Trainer`; nothing is allocated until `init()` runs:
    init()              -> TrainState, created directly in its shards (out_shardings)
    step(state, batch)  -> (TrainState, metrics), buffers donated
    grads(params, batch) -> (loss, grads), the step's gradient, for equivalence tests
    step_and_grads(state, batch) -> (TrainState, metrics, grads): one compile for tests
                        that want both (jaxpar.testing)
    evaluate(params, batch) -> (loss sum, weight): the loss without a gradient
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.stages import Wrapped
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError, JaxparWarning
from jaxpar.checks import validate
from jaxpar.config import Config
from jaxpar.data.batch import BatchLayout, batch_fields
from jaxpar.model import declared, has
from jaxpar.pipeline.program import Program
from jaxpar.scan_stacks import set_uninitialised
from jaxpar.pipeline.split import StageSplit, model_order_rows
from jaxpar.pipeline.stages import in_model_order, in_pipeline_order, model_layout_state, stored_shapes
from jaxpar.sharding import Layout, ParamNames, param_names, use_layout
from jaxpar.sharding.adapters import join, split
from jaxpar.step import lora
from jaxpar.step.layout import layout_for
from jaxpar.step.compressed import compressed_gradients, hooked_paths, layer_hooks, weight_of_batch
from jaxpar.step.compression import Compressor, make_compressor
from jaxpar.step.forward import make_forward
from jaxpar.step.gradients import batch_gradients, loss_sum_fn, prepare_batch, prepared_names
from jaxpar.step.loss import LossFn, model_outputs, task_loss
from jaxpar.step.muon import find_matrices
from jaxpar.step.optim import update_rule
from jaxpar.step.param_checks import check_params
from jaxpar.step.pipelined import layer_split, pipelined_grads, unpipelined
from jaxpar.step.reduction import GradReduction, grad_reduction, sum_replicas
from jaxpar.step import diloco
from jaxpar.step.replicas import inner_layout
from jaxpar.step.state import TrainState, cast_floats, initial_state, place_state
from jaxpar.step.update import fuses_multi_output_loops, update_fn
from jaxpar.step.zero import StateShardings, state_shardings
from jaxpar.xla_options import step_options

__all__ = ["OffloadIsANoOp", "Trainer", "TrainState", "build"]


Tree = Any  # a pytree: parameters, gradients, their shardings or names, leaf for leaf
TreeMap = Callable[[Tree], Tree]


def _same(tree: Tree) -> Tree:
    return tree


@dataclasses.dataclass
class Trainer:
    """What `build` returns: the jitted program and what it was derived from. Every function
    is compiled on its first call (or `.lower(...).compile()` ahead of it)."""

    config: Config
    layout: Layout
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule | None
    param_names: Tree  # a jaxpar.sharding.ParamNames for each parameter
    shardings: StateShardings  # parameter-shaped trees: params, grads, optimizer
    state_shardings: TrainState
    batch: BatchLayout  # the step's batch: its fields, shapes and shardings (what data sources take)
    init: Wrapped  # () -> TrainState
    step: Wrapped  # (TrainState, batch) -> (TrainState, metrics)
    grads: Wrapped  # (params, batch) -> (loss, grads)
    step_and_grads: Wrapped  # (TrainState, batch) -> (TrainState, metrics, grads)
    evaluate: Wrapped  # (weights, batch) -> (loss sum, weight): the step's loss, no gradient (held-out data)
    forward: Wrapped  # (weights, batch) -> the model's outputs, the whole model at once (jaxpar.step.forward)
    # A tree as stored (parameters, gradients, a TrainState) -> in the model's layer order,
    # and back. They differ under interleaved pipelining, whose stages hold strided chunks,
    # and where stages hold different numbers of layers, padded to the widest's as they rest
    # (jaxpar.pipeline.split); checkpoints are kept in model order.
    model_order: TreeMap = _same
    pipeline_order: TreeMap = _same
    pipeline: Program | None = None  # the pipeline's program, when mesh.stage > 1
    stage_split: StageSplit | None = None  # the layers of each virtual stage, when mesh.stage > 1
    # (float32 weights in model order, e.g. imported: jaxpar.hf) -> the TrainState at step 0
    # (its arguments donated).
    start_from: Wrapped | None = None
    compiler_options: dict = dataclasses.field(default_factory=dict)  # jaxpar.xla_options.step_options
    reduction: GradReduction = GradReduction()  # how the gradient is summed over data (jaxpar.step.reduction)
    init_compression: Wrapped | None = None  # () -> the compression state's start, in its shardings
    # LoRA (jaxpar.step.lora): the adapted weights by path, and the shardings of their frozen
    # base (TrainState.frozen); None without adapters.
    lora_targets: dict[str, lora.Target] | None = None
    frozen_shardings: Tree | None = None
    # Programs made from this trainer when first asked for (sampling's steps: jaxpar.generate.sample),
    # kept so that later calls reuse their compiles.
    derived: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def mesh(self):
        return self.layout.mesh

    @property
    def compressor(self) -> Compressor | None:
        """parallel.compression.method's compressor (jaxpar.step.compression), None without one."""
        return self.reduction.compressor

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: for AOT lowering without allocating anything."""
        shapes = jax.eval_shape(self.init)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings)

    def model_order_state(self) -> TrainState:
        """`abstract_state()` as checkpoints and imports hold it: the stacked layers in model
        order; where stages differ in size, unpadded and in a layout of their own
        (jaxpar.pipeline.stages.model_layout_state)."""
        state, split = self.abstract_state(), self.stage_split
        return state if split is None or split.even else model_layout_state(state, split)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        return self.batch.abstract()

    def master_params(self, state: TrainState) -> Any:
        """The float32 weights, whichever field holds them (with LoRA: the trained ones;
        under DiLoCo the anchor, the weights of the last synchronisation)."""
        if state.outer is not None:
            return state.outer.anchor
        return state.params if state.master is None else state.master

    def weights(self, state: TrainState) -> Any:
        """What the model reads: the parameters, with LoRA's frozen weights joined in
        (`evaluate`, sampling, inference take this tree); under DiLoCo the anchor's."""
        if state.outer is not None:
            return cast_floats(state.outer.anchor, self.config.train.compute_dtype)
        return join(state.params, state.frozen)

    def master_weights(self, state: TrainState) -> Any:
        """`master_params` with LoRA's frozen weights joined in: the tree `start_from` takes."""
        return join(self.master_params(state), state.frozen)

    @property
    def weight_shardings(self) -> Any:
        """The shardings of `weights(state)`."""
        return join(self.state_shardings.params, self.frozen_shardings)


def data_loss(config: Config) -> LossFn:
    """The loss a config's data calls for: DPO for preference pairs, the task's own with each
    source's beside it for a mixture, else the task's own."""
    if config.data.source == "preference":
        from jaxpar.step.preference import dpo_loss

        return dpo_loss(config.train.dpo_beta)
    if config.data.source == "mix" and config.model.task == "lm":  # each source's loss beside the whole's
        from jaxpar.data.mixing import parse_mix
        from jaxpar.step.loss import by_source

        return by_source(tuple(e.name for e in parse_mix(config.data.mix)))
    return task_loss


def build(
    config: Config,
    devices: Sequence[jax.Device] | None = None,
    tx: optax.GradientTransformation | None = None,
    lr_schedule: optax.Schedule | None = None,
    loss_fn: LossFn | None = None,
) -> Trainer:
    """Everything checked and every sharding derived before the first compile.

    `tx` replaces the optimizer the config describes (give its `lr_schedule` too for the
    learning_rate metric); `loss_fn(outputs, batch) -> (loss sum, weight)` replaces the
    loss the data calls for: the task's cross-entropy (jaxpar.step.loss), or DPO on
    preference pairs (jaxpar.step.preference, train.dpo_beta)."""
    loss_fn = data_loss(config) if loss_fn is None else loss_fn
    devices = list(jax.devices() if devices is None else devices)
    sizes = validate(config, len(devices), devices[0].platform)  # the whole jaxpar.checks catalogue
    options = step_options(config, devices[0].platform)
    warn_if_offload_is_a_no_op(config, devices)
    layout = layout_for(config, devices, sizes)
    if config.train.loss_chunks > 1 and loss_fn is not task_loss:
        whose = "DPO's (data.source=preference)" if config.data.source == "preference" else "build()'s own loss_fn"
        raise ConfigError(f"train.loss_chunks={config.train.loss_chunks} splits the built-in loss, but this run's loss is "
                          f"{whose}, which scores whole outputs; set train.loss_chunks=1")
    clip_norm = 0.0  # a tx given here clips as it likes
    def base_model() -> nnx.Module:
        with nnx.use_eager_sharding(False):  # shardings come from our rules, not from a global mesh
            return config.model.build(nnx.Rngs(config.train.seed))

    targets = lora.plan(nnx.state(nnx.eval_shape(base_model)), config.lora, declared(config.model, "axis_names")) \
        if config.lora.rank > 0 else None

    def make_model() -> nnx.Module:
        model = base_model()
        return lora.adapt(model, targets, config.lora, config.train.seed) if targets else model

    graphdef, abstract = nnx.split(nnx.eval_shape(make_model))
    pipelined = layout.mesh.shape["stage"] > 1
    layers = layer_split(config, layout) if pipelined else None
    names, abstract_params = param_names(abstract), nnx.to_pure_dict(abstract)
    if pipelined:  # as the stack rests: in pipeline order, each stage's rows padded to the widest's
        abstract_params = stored_shapes(abstract_params, layers)
    check_params(names, abstract_params, layout, config.parallel.rules)
    frozen = lora.frozen_paths(abstract)  # LoRA's base: out of the gradient, the master and the optimizer
    (names, frozen_names), (abstract_params, frozen_abstract) = (split(t, frozen) for t in (names, abstract_params))
    shardings = state_shardings(names, abstract_params, layout)
    if tx is None:
        held = ("data",) if layout.diloco.inner_steps else ()  # DiLoCo's groups: the update is vmapped over data
        matrices = find_matrices(config.model, names, shardings.optimizer, held) if config.optim.name == "muon" else None
        tx, lr_schedule = update_rule(config.optim, config.train.steps, matrices)
        clip_norm = config.optim.clip_norm
    tx = _train_params_only(tx, abstract, frozen)
    frozen_shardings = state_shardings(frozen_names, frozen_abstract, layout).params \
        if frozen else None
    compressor = make_compressor(layout.compression, names, abstract_params, shardings.grads, layout.mesh,
                                 config.train.seed)
    reduction = grad_reduction(layout, compressor)
    mixed = jnp.dtype(config.train.compute_dtype) != jnp.float32
    placement = place_state(tx, abstract_params, shardings, layout.mesh, mixed, layout.zero.offload_optimizer,
                            compressor.shardings() if compressor else None, frozen_shardings, layout.zero.offload_params)
    fields = batch_fields(config.model, config.train.seq_len, config.data)
    batch_layout = BatchLayout(fields, config.train.global_batch,
                               {k: layout.sharding(f.names, "compute") for k, f in fields.items()},
                               model_fields=has(config.model, "batch_fields"))
    def start_from(weights: Any) -> TrainState:
        """From the float32 weights in model order (LoRA's frozen ones included)."""
        if pipelined:  # each stage's chunks contiguous, so `stage` shards them to it
            weights = in_pipeline_order(weights, layers)
        master, frozen_weights = split(weights, frozen)
        return initial_state(master, tx, config.train.compute_dtype, compressor.init() if compressor else None,
                             lora.quantize_bases(frozen_weights) if frozen_weights else None)

    def init() -> TrainState:
        return start_from(nnx.to_pure_dict(nnx.state(make_model())))

    groups = layout.diloco.inner_steps > 0  # DiLoCo: each data replica a group (jaxpar.step.diloco)
    if groups:  # a group's gradient, as one replica's: data out of its rules, nothing reduced over data
        reduction = GradReduction("backward")
    loss_sum, grads_fn, program, reduction = _gradients(config, inner_layout(layout) if groups else layout, graphdef,
                                                        abstract_params, names, shardings, batch_layout, loss_fn,
                                                        reduction)
    compressor, task = reduction.compressor, config.model.task
    update = update_fn(tx, lr_schedule, clip_norm, shardings, placement, config.train.compute_dtype,
                       layout.zero.offload_optimizer, config.model,
                       fused=fuses_multi_output_loops(devices[0].platform),
                       model_layers=functools.partial(model_order_rows, split=layers) if pipelined else None,
                       qk_clip=config.optim.qk_clip, offload_params=layout.zero.offload_params)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict, Any]:
        batch = prepare_batch(batch, layout, task)
        loss, sums, grad, compression = grads_fn(state.params, batch, state.compression, state.frozen)
        return (*update(state, loss, sums, grad, compression), grad.value())

    def grads(params, batch, frozen=None) -> tuple[jax.Array, Any]:
        """Under compression, from a fresh compression state (no residuals yet)."""
        batch = prepare_batch(batch, layout, task)
        loss, _, g, _ = grads_fn(params, batch, compressor.init() if compressor else None, frozen)
        return loss, g.value()

    weight_shardings = join(placement.resting.params, frozen_shardings)  # in host memory under offload_params

    def evaluate(weights, batch) -> tuple[jax.Array, jax.Array]:
        """The loss without the pipeline schedule: the whole model at once (`weights`:
        Trainer.weights(state))."""
        params, flat = unpipelined(weights, layout, weight_shardings, layers)
        with use_layout(flat):
            total, (weight, _) = loss_sum(params, prepare_batch(batch, flat, task))
        return total, weight

    jit = _jit_at_the_edge(placement.resting, shardings, weight_shardings, batch_layout.shardings, options)
    trainer = Trainer(
        config=config, layout=layout, graphdef=graphdef, tx=tx, lr_schedule=lr_schedule, param_names=names,
        shardings=shardings, state_shardings=placement.resting, batch=batch_layout,
        init=jax.jit(init, out_shardings=placement.resting),
        step=jit["step"](lambda state, batch: step(state, batch)[:2]),
        step_and_grads=jit["step_and_grads"](step),
        grads=jit["grads"](grads),
        evaluate=jit["evaluate"](evaluate),
        forward=make_forward(task, graphdef, lambda weights: unpipelined(weights, layout, weight_shardings, layers),
                             weight_shardings, batch_layout.shardings),
        model_order=(lambda tree: in_model_order(tree, layers)) if pipelined else _same,
        pipeline_order=(lambda tree: in_pipeline_order(tree, layers)) if pipelined else _same,
        pipeline=program, stage_split=layers,
        # donated where the state can reuse the weights' buffers: not padded into more rows
        start_from=jax.jit(start_from, out_shardings=placement.resting,
                           donate_argnums=() if pipelined and not layers.even else 0),
        compiler_options=options,
        reduction=reduction,
        init_compression=jax.jit(compressor.init, out_shardings=compressor.shardings()) if compressor else None,
        lora_targets=targets, frozen_shardings=frozen_shardings,
    )
    # how scans lower from here on (jaxpar.scan_stacks): set once the build can no longer fail
    set_uninitialised(config.compiler.uninitialised_stacks)
    if not groups:
        return trainer
    outer = diloco.OuterStep.build(layout.diloco, names, abstract_params, shardings.optimizer, layout.mesh)
    parts = diloco.Groups(grads_fn, update, outer, layout, prepared_names(batch_layout.names, task),
                          lambda batch: prepare_batch(batch, layout, task), shardings, config.train.compute_dtype)
    return diloco.attach(trainer, parts, start_from, init, batch_layout.shardings, options)


def _gradients(config: Config, layout: Layout, graphdef: nnx.GraphDef, abstract_params: Any, names: Any,
               shardings: StateShardings, batch: BatchLayout, loss_fn: LossFn, reduction: GradReduction):
    """(the loss sum, the step's GradientPath (jaxpar.step.gradients), the pipeline's
    program or None, `reduction` (its compressor knowing which parameters it averages layer
    by layer)). One branch a reduction (jaxpar.step.reduction); every path takes the batch
    `prepare_batch` made, once, in the step."""
    batch_names = prepared_names(batch.names, config.model.task)
    if reduction.when == "compressed":  # refused in pipeline stages: no program
        loss_sum, grads, reduction = _compressed(config, layout, graphdef, abstract_params, names, shardings, batch,
                                                 batch_names, loss_fn, reduction)
        return loss_sum, grads, None, reduction
    loss_sum = loss_sum_fn(graphdef, loss_fn, declared(config.model, "remat"), loss_chunks=config.train.loss_chunks)
    if layout.mesh.shape["stage"] > 1:
        reduce = sum_replicas(reduction, layout)
        grads, program = pipelined_grads(config, layout, graphdef, batch_names, lambda g: reduce(g, shardings.optimizer),
                                         loss_fn, shardings.params)
        return loss_sum, grads, program, reduction
    return (loss_sum, batch_gradients(loss_sum, layout, shardings, batch_names, layout.microbatches, reduction), None,
            reduction)


def _compressed(config: Config, layout: Layout, graphdef: nnx.GraphDef, abstract_params: Any, names: Any,
                shardings: StateShardings, batch: BatchLayout, batch_names: dict[str, tuple], loss_fn: LossFn,
                reduction: GradReduction):
    """(the loss, the compressed step's gradient function, the reduction whose compressor
    knows which parameters it averages layer by layer): those the model's layer scan runs
    once, where the loss's weight can be read off the batch before the backward pass
    (jaxpar.step.compressed). `batch_names`: the prepared batch's (prepared_names)."""
    paths = {jax.tree_util.keystr(k, simple=True, separator="."): n.names
             for k, n in jax.tree_util.tree_flatten_with_path(names, is_leaf=lambda x: isinstance(x, ParamNames))[0]}
    hooks = layer_hooks(reduction.compressor, paths)
    loss_sum = loss_sum_fn(graphdef, loss_fn, declared(config.model, "remat"), hooks, config.train.loss_chunks)
    example = {k: jax.ShapeDtypeStruct(s, batch.fields[k].dtype) for k, s in batch.shapes.items()}
    outputs = jax.eval_shape(lambda p, b: model_outputs(nnx.merge(graphdef, p), b), abstract_params, example)
    weight_of = weight_of_batch(loss_fn, outputs, example)
    per_layer = hooked_paths(loss_sum, hooks, abstract_params, example) if weight_of is not None else frozenset()
    compressor = dataclasses.replace(reduction.compressor, per_layer=per_layer)
    averaged = compressed_gradients(loss_sum, layout, shardings, batch_names, layout.microbatches, compressor,
                                    weight_of)

    def grads(params, batch, compression, frozen):  # LoRA is refused with compression (jaxpar.checks)
        loss, sums, g, compression = averaged(params, batch, compression, frozen)
        g = g._replace(summed=jax.lax.with_sharding_constraint(g.summed, shardings.optimizer))
        return loss, sums, g, compression

    return loss_sum, grads, dataclasses.replace(reduction, compressor=compressor)


def _jit_at_the_edge(state: TrainState, shardings: StateShardings, weights: Any, batch: dict, options: dict) -> dict:
    """The jit wrappers of the Trainer's functions: shardings in and out, the state donated."""
    replicated = NamedSharding(state.step.mesh, P())
    compiler = options or None
    return {
        "step": lambda f: jax.jit(f, in_shardings=(state, batch), out_shardings=(state, replicated), donate_argnums=0,
                                  compiler_options=compiler),
        "step_and_grads": lambda f: jax.jit(f, in_shardings=(state, batch),
                                            out_shardings=(state, replicated, shardings.optimizer),
                                            donate_argnums=0, compiler_options=compiler),
        "grads": lambda f: jax.jit(f, in_shardings=(state.params, batch, *([state.frozen] if state.frozen else [])),
                                   out_shardings=(replicated, shardings.optimizer), compiler_options=compiler),
        "evaluate": lambda f: jax.jit(f, in_shardings=(weights, batch), out_shardings=(replicated, replicated)),
    }


def _train_params_only(tx: optax.GradientTransformation, abstract: nnx.State, frozen: frozenset
                       ) -> optax.GradientTransformation:
    """`tx` on the nnx.Params; other variables (an MoE router's balancing bias) are left to
    their own rules: the optimizer changes them by zero (no weight decay creeps in). LoRA's
    `frozen` weights are not the optimizer's at all."""
    fixed = split(nnx.to_pure_dict(
        jax.tree.map(lambda v: not isinstance(v, nnx.Param), abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    ), frozen)[0]
    if not any(jax.tree.leaves(fixed)):
        return tx
    # Zeroed after `tx` rather than routed around it, so the optimizer state keeps the
    # parameters' tree (its shardings are derived leaf by leaf).
    return optax.chain(tx, optax.masked(optax.set_to_zero(), fixed))


def warn_if_offload_is_a_no_op(config: Config, devices: Sequence[jax.Device]) -> None:
    """Memory kinds compile on the CPU backend but place nothing elsewhere: say so."""
    asked = [k for k, v in offload_requests(config).items() if v]
    if asked and devices[0].platform == "cpu":
        warnings.warn(
            f"{', '.join(asked)}: the cpu backend has no separate host memory, so offloaded buffers stay "
            "where they are; the program is correct but saves no device memory (run on a GPU to offload)",
            OffloadIsANoOp,
            stacklevel=3,
        )


class OffloadIsANoOp(JaxparWarning):
    """Host offload was asked for on a backend where host and device memory are one."""


def offload_requests(config: Config) -> dict[str, bool]:
    return {
        "model.remat=offload": declared(config.model, "remat") == "offload",
        "parallel.zero.offload_optimizer": config.parallel.zero.offload_optimizer,
        "parallel.zero.offload_params": config.parallel.zero.offload_params,
    }
