"""Sharded init and the one jitted train step, composed from their parts:

  config --checks--> sizes --layout_for--> Layout (jaxpar.sharding.from_config)
         --the model's abstract parameters--> shardings of params, grads, optimizer state
         (jaxpar.train.zero, jaxpar.train.state)
         --> gradients (jaxpar.train.gradients, or the pipeline's: jaxpar.train.pipelined)
         --> averaged over data by a compressor, if one is asked for (jaxpar.train.compression)
         --> the update (jaxpar.train.update) --> jax.jit at the edge, here.

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
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.errors import JaxparWarning
from jaxpar.checks import validate
from jaxpar.config import Config
from jaxpar.data.batch import Field, batch_fields, batch_shapes
from jaxpar.model import declared
from jaxpar.pipeline.stages import in_model_order, in_pipeline_order
from jaxpar.sharding import Layout, param_names, use_layout
from jaxpar.sharding.from_config import layout_for
from jaxpar.train.compressed import compressed_gradients, hooked_paths, layer_hooks, weight_of_batch
from jaxpar.train.compression import Compressor, make_compressor
from jaxpar.train.gradients import batch_gradients, loss_sum_fn, replica_reducer, uses_replicas
from jaxpar.train.loss import LossFn, model_outputs, task_loss
from jaxpar.train.optim import make_optimizer
from jaxpar.train.param_checks import check_params
from jaxpar.train.pipelined import pipelined_grads, unpipelined
from jaxpar.train.state import TrainState, initial_state, place_state
from jaxpar.train.update import update_fn
from jaxpar.train.zero import StateShardings, state_shardings
from jaxpar.xla_options import step_options

__all__ = ["OffloadIsANoOp", "Trainer", "TrainState", "build"]


@dataclasses.dataclass
class Trainer:
    config: Config
    layout: Layout
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule | None
    param_names: Any
    shardings: StateShardings  # parameter-shaped trees: params, grads, optimizer
    state_shardings: TrainState
    batch_fields: dict[str, Field]
    batch_shardings: dict[str, NamedSharding]
    batch_shapes: dict[str, tuple[int, ...]]
    init: Any  # () -> TrainState
    step: Any  # (TrainState, batch) -> (TrainState, metrics)
    grads: Any  # (params, batch) -> (loss, grads)
    step_and_grads: Any  # (TrainState, batch) -> (TrainState, metrics, grads)
    evaluate: Any  # (params, batch) -> (loss sum, weight): the step's loss, no gradient (held-out data)
    # A tree as stored (parameters, gradients, a TrainState) -> in the model's layer order,
    # and back. They differ only under interleaved pipelining, whose stages hold strided
    # chunks (jaxpar.pipeline.stages); checkpoints are kept in model order.
    model_order: Any = lambda tree: tree
    pipeline_order: Any = lambda tree: tree
    pipeline: Any = None  # the pipeline's jaxpar.pipeline.program.Program, when mesh.stage > 1
    # (float32 weights in model order, e.g. imported: jaxpar.hf) -> the TrainState at step 0
    # (its arguments donated).
    start_from: Any = None
    compiler_options: dict = dataclasses.field(default_factory=dict)  # jaxpar.xla_options.step_options
    # parallel.gradient_compression's compressor (jaxpar.train.compression), None without one
    compressor: Compressor | None = None
    init_compression: Any = None  # () -> the compression state's start, in its shardings

    @property
    def mesh(self):
        return self.layout.mesh

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: for AOT lowering without allocating anything."""
        shapes = jax.eval_shape(self.init)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        return {k: jax.ShapeDtypeStruct(self.batch_shapes[k], f.dtype, sharding=self.batch_shardings[k])
                for k, f in self.batch_fields.items()}

    def master_params(self, state: TrainState) -> Any:
        """The float32 weights, whichever field holds them."""
        return state.params if state.master is None else state.master


def build(
    config: Config,
    devices: Sequence[jax.Device] | None = None,
    tx: optax.GradientTransformation | None = None,
    lr_schedule: optax.Schedule | None = None,
    loss_fn: LossFn = task_loss,
) -> Trainer:
    """Everything checked and every sharding derived before the first compile.

    `tx` replaces the optimizer the config describes (give its `lr_schedule` too for the
    learning_rate metric); `loss_fn(outputs, batch) -> (loss sum, weight)` replaces the
    task's cross-entropy (jaxpar.train.loss)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = validate(config, len(devices), devices[0].platform)  # the whole jaxpar.checks catalogue
    options = step_options(config, devices[0].platform)
    warn_if_offload_is_a_no_op(config, devices)
    layout = layout_for(config, devices, sizes)
    if tx is None:
        tx, lr_schedule = make_optimizer(config.optim, config.train.steps)

    def make_model() -> nnx.Module:
        with nnx.use_eager_sharding(False):  # shardings come from our rules, not from a global mesh
            return config.model.build(nnx.Rngs(config.train.seed))

    graphdef, abstract = nnx.split(nnx.eval_shape(make_model))
    names, abstract_params = param_names(abstract), nnx.to_pure_dict(abstract)
    check_params(config, names, abstract_params, layout)
    tx = _train_params_only(tx, abstract)
    shardings = state_shardings(names, abstract_params, layout, config.parallel.zero_stage)
    compressor = make_compressor(config.parallel, names, abstract_params, shardings.grads, layout.mesh, config.train.seed)
    mixed = jnp.dtype(config.train.compute_dtype) != jnp.float32
    placement = place_state(tx, abstract_params, shardings, layout.mesh, mixed, config.parallel.offload_optimizer,
                            compressor.shardings() if compressor else None)
    fields = batch_fields(config.model, config.train.seq_len, config.data.eos_id)
    batch_shardings = {k: layout.sharding(f.names, "compute") for k, f in fields.items()}
    stages, chunks = layout.mesh.shape["stage"], config.parallel.pipeline_chunks
    pipelined = stages > 1

    def start_from(master: Any) -> TrainState:
        if pipelined:  # each stage's chunks contiguous, so `stage` shards them to it
            master = in_pipeline_order(master, stages, chunks)
        return initial_state(master, tx, config.train.compute_dtype, compressor.init() if compressor else None)

    def init() -> TrainState:
        return start_from(nnx.to_pure_dict(nnx.state(make_model())))

    if compressor is None:
        loss_sum = loss_sum_fn(graphdef, layout, loss_fn, config.model.task, declared(config.model, "remat"))
        grads_fn, program = _gradients(config, layout, graphdef, shardings, fields, loss_sum, loss_fn)
    else:  # compression is refused in pipeline stages: no program
        program, (loss_sum, grads_fn, compressor) = None, _compressed(
            config, layout, graphdef, abstract_params, names, shardings, fields, loss_fn, compressor)
    update = update_fn(tx, lr_schedule, shardings, placement, config.train.compute_dtype,
                       config.parallel.offload_optimizer, config.model)

    def reduced(params, batch, compression) -> tuple[jax.Array, dict, Any, Any]:
        """The step's gradient, averaged over data through the compressor if there is one
        (with the compressor's new state)."""
        if compressor is None:
            return (*grads_fn(params, batch), None)
        loss, sums, grads, compression = grads_fn(params, batch, compression)
        return loss, sums, jax.lax.with_sharding_constraint(grads, shardings.optimizer), compression

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict, Any]:
        loss, sums, grads, compression = reduced(state.params, batch, state.compression)
        return (*update(state, loss, sums, grads, compression), grads)

    def grads(params, batch) -> tuple[jax.Array, Any]:
        """Under compression, from a fresh compression state (no residuals yet)."""
        loss, _, g, _ = reduced(params, batch, compressor.init() if compressor else None)
        return loss, g

    def evaluate(params, batch) -> tuple[jax.Array, jax.Array]:
        """The loss without the pipeline schedule: the whole model at once."""
        params, flat = unpipelined(params, layout, shardings.params, chunks)
        with use_layout(flat):
            total, (weight, _) = loss_sum(params, batch)
        return total, weight

    jit = _jit_at_the_edge(placement.resting, shardings, batch_shardings, options)
    return Trainer(
        config=config, layout=layout, graphdef=graphdef, tx=tx, lr_schedule=lr_schedule, param_names=names,
        shardings=shardings, state_shardings=placement.resting, batch_fields=fields, batch_shardings=batch_shardings,
        batch_shapes=batch_shapes(fields, config.train.global_batch),
        init=jax.jit(init, out_shardings=placement.resting),
        step=jit["step"](lambda state, batch: step(state, batch)[:2]),
        step_and_grads=jit["step_and_grads"](step),
        grads=jit["grads"](grads),
        evaluate=jit["evaluate"](evaluate),
        model_order=(lambda tree: in_model_order(tree, stages, chunks)) if pipelined else (lambda tree: tree),
        pipeline_order=(lambda tree: in_pipeline_order(tree, stages, chunks)) if pipelined else (lambda tree: tree),
        pipeline=program,
        start_from=jax.jit(start_from, out_shardings=placement.resting, donate_argnums=0),
        compiler_options=options,
        compressor=compressor,
        init_compression=jax.jit(compressor.init, out_shardings=compressor.shardings()) if compressor else None,
    )


def _gradients(config: Config, layout: Layout, graphdef: nnx.GraphDef, shardings: StateShardings,
               fields: dict[str, Field], loss_sum, loss_fn: LossFn):
    """(the step's gradient function, the pipeline's program or None)."""
    parallel, train = config.parallel, config.train
    int8 = parallel.int8_gradients
    reduce = replica_reducer(layout, parallel.quantization_block if int8 else 0)
    names = {k: f.names for k, f in fields.items()}
    if layout.mesh.shape["stage"] > 1:
        return pipelined_grads(config, layout, graphdef, names, lambda g: reduce(g, shardings.optimizer), loss_fn)
    replicas = uses_replicas(layout.mesh.shape, train.microbatches, parallel.zero_stage, int8)
    return batch_gradients(loss_sum, layout, shardings, names, train.microbatches, parallel.zero_stage, replicas,
                           reduce, parallel.quantization_block if int8 else 0), None


def _compressed(config: Config, layout: Layout, graphdef: nnx.GraphDef, abstract_params: Any, names: Any,
                shardings: StateShardings, fields: dict[str, Field], loss_fn: LossFn, compressor: Compressor):
    """(the loss, the compressed step's gradient function, the compressor knowing which
    parameters it averages layer by layer): those the model's layer scan runs once, where
    the loss's weight can be read off the batch before the backward pass
    (jaxpar.train.compressed)."""
    paths = {jax.tree_util.keystr(k, simple=True, separator="."): n.names
             for k, n in jax.tree_util.tree_flatten_with_path(names, is_leaf=lambda x: hasattr(x, "names"))[0]}
    hooks = layer_hooks(compressor, paths)
    loss_sum = loss_sum_fn(graphdef, layout, loss_fn, config.model.task, declared(config.model, "remat"), hooks)
    batch = {k: jax.ShapeDtypeStruct(s, fields[k].dtype) for k, s in batch_shapes(fields, config.train.global_batch).items()}
    outputs = jax.eval_shape(lambda p, b: model_outputs(nnx.merge(graphdef, p), b), abstract_params, batch)
    weight_of = weight_of_batch(loss_fn, outputs, batch)
    per_layer = hooked_paths(loss_sum, hooks, abstract_params, batch) if weight_of is not None else frozenset()
    compressor = dataclasses.replace(compressor, per_layer=per_layer)
    field_names = {k: f.names for k, f in fields.items()}
    return loss_sum, compressed_gradients(loss_sum, layout, shardings, field_names, config.train.microbatches,
                                          compressor, weight_of), compressor


def _jit_at_the_edge(state: TrainState, shardings: StateShardings, batch: dict, options: dict) -> dict:
    """The jit wrappers of the Trainer's functions: shardings in and out, the state donated."""
    replicated = NamedSharding(state.step.mesh, P())
    compiler = options or None
    return {
        "step": lambda f: jax.jit(f, in_shardings=(state, batch), out_shardings=(state, replicated), donate_argnums=0,
                                  compiler_options=compiler),
        "step_and_grads": lambda f: jax.jit(f, in_shardings=(state, batch),
                                            out_shardings=(state, replicated, shardings.optimizer),
                                            donate_argnums=0, compiler_options=compiler),
        "grads": lambda f: jax.jit(f, in_shardings=(shardings.params, batch),
                                   out_shardings=(replicated, shardings.optimizer), compiler_options=compiler),
        "evaluate": lambda f: jax.jit(f, in_shardings=(shardings.params, batch), out_shardings=(replicated, replicated)),
    }


def _train_params_only(tx: optax.GradientTransformation, abstract: nnx.State) -> optax.GradientTransformation:
    """`tx` on the nnx.Params; other variables (an MoE router's balancing bias) are left to
    their own rules: the optimizer changes them by zero (no weight decay creeps in)."""
    fixed = nnx.to_pure_dict(
        jax.tree.map(lambda v: not isinstance(v, nnx.Param), abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    )
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
        "parallel.offload_optimizer": config.parallel.offload_optimizer,
    }
