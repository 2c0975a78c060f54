"""Context-parallel attention: one differentiable entry point over the three kernels.

  ring       K/V blocks circulate (ppermute); memory and traffic per device ~ s/n
  ulysses    all-to-all to head shards and back; degree must divide the kv heads
  allgather  K/V gathered whole; the simple baseline

`context_attention` runs the chosen kernel in `jax.shard_map` over a mesh, forward and
backward each a kernel of its own (`jax.custom_vjp`): the backward recomputes block by block
from the queries, keys, values, output and log-normaliser, never from an s x s matrix.
Kernels know only their mesh axes and specs, nothing about models.

Gradients per data replica are taken under `jax.vmap(spmd_axis_name=...)`, where a
shard_map may not be traced; a `custom_vmap` rule folds the replica dimension into the batch
(sharded over the replica axis) and runs the kernel once, outside that vmap.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_batching import custom_vmap
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.attention import allgather, ring, ulysses
from jaxpar.kernels.attention.tiles import Masking, tile
from jaxpar.kernels.attention.order import chunk_length
from jaxpar.mesh import mesh_here

KERNELS = {"ring": ring, "ulysses": ulysses, "allgather": allgather}  # one per jaxpar.choices.ContextImpl
RESIDUALS_NAME = "context_attention"  # what the backward pass reads: q, k, v, segments, o, lse


@dataclasses.dataclass(frozen=True)
class ContextSpec:
    """Where q [B, S, H, K], k/v [B, S, G, K] and segment ids [B, S] live, and how to attend.

    q_spec / kv_spec shard the sequence (dimension 1) over `axis`; batch and heads may be
    sharded over any other mesh axes, which the kernel treats as independent work.
    replica_axis: the mesh axis of an enclosing `vmap(spmd_axis_name=...)`, if any.
    ring_hop: how a ring step reaches the next device (jaxpar.kernels.hops): "permute", or
    "swap" inside pipeline stages, for a ring of two.
    """

    impl: str
    mesh: Mesh
    axis: tuple[str, ...]
    q_spec: P
    kv_spec: P
    seq_layout: str = "zigzag"
    masking: Masking = Masking()
    replica_axis: str | None = None
    ring_hop: str = "permute"

    def __post_init__(self):
        for name in ("q_spec", "kv_spec"):  # four entries, so kernels may index any dimension
            spec = getattr(self, name)
            object.__setattr__(self, name, P(*spec, *(None,) * (4 - len(spec))))

    @property
    def degree(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axis)

    def masking_for(self, s: int) -> Masking:
        """`masking` with tiles that divide the layout's chunks of a length-s sequence: a tile
        spanning a zigzag device's early and late chunk is never wholly in the future, and
        would defeat the causal skip (and the balance)."""
        chunk = chunk_length(self.seq_layout, self.degree, s)
        m = self.masking
        return dataclasses.replace(m, block_q=tile(chunk, m.block_q), block_kv=tile(chunk, m.block_kv))

    def ring_steps(self, s: int) -> int:
        """How many of the ring's blocks some query of a device sees: all n, but under a
        sliding window w over the contiguous layout only the device's own block and the
        ceil((w - 1) / chunk) before it, so the ring stops there (with the zigzag layout a
        device's late chunk needs the blocks after it too: the tile skip saves their FLOPs,
        not their hops)."""
        n, window = self.degree, self.masking.window
        if not window or self.seq_layout != "contiguous":
            return n
        return min(n, 1 + -(-(window - 1) // (s // n)))

    @property
    def seg_spec(self) -> P:
        return P(self.q_spec[0], self.q_spec[1])

    def with_replicas(self) -> "ContextSpec":
        """The spec with the replica axis leading the batch dimension (folded replicas)."""
        fold = lambda spec: P(_join(self.replica_axis, spec[0]), *spec[1:])
        return dataclasses.replace(self, q_spec=fold(self.q_spec), kv_spec=fold(self.kv_spec), replica_axis=None)


def _join(first: str, entry: Any) -> Any:
    rest = _axes(entry)
    return (first,) + rest if rest else first


def _axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def context_attention(q, k, v, segment_ids, spec: ContextSpec) -> jax.Array:
    """Attention of q over k, v with the sequence sharded over `spec.axis`. segment_ids
    [B, S] or None; the sequence is laid out as `spec.seq_layout` says (jaxpar...order)."""
    if spec.impl not in KERNELS:
        raise ValueError(f"context impl {spec.impl!r}; use one of {', '.join(KERNELS)}")
    if spec.impl == "ulysses":
        local_kv = k.shape[2] // math.prod(spec.mesh.shape[a] for a in _axes(spec.kv_spec[2]))
        if local_kv % spec.degree:
            raise ValueError(
                f"ulysses: context degree {spec.degree} does not divide the {local_kv} kv heads each device "
                "holds; use ring or allgather, or a degree that divides them"
            )
    return _attend(q, k, v, segment_ids, spec)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(q, k, v, segment_ids, spec):
    return _forward(spec)(q, k, v, segment_ids)[0]


def _attend_fwd(q, k, v, segment_ids, spec):
    o, residuals, _ = _forward(spec)(q, k, v, segment_ids)
    # named, so remat policies that keep matmul outputs keep these too (jaxpar.nn)
    return o, jax.tree.map(lambda x: checkpoint_name(x, RESIDUALS_NAME), residuals)


def _attend_bwd(spec, residuals, do):
    dq, dk, dv = _backward(spec)(residuals, do)
    return dq, dk, dv, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _per_device_tiles(tiles):
    return tiles.reshape((1,))


def _forward(spec: ContextSpec):
    """(q, k, v, seg) -> (o, residuals, tiles per device [n_devices])."""
    kernel = KERNELS[spec.impl]
    mesh = mesh_here(spec.mesh)
    devices = P(tuple(a for a in mesh.axis_names if a not in getattr(mesh, "manual_axes", ())))

    def sharded(q, k, v, seg):
        has_seg = seg is not None
        seg_spec = spec.seg_spec if has_seg else None
        res_specs = kernel.residual_specs(spec.q_spec, spec.kv_spec, seg_spec, spec)

        @partial(
            jax.shard_map,
            mesh=mesh,
            in_specs=(spec.q_spec, spec.kv_spec, spec.kv_spec, seg_spec),
            out_specs=(spec.q_spec, res_specs, devices),
            check_vma=False,
        )
        def body(q, k, v, seg):
            o, residuals, tiles = kernel.forward(q, k, v, seg, spec)
            return o, residuals, _per_device_tiles(tiles)

        return _opaque(body)(q, k, v, seg)

    return _outside_replica_vmap(sharded, spec, _forward)


def _opaque(fn):
    """`fn` as one operation to an enclosing `jax.checkpoint`: a policy keeps or recomputes
    its outputs whole. Remat looks inside ordinary calls, loops and even nested checkpoints
    (a dots policy, or a checkpoint around a checkpointed layer scan, stacked every score
    tile of every ring step: s^2/n^2 per head), but not inside a custom VJP call. The
    wrapper is never differentiated: `_attend`'s own VJP covers the kernel."""

    @jax.custom_vjp
    def run(*args):
        return fn(*args)

    def never_differentiated(*_):
        raise TypeError("the context attention forward kernel is differentiated only through context_attention")

    run.defvjp(lambda *args: (fn(*args), None), never_differentiated)
    return run


def _backward(spec: ContextSpec):
    kernel = KERNELS[spec.impl]

    def sharded(residuals, do):
        seg_spec = spec.seg_spec if residuals[3] is not None else None
        res_specs = kernel.residual_specs(spec.q_spec, spec.kv_spec, seg_spec, spec)

        @partial(
            jax.shard_map,
            mesh=mesh_here(spec.mesh),
            in_specs=(res_specs, spec.q_spec),
            out_specs=(spec.q_spec, spec.kv_spec, spec.kv_spec),
            check_vma=False,
        )
        def body(residuals, do):
            # A fresh value for the compiler: otherwise the backward's K/V ring hops (or
            # gathers) are the forward's, merged by CSE, and every device keeps all of K/V
            # from the forward to the backward pass.
            residuals = jax.lax.optimization_barrier(residuals)
            return kernel.backward(residuals, do, spec)

        return body(residuals, do)

    return _outside_replica_vmap(sharded, spec, _backward)


def _outside_replica_vmap(sharded, spec: ContextSpec, rebuild):
    """`sharded`, plus a batching rule for the per-replica vmap: fold [R, B, ...] into
    [R*B, ...] sharded over (replica axis, batch axes), run once, unfold."""
    if spec.replica_axis is None:
        return sharded

    @custom_vmap
    def run(*args):
        return sharded(*args)

    @run.def_vmap
    def _(axis_size, in_batched, *args):
        args = jax.tree.map(
            lambda x, batched: x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)), args, tuple(in_batched)
        )
        folded = jax.tree.map(lambda x: x.reshape(axis_size * x.shape[1], *x.shape[2:]), args)
        out = rebuild(spec.with_replicas())(*folded)
        unfold = lambda x: x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:])
        out = jax.tree.map(unfold, out)
        return out, jax.tree.map(lambda _: True, out)

    return run


def executed_tiles(q, k, v, segment_ids, spec: ContextSpec) -> jax.Array:
    """Score tiles each device computed in the forward pass ([n_devices], mesh order): the
    kernel's own count of the (query tile, key tile) pairs its causal skip let through."""
    return _forward(spec)(q, k, v, segment_ids)[2]
