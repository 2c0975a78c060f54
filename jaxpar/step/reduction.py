"""How the step's gradient is summed over the data replicas: one spec, chosen once from the
config (`grad_reduction`), that the trainer's gradient paths read instead of flags.

    when="backward"    no per-replica gradients: each layer's gradient is reduced over
                       data x fsdp by the partitioner inside the backward pass, where a GPU
                       overlaps it with the layers still to go (ZeRO 0-3 on a flat mesh)
    when="layers"      per-replica gradients (jaxpar.step.replicas), reduced inside the
                       replica, then summed over the replicas layer by layer inside the
                       backward pass (`jaxpar.sharding.annotate.ReplicaSum`): hybrid
                       sharding and qgZ at ZeRO 2-3
    when="step"        per-replica gradients summed once per step (`sum_replicas`), after
                       the microbatches: ZeRO 0-1 with accumulation or hybrid sharding, qgZ
                       at ZeRO 0-1, pipeline stages
    when="compressed"  each replica's gradient averaged through a compressor, PowerSGD or
                       top-k, layer by layer where it can (jaxpar.step.compressed)

`int8_block` > 0 is ZeRO++ qgZ: the sums over data move int8 with a scale per this many
elements (jaxpar.kernels.quantized). A new reduction is a `when` (or a field) here, its
config field and rule, and its branch in `jaxpar.step.trainer._gradients`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

import jax

from jaxpar.kernels.quantized import quantized_reduce_scatter
from jaxpar.sharding import Layout
from jaxpar.sharding.annotate import ReplicaSum
from jaxpar.step.compression import Compressor
from jaxpar.step.replicas import without_data

When = Literal["backward", "layers", "step", "compressed"]


@dataclasses.dataclass(frozen=True)
class GradReduction:
    when: When = "backward"
    int8_block: int = 0  # qgZ: > 0
    compressor: Compressor | None = None  # when == "compressed"

    @property
    def per_replica(self) -> bool:
        """Whether each data replica's gradient is computed apart (a vmap over data)."""
        return self.when != "backward"

    def replica_sum(self) -> ReplicaSum | None:
        """The layout's in-backward sum over the replicas (when == "layers"), else None."""
        return ReplicaSum(self.int8_block) if self.when == "layers" else None


def grad_reduction(layout: Layout, compressor: Compressor | None) -> GradReduction:
    """The reduction the layout's specs ask for (ZeRO stage, microbatches, qgZ, a compressor).

    Per-replica gradients where they pay: under hybrid sharding (reduce inside the host
    first), to accumulate ZeRO 0-1 microbatches unreduced, and where the reduction over
    data is our own (qgZ's int8 all-to-all, a compressor). Elsewhere the partitioner
    reduces each layer's gradient inside the backward loop; so it does under hybrid
    sharding at ZeRO 2-3 too, summed over the replicas layer by layer."""
    mesh_shape, microbatches, stage = layout.mesh.shape, layout.microbatches, layout.zero.stage
    int8_block = layout.qgz_block
    if compressor is not None:
        return GradReduction("compressed", compressor=compressor)
    if mesh_shape["stage"] > 1:  # each stage's replicas accumulate unreduced (jaxpar.step.pipelined)
        return GradReduction("step", int8_block)
    replicas = mesh_shape["data"] > 1 and (
        mesh_shape["fsdp"] > 1 or (microbatches > 1 and stage < 2) or int8_block > 0)
    if not replicas:
        return GradReduction("backward")
    return GradReduction("step" if stage < 2 else "layers", int8_block)


def sum_replicas(reduction: GradReduction, layout: Layout) -> Callable[[Any, Any], Any]:
    """(per-replica gradients [data, ...], target shardings) -> their sum, sharded as the
    target: an int8 all-to-all under qgZ where the target shards over data, else the
    partitioner's reduction."""

    def one(g, sharding):
        source = without_data(sharding).spec
        if reduction.int8_block and source != sharding.spec:
            return quantized_reduce_scatter(g, layout.mesh, "data", source, sharding.spec, reduction.int8_block)
        return jax.lax.with_sharding_constraint(g.sum(0), sharding)

    return lambda grads, target: jax.tree.map(one, grads, target)
