"""Sharded init and the one jitted train step.

  build(config) -> Trainer: validates, makes the mesh and layout, derives every sharding
  from the model's annotations (nothing is allocated), and jits
    init()              -> TrainState, created directly in its shards (out_shardings)
    step(state, batch)  -> (TrainState, metrics), buffers donated
    grads(params, batch) -> (loss, grads), the step's gradient, for equivalence tests
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import Config, validate
from jaxpar.data.batch import FIELDS, batch_shapes
from jaxpar.mesh import make_mesh
from jaxpar.sharding import Layout, default_rules, param_names, parse_table, shardings_for, use_layout
from jaxpar.train.loss import model_loss
from jaxpar.train.optim import make_optimizer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array
    params: Any  # pure dict of float32 arrays (master weights)
    opt_state: Any


@dataclasses.dataclass
class Trainer:
    config: Config
    layout: Layout
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    param_names: Any
    state_shardings: TrainState
    batch_shardings: dict[str, NamedSharding]
    batch_shapes: dict[str, tuple[int, ...]]
    init: Any  # () -> TrainState
    step: Any  # (TrainState, batch) -> (TrainState, metrics)
    grads: Any  # (params, batch) -> (loss, grads)

    @property
    def mesh(self):
        return self.layout.mesh

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: for AOT lowering without allocating anything."""
        shapes = jax.eval_shape(self.init)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        task = FIELDS[self.config.model.task]
        return {
            k: jax.ShapeDtypeStruct(self.batch_shapes[k], task[k][1], sharding=self.batch_shardings[k]) for k in task
        }


def build(
    config: Config,
    devices: Sequence[jax.Device] | None = None,
    tx: optax.GradientTransformation | None = None,
    lr_schedule: optax.Schedule | None = None,
) -> Trainer:
    """Everything checked and every sharding derived before the first compile."""
    devices = list(jax.devices() if devices is None else devices)
    validate(config, len(devices))
    mesh = make_mesh(config.mesh, devices)
    rules = default_rules(mesh.shape, config.parallel.sequence_parallel).with_overrides(
        storage=parse_table(config.parallel.storage_rules, "parallel.storage_rules"),
        compute=parse_table(config.parallel.compute_rules, "parallel.compute_rules"),
    )
    layout = Layout(mesh, rules)
    if tx is None:
        tx, lr_schedule = make_optimizer(config.optim, config.train.steps)
    lr_schedule = lr_schedule or (lambda step: jnp.zeros((), jnp.float32))

    def make_model() -> nnx.Module:
        with nnx.use_eager_sharding(False):  # shardings come from our rules, not from a global mesh
            return config.model.build(nnx.Rngs(config.train.seed))

    graphdef, abstract = nnx.split(nnx.eval_shape(make_model))
    names = param_names(abstract)
    param_shardings = shardings_for(names, nnx.to_pure_dict(abstract), layout, "storage")
    replicated = NamedSharding(mesh, P())
    abstract_params = nnx.to_pure_dict(abstract)
    # State that mirrors a parameter (Adam moments) is sharded like it; anything else
    # (counts, adafactor's factored rows and columns) is replicated.
    opt_shardings = optax.tree_map_params(
        tx,
        lambda leaf, sharding, param: sharding if leaf.shape == param.shape else replicated,
        jax.eval_shape(tx.init, abstract_params),
        param_shardings,
        abstract_params,
        transform_non_params=lambda _: replicated,
    )
    state_shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)

    task = config.model.task
    shapes = batch_shapes(task, config.train.global_batch, config.train.seq_len, getattr(config.model, "in_features", 0))
    batch_shardings = {k: layout.sharding(names_, "compute") for k, (names_, _) in FIELDS[task].items()}
    compute_dtype = jnp.dtype(config.train.compute_dtype)
    microbatches = config.train.microbatches

    def init() -> TrainState:
        params = nnx.to_pure_dict(nnx.state(make_model()))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    def loss_sum(params, batch) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, _cast_floats(params, compute_dtype))
        return model_loss(model, batch)

    def normalised_grads(params, batch) -> tuple[jax.Array, Any]:
        """Gradient of (sum of per-token losses over the global batch) / (its token count),
        accumulated over microbatches; gradients kept in their storage sharding."""
        with use_layout(layout):
            grad_fn = jax.value_and_grad(loss_sum, has_aux=True)
            if microbatches == 1:
                (total, weight), grads = grad_fn(params, batch)
                grads = jax.lax.with_sharding_constraint(grads, param_shardings)
            else:
                micro = {k: _split_microbatches(v, microbatches, FIELDS[task][k][0], layout) for k, v in batch.items()}

                def accumulate(carry, mb):
                    g_acc, l_acc, w_acc = carry
                    (l, w), g = grad_fn(params, mb)
                    g_acc = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, g_acc, g), param_shardings)
                    return (g_acc, l_acc + l, w_acc + w), None

                zeros = jax.tree.map(jnp.zeros_like, params)
                zero = jnp.zeros((), jnp.float32)
                (grads, total, weight), _ = jax.lax.scan(accumulate, (zeros, zero, zero), micro)
        return total / weight, jax.tree.map(lambda g: g / weight, grads)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        loss, grads = normalised_grads(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": jnp.asarray(lr_schedule(state.step), jnp.float32),
        }
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return Trainer(
        config=config,
        layout=layout,
        graphdef=graphdef,
        tx=tx,
        lr_schedule=lr_schedule,
        param_names=names,
        state_shardings=state_shardings,
        batch_shardings=batch_shardings,
        batch_shapes=shapes,
        init=jax.jit(init, out_shardings=state_shardings),
        step=jax.jit(
            step,
            in_shardings=(state_shardings, batch_shardings),
            out_shardings=(state_shardings, replicated),
            donate_argnums=0,
        ),
        grads=jax.jit(
            normalised_grads,
            in_shardings=(param_shardings, batch_shardings),
            out_shardings=(replicated, param_shardings),
        ),
    )


def _cast_floats(tree: Any, dtype: jnp.dtype) -> Any:
    """Cast float leaves for compute, on their shards (so FSDP gathers move `dtype` bytes)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _split_microbatches(x: jax.Array, m: int, names: tuple, layout: Layout) -> jax.Array:
    """[B, ...] -> [m, B/m, ...] taking rows i, i+m, i+2m, ... into microbatch i, so each
    device's rows split evenly across microbatches and nothing moves between devices."""
    b = x.shape[0]
    x = x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(x, layout.sharding((None, *names), "compute"))
