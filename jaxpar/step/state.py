"""What a step reads and writes, and where each part of it rests between steps."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.transforms import MaskedNode

from jaxpar.step.zero import StateShardings


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
    # Gradient compression's error-feedback residuals and factors
    # (jaxpar.step.compression.CompressionState); None without compression.
    compression: Any = None
    # LoRA's frozen base weights (jaxpar.step.lora), compute dtype, parameter sharding: the
    # forward pass reads them beside `params`; nothing differentiates or updates them. None
    # without adapters.
    frozen: Any = None
    # DiLoCo's outer state (jaxpar.step.diloco.Outer); None without. Under DiLoCo params,
    # master and opt_state hold one copy per group, stacked on a leading axis over `data`.
    outer: Any = None


@dataclasses.dataclass(frozen=True)
class StatePlacement:
    """`resting`: the TrainState's shardings at the jit boundary (offloaded optimizer state in
    pinned host memory); `working`: where the update needs it (all on the device)."""

    resting: TrainState
    working: TrainState


def place_state(tx: optax.GradientTransformation, abstract_params: Any, shardings: StateShardings, mesh,
                mixed: bool, offload: bool, compression: Any = None, frozen: Any = None,
                offload_params: bool = False) -> StatePlacement:
    """Shardings of every part of the state. Optimizer state that mirrors a parameter (Adam
    moments) is sharded like it; anything else (counts, adafactor's factored rows and
    columns) is replicated. `offload`: the master and optimizer state rest in pinned host
    memory; `offload_params`: the parameters and the master do. `compression`: the
    compression state's shardings, if any; `frozen`: LoRA's frozen weights' (never
    offloaded: every step reads them)."""
    replicated = NamedSharding(mesh, P())
    masked = lambda x: isinstance(x, MaskedNode)  # noqa: E731 (a parameter another transform of a partition has)

    def like(leaf, sharding: NamedSharding, param) -> Any:
        return leaf if masked(leaf) else sharding if leaf.shape == param.shape else replicated

    opt = optax.tree_map_params(tx, like, jax.eval_shape(tx.init, abstract_params), shardings.optimizer,
                                abstract_params, transform_non_params=lambda _: replicated, is_leaf=masked)

    def on_host(tree: Any, offloaded: bool) -> Any:
        return jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), tree) if offloaded else tree

    master = shardings.optimizer if mixed else None
    return StatePlacement(
        resting=TrainState(replicated, on_host(shardings.params, offload_params),
                           on_host(master, offload or offload_params) if mixed else None, on_host(opt, offload),
                           compression, frozen),
        working=TrainState(replicated, shardings.params, master, opt, compression, frozen),
    )


def initial_state(master: Any, tx: optax.GradientTransformation, compute_dtype: Any, compression: Any = None,
                  frozen: Any = None) -> TrainState:
    """Step 0 from the float32 weights (and the compression state's start, LoRA's frozen
    weights, if any: those kept in the compute dtype only)."""
    mixed = jnp.dtype(compute_dtype) != jnp.float32
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=cast_floats(master, compute_dtype),
        master=master if mixed else None,
        opt_state=tx.init(master),
        compression=compression,
        frozen=None if frozen is None else cast_floats(frozen, compute_dtype),
    )


def to_device(tree: Any, shardings: Any) -> Any:
    """Fetch offloaded state to device memory for the update."""
    return None if tree is None else jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind("device")), tree, shardings)


def on_device(grads: Any, layout: Any) -> Any:
    """Gradients of parameters resting in host memory (parallel.zero.offload_params) arrive
    there, layer by layer in the backward pass: back to the device for their reduction."""
    return jax.device_put(grads, jax.memory.Space.Device) if layout.params.from_host else grads


def cast_floats(tree: Any, dtype: Any) -> Any:
    """Cast float leaves for compute, on their shards (so FSDP gathers move `dtype` bytes);
    FP8 ones (LoRA's base at lora.base_dtype=fp8) rest so on purpose and stay."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > 1
                        else x, tree)
