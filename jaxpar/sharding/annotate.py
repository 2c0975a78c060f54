"""Turning logical names into shardings: parameters by their Flax NNX annotations,
activations by `constrain` calls inside the model.

Models only *name* axes; which mesh axes those names land on is the active `Layout`'s
business. The layout is entered once, around tracing of the step (`with use_layout(layout):`), so model
code stays free of meshes and rules, and is the identity when no layout is active.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.custom_batching import custom_vmap
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.specs import (CompressionConfig, ContextConfig, DilocoConfig, PipelineConfig, TensorConfig, ZeroConfig,
                          int8_gradients)
from jaxpar.errors import ConfigError
from jaxpar.kernels.quantized import entries as spec_entries
from jaxpar.kernels.quantized import gathered_axes, quantized_all_gather, quantized_reduce_scatter
from jaxpar.mesh import HostSplit, divisors, mesh_here
from jaxpar.sharding.adapters import LoraWeight, merged
from jaxpar.sharding.rules import Rules

_ACTIVE: contextvars.ContextVar["Layout | None"] = contextvars.ContextVar("jaxpar_layout", default=None)


# The name under which hpZ's secondary parameter shard is saved for the backward pass
# (every remat policy keeps it: jaxpar.nn.layer_policy).
HPZ_NAME = "hpz_secondary"
UNSHARDABLE_NAMES = ("layers",)  # the layer scan slices this dimension: ZeRO never shards it
# The vmap axis name of the per-replica gradient computation (jaxpar.step.replicas) when a
# parameter's gradient is summed over the replicas at its point of use (Layout.replica_sum).
REPLICAS = "replicas"


@dataclasses.dataclass(frozen=True)
class ParamGather:
    """How a stored parameter becomes the value a layer computes with (`compute_value`).

    zero_axes       mesh axes ZeRO-3 adds to parameter storage, on top of the storage rules
    hpz             ZeRO++ hpZ: gather over `zero_axes` first into a secondary copy sharded
                    by the storage rules only (inside a host), saved for the backward pass,
                    whose gather then stays inside the host
    quantize_block  > 0: ZeRO++ qwZ, every gather moves int8 with a scale per this many
                    elements (jaxpar.kernels.quantized)
    repeats         (logical name, times): a dimension of that name is repeated that many
                    times once gathered, each entry in place ([a, b] -> [a, a, b, b]), then
                    split by the compute rules. Grouped-query key/value heads that the
                    tensor split does not divide rest whole and are repeated at use
                    (jaxpar.sharding.rules.kv_heads_repeat); their copies' gradients add up.
    from_host       the parameters rest in pinned host memory (parallel.zero.offload_params):
                    each use first brings its shards to the device, and the gradient goes
                    back the same way
    """

    zero_axes: tuple[str, ...] = ()
    hpz: bool = False
    quantize_block: int = 0
    repeats: tuple[tuple[str, int], ...] = ()
    from_host: bool = False


@dataclasses.dataclass(frozen=True)
class ReplicaSum:
    """How a parameter's gradient is summed over the per-replica vmap's replicas at its point
    of use (`sum_over_replicas`).

    quantize_block  > 0: ZeRO++ qgZ, an int8 all-to-all with a scale per this many elements
                    (jaxpar.kernels.quantized), where the sum lands sharded over the
                    replica axis; 0: the partitioner's reduction in the compute dtype
    """

    quantize_block: int = 0


@dataclasses.dataclass(frozen=True)
class Projections:
    """How the projections (jaxpar.sharding.projections) multiply.

    collective  none | ring | bidirectional: the tensor-parallel projections' sequence
                all-gather and reduce-scatter run as one shard_map collective matmul
                (jaxpar.kernels.collective_matmul) whose ring steps overlap the matmuls
    dtype       compute | fp8: the dtype they multiply in (train.matmul_dtype); the
                experts' matmuls (`expert_matmul`) too
    expert_block  FP8 experts' scale tile along the contraction (train.fp8_expert_block)
    """

    collective: str = "none"
    dtype: str = "compute"
    expert_block: int = 128


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh, the rules that place logical names on it, and one spec for each strategy.

    The strategies' specs are parallel's sections as the config holds them (jaxpar.config:
    `tensor`, `zero`, `compression`, `context`, `pipeline`), so the step, explain, the
    planner and checkpoints read the very fields a user sets. Beside them, what the specs
    resolve to for this mesh and device:

    params: how parameters are gathered at use (from `zero` and the mesh).
    projections: how the projections multiply (`tensor`'s collective matmul, train.matmul_dtype).
    attention: reference | flash | cudnn; attention over an unsharded sequence (`attend`),
    parallel.attention with auto resolved.
    expert_exchange: ragged | padded, how dropless MoE routing moves rows
    (jaxpar.kernels.experts.exchange), parallel.expert_exchange with auto resolved.
    expert_dispatch_dtype: compute | fp8, what the experts' dispatch moves (parallel.expert_dispatch_dtype).
    hosts: how many hosts each mesh axis spans (mesh.hosts): the experts' two-hop exchange reads it.
    replica_axis: set inside the per-replica vmap (jaxpar.step.replicas), whose mapped
    dimension is sharded over this mesh axis; shard_map kernels fold it into the batch.
    replica_sum: inside that vmap at ZeRO 2-3: every parameter's gradient is summed over the
    replicas where `compute_value` gathers it (`sum_over_replicas`), so inside the layer
    scan one layer at a time, rather than held whole per replica until the backward ends
    (None: held per replica).
    microbatches: each step's batch in this many pieces, one after another (train.microbatches).
    manual_experts: inside the pipeline executor when it is manual over the expert-parallel
    axes (jaxpar.step.pipelined): the rules no longer name them, each device holds its own
    experts, and the experts' kernel exchanges tokens over these axes.
    """

    mesh: Mesh
    rules: Rules
    params: ParamGather = ParamGather()
    context: ContextConfig = ContextConfig()
    expert_exchange: str = "padded"
    expert_dispatch_dtype: str = "compute"
    hosts: HostSplit = HostSplit()  # how many hosts each mesh axis spans (mesh.hosts)
    replica_axis: str | None = None
    replica_sum: ReplicaSum | None = None
    projections: Projections = Projections()
    attention: str = "reference"
    tensor: TensorConfig = TensorConfig()
    zero: ZeroConfig = ZeroConfig()
    pipeline: PipelineConfig = PipelineConfig()
    compression: CompressionConfig = CompressionConfig()
    diloco: DilocoConfig = DilocoConfig()
    microbatches: int = 1
    two_batch_overlap: bool = False  # layers run on two halves of the rows (jaxpar.nn.scan_layers)
    manual_experts: tuple[str, ...] = ()
    # optim.qk_clip: each attention reports its largest logit per head (jaxpar.sharding.attend.reports_logits)
    report_logits: bool = False

    @property
    def qgz_block(self) -> int:
        """ZeRO++ qgZ (parallel.zero.quantized_gradients, or compression.method=int8): the
        gradient's reduce-scatter moves int8 with a float32 scale per this many elements; 0: off."""
        return self.zero.quantization_block if int8_gradients(self.zero, self.compression) else 0

    def sharding(self, names: Sequence[str | None], kind: str = "compute") -> NamedSharding:
        return NamedSharding(mesh_here(self.mesh), self.rules.spec(names, kind))

    def param_spec(self, names: Sequence[str | None], shape: Sequence[int]) -> P:
        """Where a parameter rests: the storage rules plus ZeRO-3's axes (`add_axes`)."""
        spec = self.rules.spec(names, "storage")
        return add_axes(spec, shape, names, self.mesh, self.params.zero_axes) if self.params.zero_axes else spec



@contextlib.contextmanager
def use_layout(layout: Layout | None) -> Iterator[Layout | None]:
    """Make `layout` the one `constrain` and `compute_value` apply, for the duration."""
    token = _ACTIVE.set(layout)
    try:
        yield layout
    finally:
        _ACTIVE.reset(token)


def active_layout() -> Layout | None:
    return _ACTIVE.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout to the compute rules of the active layout (no-op without one)."""
    layout = _ACTIVE.get()
    if layout is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of rank {x.ndim}")
    return jax.lax.with_sharding_constraint(x, layout.sharding(names, "compute"))


def logical_names(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The names an NNX variable was annotated with (`nnx.with_partitioning`), or all None."""
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names else (None,) * len(variable.shape)


def stored_value(param: nnx.Variable) -> tuple[jax.Array, tuple[str | None, ...]]:
    """A parameter's value as it rests, and its logical names. Inside `scan_layers` a
    stacked parameter arrives one layer at a time while its names still include the
    stacked axis: the leading surplus names are dropped."""
    value, names = param[...], logical_names(param)
    return value, names[len(names) - value.ndim :]


def compute_value(param: nnx.Variable | LoraWeight) -> jax.Array:
    """A parameter's value laid out for use: FSDP shards are gathered here, at the point of
    use (so inside a scanned layer stack, one layer at a time); tensor shards stay put. A
    weight with a LoRA adapter (jaxpar.sharding.adapters) comes merged: W + scale * A @ B."""
    if isinstance(param, LoraWeight):
        return merged(param, compute_value)
    value, names = stored_value(param)
    layout = _ACTIVE.get()
    if layout is None:
        return value
    return gather_param(value, names, layout)


def gather_param(value: jax.Array, names: Sequence[str | None], layout: Layout) -> jax.Array:
    """Stored shards -> compute layout, the way `layout.params` says (see ParamGather)."""
    how = layout.params
    source = layout.param_spec(names, value.shape)
    if how.from_host:  # in a layer scan, this layer's slice alone; its gradient goes back to the host
        value = jax.device_put(value, jax.memory.Space.Device)
    if layout.replica_sum:
        value = sum_over_replicas(value, names, layout)
    if how.hpz:
        secondary = layout.rules.spec(names, "storage")
        value = checkpoint_name(_reshard(value, source, secondary, layout), HPZ_NAME)
        source = secondary
    value = _reshard(value, source, gather_target(names, layout), layout)
    repeat = repeated_dim(names, how)
    if repeat is None:
        return value
    dim, times = repeat
    # every device holds the whole dimension: it keeps its share of the copies, no traffic
    target = NamedSharding(mesh_here(layout.mesh), layout.rules.spec(names, "compute"))
    return jax.lax.with_sharding_constraint(jnp.repeat(value, times, axis=dim), target)


def repeated_dim(names: Sequence[str | None], how: ParamGather) -> tuple[int, int] | None:
    """(dimension, times) of a parameter's dimension repeated at use (ParamGather.repeats)."""
    times = dict(how.repeats)
    return next(((dim, times[n]) for dim, n in enumerate(names) if n in times), None)


def gather_target(names: Sequence[str | None], layout: Layout) -> P:
    """Where a parameter's gather lands: its compute spec, but a dimension repeated at use
    whole (the compute rules split the repeated copies, which the stored value has not)."""
    spec = layout.rules.spec(names, "compute")
    repeat = repeated_dim(names, layout.params)
    if repeat is None:
        return spec
    held = spec_entries(spec, len(names))
    held[repeat[0]] = ()
    return P(*(None if not e else e[0] if len(e) == 1 else e for e in held))


def sum_over_replicas(value: jax.Array, names: Sequence[str | None], layout: Layout) -> jax.Array:
    """A stored parameter, unchanged, whose gradient is summed over the per-replica vmap's
    replicas right here, at its point of use (inside the layer scan: one layer at a time).

    Under `vmap(..., spmd_axis_name=replica_axis)` each replica's gradient of a parameter
    the replicas share is its own [replica_axis, ...] row, the whole parameter's size (over
    the in-replica axes); kept until the backward pass ends, a replica holds its gradient of
    every layer, 1/fsdp of the model where ZeRO 2-3 promise 1/(data x fsdp). Here the
    gradient is reduce-scattered inside the replica first (the storage rules: over fsdp,
    inside the host), then summed over the replicas (over `replica_axis`) into ZeRO's
    sharding: hybrid sharding's two-level reduction, per layer.

    It returns the replicas' mean, unbatched, as each replica's gradient: the caller's sum
    over replicas (jaxpar.step.replicas) counts an unbatched gradient once per replica, so
    a parameter also used elsewhere (outside `compute_value`) still sums right. Exact when
    the replica count is a power of two."""
    mesh, axis = mesh_here(layout.mesh), layout.replica_axis
    total = add_axes(layout.rules.spec(names, "storage"), value.shape, names, layout.mesh, (axis,))
    inside = P(*(None if not e else e[0] if len(e) == 1 else e
                 for e in ([a for a in held if a != axis] for held in spec_entries(total, value.ndim))))
    scattered = spec_entries(total, value.ndim) != spec_entries(inside, value.ndim)
    block = layout.replica_sum.quantize_block if scattered else 0  # qgZ's sum lands sharded over the replicas
    return _replica_sum(value, NamedSharding(mesh, inside), NamedSharding(mesh, total), axis, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _replica_sum(value, inside, total, axis, block):
    return value


def _replica_sum_fwd(value, inside, total, axis, block):
    return value, None


def _replica_sum_bwd(inside, total, axis, block, _, ct):
    if not jnp.issubdtype(ct.dtype, jnp.inexact):
        return (ct,)
    ct = jax.lax.with_sharding_constraint(ct, inside)  # each replica's: reduced inside it
    if block:  # qgZ
        summed = _int8_replica_sum(ct, inside, total, axis, block)
    else:
        summed = jax.lax.with_sharding_constraint(jax.lax.psum(ct, REPLICAS), total)  # over the replicas
    return (summed / jax.lax.axis_size(REPLICAS),)


def _int8_replica_sum(ct: jax.Array, inside: NamedSharding, total: NamedSharding, axis: str, block: int) -> jax.Array:
    """Inside the per-replica vmap over mesh axis `axis`: the replicas' sum of `ct` (each
    replica's, sharded `inside`) through qgZ's int8 all-to-all, unbatched and sharded
    `total`. The kernel is a shard_map over the replicas' stacked values, which a vmap with
    spmd_axis_name may not trace inside: its batching rule, which sees them stacked, runs it
    once, outside."""

    @custom_vmap
    def summed(ct):  # traced for its output type only: the vmap rule below is what runs
        return ct

    @summed.def_vmap
    def _(axis_size, in_batched, ct):
        if not in_batched[0]:
            raise ValueError("the int8 replica sum sums each replica's own gradient, not a shared value")
        stacked = jax.lax.with_sharding_constraint(ct, NamedSharding(total.mesh, P(axis, *inside.spec)))
        return quantized_reduce_scatter(stacked, total.mesh, axis, inside.spec, total.spec, block), False

    return summed(ct)


# optimize_remat: a remat policy sees one opaque step (`remat_opt`, jaxpar.nn.LAYOUT_CHANGES)
# and re-runs it (an identity) rather than save its output, a copy of the stored parameter.
_replica_sum.defvjp(_replica_sum_fwd, _replica_sum_bwd, optimize_remat=True)


def _reshard(value: jax.Array, source: P, target: P, layout: Layout) -> jax.Array:
    block = layout.params.quantize_block
    if block and jnp.issubdtype(value.dtype, jnp.floating) and any(gathered_axes(source, target, value.ndim)):
        return quantized_all_gather(value, layout.mesh, source, target, block)
    return jax.lax.with_sharding_constraint(value, NamedSharding(mesh_here(layout.mesh), target))


def param_names(abstract_state: nnx.State) -> dict:
    """Pure-dict tree (the shape of `nnx.to_pure_dict`) of each parameter's logical names."""
    out: dict = {}
    for path, variable in nnx.to_flat_state(abstract_state):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = ParamNames(logical_names(variable))
    return out


@dataclasses.dataclass(frozen=True)
class ParamNames:
    """A leaf holding a tuple of names (tuples themselves are pytree nodes)."""

    names: tuple[str | None, ...]




def shardings_for(tree_names: Any, shapes: Any, layout: Layout, kind: str = "storage", where: str = "param") -> Any:
    """NamedShardings for a tree of arrays (or ShapeDtypeStructs) given their logical names.

    Checks divisibility up front: a dimension that its mesh axes do not divide raises a
    ConfigError naming the array, the dimension and the sizes that would work.
    """

    def one(path, names: ParamNames, shape) -> NamedSharding:
        spec = layout.rules.spec(names.names, kind)
        check_divisible(jax.tree_util.keystr(path), shape.shape, names.names, spec, layout.mesh, where)
        return NamedSharding(layout.mesh, spec)

    return jax.tree_util.tree_map_with_path(one, tree_names, shapes, is_leaf=lambda x: isinstance(x, ParamNames))


def check_divisible(
    path: str, shape: Sequence[int], names: Sequence[str | None], spec: P, mesh: Mesh, where: str
) -> None:
    for dim, (size, name, axes) in enumerate(zip(shape, names, tuple(spec) + (None,) * len(shape))):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        degree = math.prod(mesh.shape[a] for a in axes)
        if size % degree:
            raise ConfigError(
                f"{where} {path}: dimension {dim} ('{name}') has size {size}, which mesh "
                f"{'x'.join(axes)}={degree} does not divide; use a degree in "
                f"{divisors(size)} or change the rules for '{name}'"
            )


def add_axes(spec: P, shape: Sequence[int], names: Sequence[str | None], mesh: Mesh, axes: tuple[str, ...]) -> P:
    """`spec` with `axes` appended (minor-most) to the dimension whose shard is largest
    among those they divide; `spec` unchanged if none qualifies."""
    entries = spec_entries(spec, len(shape))
    extra = math.prod(mesh.shape[a] for a in axes)
    best, best_shard = None, 0
    for dim, (size, name, held) in enumerate(zip(shape, names, entries)):
        degree = math.prod(mesh.shape[a] for a in held)
        if name in UNSHARDABLE_NAMES or any(a in held for a in axes) or size % (degree * extra):
            continue
        if size // degree > best_shard:
            best, best_shard = dim, size // degree
    if best is None:
        return spec
    entries[best] = entries[best] + axes
    return P(*(None if not e else e[0] if len(e) == 1 else e for e in entries))
