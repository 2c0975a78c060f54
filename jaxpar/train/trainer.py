"""Sharded init and the one jitted train step.

  build(config) -> Trainer: validates, makes the mesh and layout, derives every sharding
  from the model's annotations (nothing is allocated), and jits
    init()              -> TrainState, created directly in its shards (out_shardings)
    step(state, batch)  -> (TrainState, metrics), buffers donated
    grads(params, batch) -> (loss, grads), the step's gradient, for equivalence tests
    step_and_grads(state, batch) -> (TrainState, metrics, grads): one compile for tests
                        that want both (jaxpar.testing)
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

from jaxpar.checks.backend import cudnn_attention_problem
from jaxpar.config import Config, validate
from jaxpar.data.batch import FIELDS, batch_kind, batch_shapes
from jaxpar.mesh import make_mesh
from jaxpar.model import axis_names
from jaxpar.nn import layer_policy
from jaxpar.errors import ConfigError
from jaxpar.kernels.quantized import gathered_axes, quantized_reduce_scatter
from jaxpar.pipeline.stages import in_model_order, in_pipeline_order
from jaxpar.sharding.replicated import replicated_params, report_replicated
from jaxpar.sharding import ContextAttention, Layout, ParamGather, default_rules, param_names, parse_table, use_layout
from jaxpar.train.loss import LossFn, model_loss, task_loss
from jaxpar.train.optim import make_optimizer
from jaxpar.train.microbatches import split_batch
from jaxpar.train.pipelined import pipelined_grads as pipelined_grads_fn
from jaxpar.train.sequence import lay_out_sequences
from jaxpar.train.replicas import per_replica, split_replicas, stacked_over_data, without_data
from jaxpar.train.zero import StateShardings, state_shardings
from jaxpar.xla_options import step_options


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """What a step reads and writes. Under mixed precision `params` are the compute-dtype
    weights the forward pass reads and `master` the float32 weights the optimizer updates
    (the 2 + 4 bytes per parameter of the ZeRO paper); in float32 `master` is None and
    `params` are the master weights."""

    step: jax.Array
    params: Any  # pure dict, compute dtype, parameter sharding
    master: Any  # pure dict, float32, optimizer sharding; None when compute dtype is float32
    opt_state: Any  # optimizer sharding


@dataclasses.dataclass
class Trainer:
    config: Config
    layout: Layout
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    param_names: Any
    shardings: StateShardings  # parameter-shaped trees: params, grads, optimizer
    state_shardings: TrainState
    batch_shardings: dict[str, NamedSharding]
    batch_shapes: dict[str, tuple[int, ...]]
    init: Any  # () -> TrainState
    step: Any  # (TrainState, batch) -> (TrainState, metrics)
    grads: Any  # (params, batch) -> (loss, grads)
    step_and_grads: Any  # (TrainState, batch) -> (TrainState, metrics, grads)
    # A tree as stored (parameters, gradients, a TrainState) -> in the model's layer order,
    # and back. They differ only under interleaved pipelining, whose stages hold strided
    # chunks (jaxpar.pipeline.stages); checkpoints are kept in model order.
    model_order: Any = lambda tree: tree
    pipeline_order: Any = lambda tree: tree
    pipeline: Any = None  # the pipeline's jaxpar.pipeline.program.Program, when mesh.stage > 1
    compiler_options: dict = dataclasses.field(default_factory=dict)  # jaxpar.xla_options.step_options

    @property
    def mesh(self):
        return self.layout.mesh

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: for AOT lowering without allocating anything."""
        shapes = jax.eval_shape(self.init)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        task = FIELDS[batch_kind(self.config.model.task, self.config.data.eos_id)]
        return {
            k: jax.ShapeDtypeStruct(self.batch_shapes[k], task[k][1], sharding=self.batch_shardings[k]) for k in task
        }

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

    `tx` replaces the optimizer the config describes (give `lr_schedule` too, or the
    learning_rate metric reads 0); `loss_fn(outputs, batch) -> (loss sum, weight)` replaces
    the task's cross-entropy (jaxpar.train.loss)."""
    devices = list(jax.devices() if devices is None else devices)
    validate(config, len(devices), devices[0].platform)  # the whole jaxpar.checks catalogue
    options = step_options(config, devices[0].platform)
    exchange = config.parallel.expert_exchange
    if exchange == "auto":
        exchange = "ragged" if devices[0].platform == "gpu" else "padded"
    warn_if_offload_is_a_no_op(config, devices)
    mesh = make_mesh(config.mesh, devices)
    rules = default_rules(mesh.shape, config.parallel.sequence_parallel).with_aliases(axis_names(config.model))
    rules = rules.with_overrides(
        storage=parse_table(config.parallel.storage_rules, "parallel.storage_rules"),
        compute=parse_table(config.parallel.compute_rules, "parallel.compute_rules"),
    )
    parallel = config.parallel
    zero_axes = ("data",) if parallel.zero_stage >= 3 and mesh.shape["data"] > 1 else ()
    layout = Layout(
        mesh,
        rules,
        ParamGather(
            zero_axes=zero_axes,
            hpz=parallel.hpz,
            quantize_block=parallel.quantization_block if parallel.quantized_weights else 0,
        ),
        ContextAttention(parallel.context_impl, parallel.context_layout, parallel.attention_block, parallel.attention_kernel),
        expert_exchange=exchange,
        collective_matmul=parallel.collective_matmul,
        attention=_attention(config, devices[0], mesh.shape["context"], mesh.shape["stage"]),
    )
    if tx is None:
        tx, lr_schedule = make_optimizer(config.optim, config.train.steps)
    lr_schedule = lr_schedule or (lambda step: jnp.zeros((), jnp.float32))

    def make_model() -> nnx.Module:
        with nnx.use_eager_sharding(False):  # shardings come from our rules, not from a global mesh
            return config.model.build(nnx.Rngs(config.train.seed))

    graphdef, abstract = nnx.split(nnx.eval_shape(make_model))
    names = param_names(abstract)
    abstract_params = nnx.to_pure_dict(abstract)
    # Own logical names that no rule knows would rest whole on every device: say so first.
    report_replicated(replicated_params(names, abstract_params, layout), config.parallel.on_replicated)
    tx = _train_params_only(tx, abstract)
    shardings = state_shardings(names, abstract_params, layout, config.parallel.zero_stage)
    if parallel.quantized_weights:
        _check_quantized_gathers(names, abstract_params, layout)
    compute_dtype = jnp.dtype(config.train.compute_dtype)
    mixed = compute_dtype != jnp.float32
    replicated = NamedSharding(mesh, P())
    # State that mirrors a parameter (Adam moments) is sharded like it; anything else
    # (counts, adafactor's factored rows and columns) is replicated.
    opt_shardings = optax.tree_map_params(
        tx,
        lambda leaf, sharding, param: sharding if leaf.shape == param.shape else replicated,
        jax.eval_shape(tx.init, abstract_params),
        shardings.optimizer,
        abstract_params,
        transform_non_params=lambda _: replicated,
    )
    # Offloaded optimizer state rests in pinned host memory between steps: `state_sharding`
    # (the jit boundary) says so; the update fetches it to the device (`device_state`).
    def resting(tree: Any) -> Any:
        host = parallel.offload_optimizer
        return jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), tree) if host else tree

    state_sharding = TrainState(
        step=replicated,
        params=shardings.params,
        master=resting(shardings.optimizer) if mixed else None,
        opt_state=resting(opt_shardings),
    )
    device_state = TrainState(replicated, shardings.params, shardings.optimizer if mixed else None, opt_shardings)

    task = config.model.task
    kind = batch_kind(task, config.data.eos_id)
    shapes = batch_shapes(kind, config.train.global_batch, config.train.seq_len, getattr(config.model, "in_features", 0))
    batch_shardings = {k: layout.sharding(names_, "compute") for k, (names_, _) in FIELDS[kind].items()}
    microbatches = config.train.microbatches
    zero_stage = config.parallel.zero_stage

    stages = mesh.shape["stage"]
    chunks = parallel.pipeline_chunks
    pipelined = stages > 1

    def init() -> TrainState:
        master = nnx.to_pure_dict(nnx.state(make_model()))
        if pipelined:  # each stage's chunks contiguous, so `stage` shards them to it
            master = in_pipeline_order(master, stages, chunks)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=_cast_floats(master, compute_dtype),
            master=master if mixed else None,
            opt_state=tx.init(master),
        )

    def loss_sum(params, batch) -> tuple[jax.Array, tuple[jax.Array, dict]]:
        if task == "lm":
            batch = lay_out_sequences(batch, layout)
        return model_loss(nnx.merge(graphdef, params), batch, loss_fn)

    if getattr(config.model, "remat", "none") == "none":
        # Outside the layer scan too, a gathered parameter (embedding, head) is gathered
        # again for the backward pass rather than kept whole (ZeRO-3: 3x traffic, 1/N
        # memory). Only under "none": an outer checkpoint overrides the layers' own policy.
        loss_sum = jax.checkpoint(loss_sum, policy=layer_policy("none"), prevent_cse=True)

    # Per-replica gradients (jaxpar.train.replicas) where they pay: under hybrid sharding
    # (reduce inside the host first) and to accumulate ZeRO 0-1 microbatches unreduced.
    # Elsewhere each layer's gradient is reduced inside the backward loop, where a GPU can
    # overlap it with the layers still to go.
    # qgZ needs them too: its int8 all-to-all replaces the reduction over data.
    replicas = mesh.shape["data"] > 1 and (
        mesh.shape["fsdp"] > 1 or (microbatches > 1 and zero_stage < 2) or parallel.quantized_gradients
    )

    def reduce_replicas(grads: Any, target: Any) -> Any:
        """Per-replica gradients [data, ...] -> their sum, sharded as `target`: an int8
        all-to-all under qgZ where `target` shards over data, else the partitioner's reduction."""

        def one(g, sharding):
            source = without_data(sharding).spec
            if parallel.quantized_gradients and source != sharding.spec:
                return quantized_reduce_scatter(g, mesh, "data", source, sharding.spec, parallel.quantization_block)
            return jax.lax.with_sharding_constraint(g.sum(0), sharding)

        return jax.tree.map(one, grads, target)

    def normalised_grads(params, batch) -> tuple[jax.Array, dict, Any]:
        """Gradient of (sum of per-token losses over the global batch) / (its token count),
        accumulated over microbatches in float32, returned in the optimizer's sharding,
        with the loss and the model's other sums over the batch (jaxpar.train.loss).

        Per-replica gradients are reduced over fsdp inside the replica, then over data:
        once per step at ZeRO 0-1 (microbatches accumulate unreduced), once per microbatch
        at ZeRO 2-3 (reduce-scatter into the sharded accumulator).
        """
        grad_fn = jax.value_and_grad(loss_sum, has_aux=True)
        # Without accumulation there is no gradient buffer to keep whole: ZeRO-1
        # reduce-scatters straight to the optimizer's shards, like ZeRO-2.
        reduce_to = shardings.grads if microbatches > 1 else shardings.optimizer
        per_step = replicas and zero_stage < 2  # reduce over data once per step

        def microbatch(mb):
            """(loss sum, (weight, sums), gradient) of one microbatch; the gradient is
            [data, ...] per replica if reduced per step, else reduced to `reduce_to`."""
            if not replicas:
                with use_layout(layout):
                    (l, aux), g = grad_fn(params, mb)
                return l, aux, _cast_floats(jax.lax.with_sharding_constraint(g, reduce_to), jnp.float32)
            mb = {k: split_replicas(v, FIELDS[kind][k][0], layout) for k, v in mb.items()}
            l, aux, g = per_replica(grad_fn, layout, shardings.grads)(params, mb)
            g = _cast_floats(g, jnp.float32)
            if not per_step:
                g = reduce_replicas(g, reduce_to)
            return l.sum(), jax.tree.map(lambda x: x.sum(0), aux), g

        if microbatches == 1:
            total, (weight, sums), grads = microbatch(batch)
        else:
            micro = split_batch(batch, microbatches, kind, layout)
            acc_shardings = jax.tree.map(stacked_over_data, shardings.grads) if per_step else shardings.grads

            def accumulate(carry, mb):
                g_acc, l_acc, aux_acc = carry
                l, aux, g = microbatch(mb)
                g_acc = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, g_acc, g), acc_shardings)
                return (g_acc, l_acc + l, jax.tree.map(jnp.add, aux_acc, aux)), None

            lead = (mesh.shape["data"],) if per_step else ()  # per-replica gradients are stacked
            zeros = jax.tree.map(lambda p, s: jnp.zeros(lead + p.shape, jnp.float32, device=s), params, acc_shardings)
            zero = jnp.zeros((), jnp.float32)
            first = jax.tree.map(lambda x: x[0], micro)
            aux_zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(microbatch, first)[1])
            (grads, total, (weight, sums)), _ = jax.lax.scan(accumulate, (zeros, zero, aux_zeros), micro)
            # Pin the loop's output too: otherwise the optimizer's sharding below is
            # propagated into the carry, which then gathers every microbatch.
            grads = jax.lax.with_sharding_constraint(grads, acc_shardings)
        if per_step:
            grads = reduce_replicas(grads, shardings.optimizer)
        grads = jax.lax.with_sharding_constraint(grads, shardings.optimizer)
        return total / weight, {"weight": weight, **sums}, jax.tree.map(lambda g: g / weight, grads)

    program = None
    if pipelined:
        pipelined_grads, program = pipelined_grads_fn(
            config, layout, graphdef, kind, lambda grads: reduce_replicas(grads, shardings.optimizer), loss_fn
        )

    batch_grads = pipelined_grads if pipelined else normalised_grads

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict, Any]:
        loss, sums, grads = batch_grads(state.params, batch)
        if parallel.offload_optimizer:  # fetch from host memory for the update
            state = dataclasses.replace(
                state,
                master=_to_device(state.master, device_state.master),
                opt_state=_to_device(state.opt_state, device_state.opt_state),
            )
        if mixed:
            master = state.master
        else:  # the float32 parameters are the master weights
            master = jax.lax.with_sharding_constraint(state.params, shardings.optimizer)
        updates, opt_state = tx.update(grads, state.opt_state, master)
        master = optax.apply_updates(master, updates)
        counts = sums.get("counts", {})
        if counts and hasattr(config.model, "update"):  # e.g. MoE bias balancing, from the step's loads
            master = config.model.update(master, counts)
        # A non-finite loss or gradient leaves the state as it was; the loop then stops or
        # skips (train.on_nonfinite), naming the first bad gradient.
        finite_grads = jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
        finite = jnp.isfinite(loss) & jnp.all(finite_grads)
        guard = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        opt_state = guard(opt_state, state.opt_state)
        if mixed:
            master = guard(master, state.master)
        # ZeRO 1-2: each device updated its shard; gathering the new weights is the
        # all-gather half of the step's 2x(N-1)/N traffic.
        params = jax.lax.with_sharding_constraint(_cast_floats(master, compute_dtype), shardings.params)
        if not mixed:  # the old weights are at hand in the parameter sharding: no gather for the guard
            params = guard(params, state.params)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": jnp.asarray(lr_schedule(state.step), jnp.float32),
            "nonfinite": (~finite).astype(jnp.float32),
            # which gradient leaf (in tree order) is the first non-finite one, -1 if none
            "first_nonfinite_grad": jnp.where(jnp.all(finite_grads), -1, jnp.argmin(finite_grads)).astype(jnp.float32),
            "nonfinite_grads": jnp.sum(~finite_grads).astype(jnp.float32),
            **{k: v / sums["weight"] for k, v in sums.get("token_metrics", {}).items()},
            **(config.model.summarise(counts) if counts and hasattr(config.model, "summarise") else {}),
        }
        # A step not applied does not count: the schedule (state.step, and the optimizer's own
        # count) stays where the weights are.
        new = TrainState(step=jnp.where(finite, state.step + 1, state.step), params=params,
                         master=master if mixed else None, opt_state=opt_state)
        return new, metrics, grads

    return Trainer(
        config=config,
        layout=layout,
        graphdef=graphdef,
        tx=tx,
        lr_schedule=lr_schedule,
        param_names=names,
        shardings=shardings,
        state_shardings=state_sharding,
        batch_shardings=batch_shardings,
        batch_shapes=shapes,
        init=jax.jit(init, out_shardings=state_sharding),
        step=jax.jit(
            lambda state, batch: step(state, batch)[:2],
            in_shardings=(state_sharding, batch_shardings),
            out_shardings=(state_sharding, replicated),
            donate_argnums=0,
            compiler_options=options or None,
        ),
        step_and_grads=jax.jit(
            step,
            in_shardings=(state_sharding, batch_shardings),
            out_shardings=(state_sharding, replicated, shardings.optimizer),
            donate_argnums=0,
            compiler_options=options or None,
        ),
        grads=jax.jit(
            lambda params, batch: _without_sums(batch_grads(params, batch)),
            in_shardings=(shardings.params, batch_shardings),
            out_shardings=(replicated, shardings.optimizer),
            compiler_options=options or None,
        ),
        model_order=(lambda tree: in_model_order(tree, stages, chunks)) if pipelined else (lambda tree: tree),
        pipeline_order=(lambda tree: in_pipeline_order(tree, stages, chunks)) if pipelined else (lambda tree: tree),
        pipeline=program,
        compiler_options=options,
    )


def _attention(config: Config, device: jax.Device, context: int = 1, stage: int = 1) -> str:
    """parallel.attention with auto resolved: cuDNN's fused attention where it applies (a
    sharded sequence runs the context-parallel kernels instead, and needs no choice). Not
    inside pipeline stages: cuDNN attention's custom partitioning fails in their shard_map
    (jaxlib 0.12, compiled for H100s)."""
    choice = config.parallel.attention
    if context > 1:
        return "reference"  # unused: the context kernels run (the checks refuse other choices there)
    if choice != "auto":
        return choice
    usable = stage == 1 and cudnn_attention_problem(config, device.platform, device) is None
    return "cudnn" if usable else "reference"


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


def _without_sums(out: tuple) -> tuple:
    loss, _, grads = out
    return loss, grads


def _to_device(tree: Any, shardings: Any) -> Any:
    return None if tree is None else jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind("device")), tree, shardings)


def _check_quantized_gathers(names: Any, shapes: Any, layout: Layout) -> None:
    """qwZ gathers blocks that must stay contiguous: a parameter's compute axes must lead
    its storage axes on every dimension."""

    def one(path, n: Any, shape: Any) -> None:
        try:
            gathered_axes(layout.param_spec(n.names, shape.shape), layout.rules.spec(n.names, "compute"), len(shape.shape))
        except ValueError as e:
            raise ConfigError(
                f"parallel.quantized_weights: parameter {jax.tree_util.keystr(path)} cannot be gathered in int8: {e}; "
                "order parallel.storage_rules so the compute axes come first"
            ) from None

    jax.tree_util.tree_map_with_path(one, names, shapes, is_leaf=lambda x: hasattr(x, "names"))


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


class OffloadIsANoOp(UserWarning):
    """Host offload was asked for on a backend where host and device memory are one."""


def offload_requests(config: Config) -> dict[str, bool]:
    return {
        "model.remat=offload": getattr(config.model, "remat", "none") == "offload",
        "parallel.offload_optimizer": config.parallel.offload_optimizer,
    }


def _cast_floats(tree: Any, dtype: jnp.dtype) -> Any:
    """Cast float leaves for compute, on their shards (so FSDP gathers move `dtype` bytes)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
