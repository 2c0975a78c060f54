"""Compressed gradient reduction over `data` across hosts (parallel.compression.method =
powersgd | topk), with error feedback (jaxpar.kernels.compression holds the kernels).

The step computes one gradient per data replica ([data, ...], jaxpar.step.replicas), each
already reduced inside its host over fsdp (exact), and averages them over `data`, whose
replicas sit one per host (the `gradient-compression` rule), through a compressor instead
of an all-reduce, so only compressed factors or (value, index) pairs cross the network:
top-k picks the largest entries of each device's block of its replica's gradient; PowerSGD
factors each whole gradient matrix, whatever the in-host layout. What a replica left out is
its residual, added to its next gradient (error feedback; parallel.compression.error_feedback=false
drops it instead); the residuals and PowerSGD's
warm-started factors are training state (TrainState.compression), checkpointed with the
rest.

Replica r's gradient g_r sums its share of the batch's per-example losses over the global
batch weight, so sum_r g_r is the step's gradient; the kernels average n x g_r, each
replica's estimate of that gradient, and their residuals are in the same units.

PowerSGD sees a gradient as a batch of matrices (jaxpar.kernels.compression.matrix_shape),
the batch its leading dimensions named `layers` or `experts` (the layer scan's stack, the
experts), the rest split into rows and columns where the matrix is closest to square. A
matrix whose shorter side is below parallel.compression.powersgd_rank is factored at that side's rank,
which is exact (as PyTorch's PowerSGD hook does); a rank above every matrix's shorter side
is refused. Parameters with fewer than two other dimensions (norm scales,
biases) are averaged exactly. Top-k compresses every parameter.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.kernels.compression import (factor_spec, matrix_shape, matrix_split, powersgd_cross_host_floats,
                                        powersgd_mean, powersgd_start, shard_counts, topk_count, topk_mean)
from jaxpar.kernels.quantized import entries
from jaxpar.sharding.annotate import ParamNames
from jaxpar.specs import CompressionConfig
from jaxpar.step.replicas import AXIS, without_data

BATCH_NAMES = ("layers", "experts")  # leading dimensions PowerSGD treats as a batch of matrices
# The name scope of the compressors' kernels: their collectives carry it in the compiled
# program's op_name (jaxpar.inspect: what crosses hosts for the compressor, and what not).
SCOPE = "gradient_compression"
COMPRESSED = ("powersgd", "topk")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CompressionState:
    residual: Any  # parameter-shaped: each replica's [data, ...] float32, what it has not sent yet
    factors: Any  # PowerSGD: {parameter path: its Q [*batch, b, rank]}; top-k: None


@dataclasses.dataclass(frozen=True)
class Block:
    """How one parameter's gradient is cut: its shape, the spec of a replica's gradient
    (its in-host sharding), the blocks per dimension, and its leading batch dims."""

    shape: tuple[int, ...]
    spec: P
    shards: tuple[int, ...]
    batch_dims: int

    @property
    def block(self) -> tuple[int, ...]:
        """One device's block."""
        return tuple(d // s for d, s in zip(self.shape, self.shards))

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) - self.batch_dims >= 2

    @property
    def sides(self) -> tuple[int, int]:
        """PowerSGD's matrix [a, b] (per batch entry)."""
        return matrix_shape(self.shape, self.batch_dims)[-2:]

    @property
    def factor_spec(self) -> P:
        return factor_spec(self.spec, len(self.shape), self.batch_dims, matrix_split(self.shape, self.batch_dims))

    def layer(self) -> Block:
        """One layer's slice of a stacked parameter (its leading dimension, `layers`)."""
        return Block(self.shape[1:], P(*entries(self.spec, len(self.shape))[1:]), self.shards[1:], self.batch_dims - 1)


@dataclasses.dataclass(frozen=True)
class Compressor:
    method: str  # powersgd | topk
    rank: int
    fraction: float
    mesh: Mesh
    blocks: dict[str, Block]  # parameter path -> how it is cut
    treedef: Any  # the parameters' tree, whose leaves `blocks` lists in order
    seed: int
    error_feedback: bool = True  # parallel.compression.error_feedback: carry what is left out to the next step
    # The stacked parameters averaged one layer at a time inside the backward pass
    # (jaxpar.step.compressed); the rest are averaged once it ends.
    per_layer: frozenset[str] = frozenset()

    @property
    def replicas(self) -> int:
        return self.mesh.shape[AXIS]

    def factored(self) -> dict[str, Block]:
        """The parameters PowerSGD factors (none under top-k)."""
        return {k: b for k, b in self.blocks.items() if self.method == "powersgd" and b.is_matrix}

    @property
    def knob(self) -> str:
        """The method's setting, in words: "rank 4", "fraction 0.01"."""
        return f"rank {self.rank}" if self.method == "powersgd" else f"fraction {self.fraction}"

    def rank_of(self, block: Block) -> int:
        """The rank a matrix is factored at: parallel.compression.powersgd_rank, or its shorter side."""
        return min(self.rank, *block.sides)

    def _state(self, residual: list, factors: dict) -> CompressionState:
        """The state from residual leaves in `blocks` order and the factors (PowerSGD only)."""
        return CompressionState(jax.tree.unflatten(self.treedef, residual), factors if self.method == "powersgd" else None)

    def shardings(self) -> CompressionState:
        residual = [NamedSharding(self.mesh, P(AXIS, *b.spec)) for b in self.blocks.values()]
        return self._state(residual, {k: NamedSharding(self.mesh, b.factor_spec) for k, b in self.factored().items()})

    def layer_state(self, state: CompressionState) -> dict[str, dict]:
        """The `per_layer` parameters' state, as their layer hooks take it (stacked over
        layers): {path: {"residual": [data, layers, ...], "q": PowerSGD's [layers, ..., b, r]}}."""
        residuals = dict(zip(self.blocks, jax.tree.leaves(state.residual)))
        factors = state.factors or {}
        return {path: {"residual": residuals[path], **({"q": factors[path]} if path in factors else {})}
                for path in self.blocks if path in self.per_layer}

    def init(self) -> CompressionState:
        """Zero residuals and, for PowerSGD, Gaussian factors drawn from train.seed."""
        residual = [jnp.zeros((self.replicas, *b.shape), jnp.float32) for b in self.blocks.values()]
        keys = jax.random.split(jax.random.key(self.seed), max(1, len(self.blocks)))
        factors = {k: powersgd_start(b.shape, self.rank_of(b), keys[i], b.batch_dims)
                   for i, (k, b) in enumerate(self.blocks.items()) if k in self.factored()}
        return self._state(residual, factors)

    def reduce(self, grads: Any, state: CompressionState, done: dict[str, tuple] | None = None
               ) -> tuple[Any, CompressionState]:
        """(per-replica gradients [data, ...], state) -> (their sum, compressed, sharded as a
        replica's gradient; the new state). `done`: {path: (sum, {"residual", "q"})} of the
        parameters already averaged layer by layer (`per_layer`), whose `grads` are ignored."""
        done = done or {}
        leaves, residuals = jax.tree.leaves(grads), jax.tree.leaves(state.residual)
        means, new_residuals, factors = [], [], {}
        for (path, block), g, residual in zip(self.blocks.items(), leaves, residuals):
            if path in done:
                mean, new = done[path]
                residual, q = new["residual"], new.get("q")
            else:
                q = state.factors[path] if path in self.factored() else None
                # each replica's estimate of the summed gradient
                mean, residual, q = self.average(block, g * self.replicas, residual, q)
            if q is not None:
                factors[path] = q
            means.append(mean)
            new_residuals.append(residual)
        return jax.tree.unflatten(self.treedef, means), self._state(new_residuals, factors)

    def average(self, block: Block, estimate: jax.Array, residual: jax.Array, q: jax.Array | None
                ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Each replica's estimate [data, ...] of one parameter's gradient (or of a layer's
        slice of it, `block` cut the same way) -> (their compressed mean, sharded
        `block.spec`; the new residuals [data, ...]; PowerSGD's next q, None without one).
        Traced under the name scope SCOPE, which the compiled program's collectives keep."""
        with jax.named_scope(SCOPE):
            mean, left_out, q = self._average(block, estimate, residual, q)
        # Without error feedback what was left out is dropped: the next step starts from none.
        return mean, left_out if self.error_feedback else jnp.zeros_like(left_out), q

    def _average(self, block, estimate, residual, q):
        if self.method == "topk":
            return (*topk_mean(estimate, residual, self.fraction, self.mesh, AXIS, block.spec), None)
        if q is not None:
            mean, q, residual = powersgd_mean(estimate, q, residual, self.mesh, AXIS, block.spec, block.batch_dims)
            return mean, residual, q
        mean = jnp.mean(estimate + residual, axis=0)  # a vector: averaged exactly
        return jax.lax.with_sharding_constraint(mean, NamedSharding(self.mesh, block.spec)), jnp.zeros_like(residual), None

    def cross_host_bytes(self, zero_stage: int = 0) -> dict[str, float]:
        """Bytes each device sends across hosts per step, ring model: compressed, and what
        the uncompressed step's reduction of the same float32 blocks would send at
        `zero_stage` (an all-reduce at ZeRO-0, a reduce-scatter above)."""
        n = self.replicas
        ring = 2 * (n - 1) / n * 4  # all-reduce bytes per float32 element
        uncompressed = ring if zero_stage == 0 else ring / 2
        compressed = dense = 0.0
        for path, b in self.blocks.items():
            size = math.prod(b.block)
            dense += uncompressed * size
            if self.method == "topk":  # all-gather of n x k (float32 value, int32 index) pairs
                layers = b.shape[0] if path in self.per_layer else 1  # k of each layer's block
                compressed += (n - 1) * layers * topk_count(size // layers, self.fraction) * 8
            elif path in self.factored():
                compressed += ring * powersgd_cross_host_floats(b.shape, self.rank_of(b), b.spec, dict(self.mesh.shape),
                                                                b.batch_dims)
            else:
                compressed += ring * size
        return {"compressed": compressed, "uncompressed": dense}


def make_compressor(asked: CompressionConfig, names: Any, shapes: Any, grad_shardings: Any, mesh: Mesh, seed: int
                    ) -> Compressor | None:
    """The compressor the layout's compression spec asks for, or None (none; int8 is qgZ). Refuses
    a PowerSGD rank above the shorter side of every matrix it would factor (`check_rank`)."""
    method = asked.method
    if method not in COMPRESSED:
        return None
    flat_names, treedef = jax.tree_util.tree_flatten_with_path(names, is_leaf=lambda x: isinstance(x, ParamNames))
    flat_shapes, flat_shardings = jax.tree.leaves(shapes), jax.tree.leaves(grad_shardings)
    blocks = {}
    for (path, n), shape, sharding in zip(flat_names, flat_shapes, flat_shardings):
        spec = without_data(sharding).spec
        shards = shard_counts(spec, dict(mesh.shape), len(shape.shape))
        batch = next((i for i, name in enumerate(n.names) if name not in BATCH_NAMES), len(n.names))
        blocks[jax.tree_util.keystr(path, simple=True, separator=".")] = Block(tuple(shape.shape), spec, shards, batch)
    compressor = Compressor(method, asked.powersgd_rank, asked.topk_fraction, mesh, blocks, treedef, seed,
                            asked.error_feedback)
    check_rank(compressor)
    return compressor


def check_rank(compressor: Compressor) -> None:
    """PowerSGD's rank may not exceed the shorter side of every matrix it factors (then no
    matrix would be factored at the rank asked for)."""
    if compressor.method != "powersgd":
        return
    sides = {k: b.sides for k, b in compressor.factored().items()}
    if not sides:
        raise ConfigError("parallel.compression.method=powersgd: the model has no parameter with two dimensions "
                          "(besides layers and experts) to factor; use parallel.compression.method=topk")
    path, (a, b) = max(sides.items(), key=lambda kv: min(kv[1]))
    if compressor.rank > min(a, b):
        raise ConfigError(
            f"parallel.compression.powersgd_rank={compressor.rank} exceeds the shorter side of every matrix PowerSGD factors, "
            f"the largest being {path}'s gradient, {a} x {b}; use parallel.compression.powersgd_rank <= {min(a, b)}"
        )
