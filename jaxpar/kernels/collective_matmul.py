"""Collective matmul for tensor parallelism with sequence parallelism (Wang et al., ASPLOS 2023,
"Overlap communication with dependent computation via decomposition").

In Megatron tensor parallelism with the sequence sharded over `tensor` outside the matmuls,
the column-parallel matmul needs the whole sequence first, and the row-parallel matmul
leaves partial sums that must be summed and scattered back over the sequence:

  column   X[S@tensor, D] -> all-gather -> X[S, D] @ W[D, F@tensor]    = Y[S, F@tensor]
  row      Y[S, F@tensor] @ W[F@tensor, D] = partial Z[S, D] -> reduce-scatter -> Z[S@tensor, D]

Done as written, the collective and the matmul run one after the other. Here each is split
into n steps over the n sequence chunks (n = size of the mesh axis):

  allgather_matmul       every device multiplies the x chunk it holds while `ppermute` passes
                         the chunks round the ring, so the next chunk's transfer can overlap
                         this chunk's matmul. n-1 hops of one chunk each.
  matmul_reducescatter   every device multiplies one chunk of its y while the running sum for
                         another chunk travels the ring, each device adding its share as the
                         sum passes; after n-1 hops each sum is home, complete.

`bidirectional=True` sends both ways round the ring at once: about half the chunks go right,
half left, so the chain of dependent transfers is n//2 hops long instead of n-1, with the same
bytes per device (both directions of each link carry traffic). `schedule` spells out which
chunk each device multiplies at each step; docs/collective_matmul.md draws it.

Both kernels are called inside `jax.shard_map` over the mesh axis `axis`; `column_parallel`
and `row_parallel` take global arrays and a Mesh and run the shard_map, with
`impl="plain"` for the reference (one `all_gather` / `psum_scatter` and one matmul).
Gradients are JAX's own: the transpose of a ppermute is the reverse ppermute, so the backward
pass is a collective matmul too (the all-gather's becomes a reduce-scatter and vice versa).
The steps are unrolled: tensor-parallel degrees are small (within one host), and XLA's
latency-hiding scheduler sees every transfer and matmul as a separate op to interleave.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.hops import send

IMPLS = ("collective", "bidirectional", "plain")
OPS = ("allgather_matmul", "matmul_reducescatter")

# ------------------------------------------------------------------ the ring plan


def _hops(n: int, bidirectional: bool) -> tuple[int, int]:
    """(chunks that travel rightwards, chunks that travel leftwards) to or from each device,
    excluding its own: n-1 in all, split as evenly as possible when bidirectional."""
    return (n // 2, (n - 1) // 2) if bidirectional else (n - 1, 0)


def _to_right(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def _to_left(n: int) -> list[tuple[int, int]]:
    return [(i, (i - 1) % n) for i in range(n)]


def schedule(n: int, op: str = "allgather_matmul", bidirectional: bool = False) -> list[list[list[int]]]:
    """[step][device] -> the sequence chunks that device multiplies at that step, as the
    kernels run them (a chunk is s/n rows of the sequence; device r owns chunk r).

    allgather_matmul: device r starts with its own chunk; at step i it holds chunk r-i from
    the right-travelling stream and, bidirectional, chunk r+i from the left-travelling one.
    matmul_reducescatter: at step i device r adds its share of chunk r+R-i to the sum
    travelling right (R = its hop count) and, bidirectional, of chunk r-L+i to the sum
    travelling left; at the last step it adds its share of its own chunk to the sums that
    have arrived. Every device multiplies every chunk exactly once.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is not one of {OPS}")
    right, left = _hops(n, bidirectional)
    steps = []
    for i in range(right + 1):
        if op == "allgather_matmul":
            offsets = [-i] + ([i] if 1 <= i <= left else [])
        else:
            offsets = [0] if i == right else [right - i] + ([i - left] if i < left else [])
        steps.append([[(r + o) % n for o in offsets] for r in range(n)])
    return steps


# ------------------------------------------------------------------ kernels (inside shard_map)


def _check_local(name: str, a: jax.Array, b: jax.Array, rank_a: str) -> None:
    if a.ndim < 2:
        raise ValueError(f"{name}: {rank_a} must have at least 2 dimensions [..., seq, features], got shape {a.shape}")
    if b.ndim != 2:
        raise ValueError(f"{name}: w must have 2 dimensions, got shape {b.shape}")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(
            f"{name}: {rank_a}.shape[-1]={a.shape[-1]} must equal w.shape[0]={b.shape[0]} (the contracted dimension)"
        )


def allgather_matmul(x: jax.Array, w: jax.Array, axis: str, *, bidirectional: bool = False, hop: str = "permute") -> jax.Array:
    """all_gather(x, axis, along the sequence, tiled) @ w, as n partial matmuls and n-1 hops.

    Inside a shard_map over `axis` (size n). Local x [..., S/n, D] (this device's sequence
    chunk), local w [D, F/n] -> local [..., S, F/n]: X[.., S@axis, D] @ W[D, F@axis].
    """
    return allgather_matmuls(x, [w], axis, bidirectional=bidirectional, hop=hop)[0]


def allgather_matmuls(x: jax.Array, ws: Sequence[jax.Array], axis: str, *, bidirectional: bool = False,
                      hop: str = "permute") -> list[jax.Array]:
    """[all_gather(x) @ w for w in ws] with one ring: each chunk of x travels once and meets
    every w when it arrives (a fused QKV or gate/up projection gathers its input once).
    hop: how a chunk reaches a neighbour (jaxpar.kernels.hops; "swap" in pipeline stages)."""
    for w in ws:
        _check_local("allgather_matmul", x, w, "x")
    n = jax.lax.axis_size(axis)
    if n == 1:
        return [x @ w for w in ws]
    rank = jax.lax.axis_index(axis)
    right, left = _hops(n, bidirectional)
    c, seq = x.shape[-2], x.ndim - 2
    outs = [jnp.zeros((*x.shape[:-2], n * c, w.shape[1]), jnp.result_type(x, w)) for w in ws]

    def put(outs, chunk, index):
        return [jax.lax.dynamic_update_slice_in_dim(out, chunk @ w, index * c, axis=seq) for out, w in zip(outs, ws)]

    rightward = leftward = x  # both start as this device's own chunk
    for i in range(right + 1):
        # Send what is held now (for step i+1) before multiplying it: the two are
        # independent, so the transfer can run under this step's matmul.
        next_right = send(rightward, axis, _to_right(n), hop) if i < right else None
        next_left = send(leftward, axis, _to_left(n), hop) if i < left else None
        outs = put(outs, rightward, (rank - i) % n)
        if 1 <= i <= left:
            outs = put(outs, leftward, (rank + i) % n)
        rightward, leftward = next_right, next_left
    return outs


def matmul_reducescatter(y: jax.Array, w: jax.Array, axis: str, *, bidirectional: bool = False,
                         hop: str = "permute") -> jax.Array:
    """psum_scatter(y @ w, axis, over the sequence, tiled), as n partial matmuls whose running
    sums take n-1 hops.

    Inside a shard_map over `axis` (size n). Local y [..., S, F/n], local w [F/n, D] -> local
    [..., S/n, D]: (Y[.., S, F@axis] @ W[F@axis, D]) summed over `axis`, scattered as S@axis.
    The running sums travel in the result dtype, as a reduce-scatter's would. hop: as in
    `allgather_matmuls`.
    """
    _check_local("matmul_reducescatter", y, w, "y")
    n = jax.lax.axis_size(axis)
    if y.shape[-2] % n:
        raise ValueError(
            f"matmul_reducescatter: y.shape[-2]={y.shape[-2]} (the sequence) is not divisible by the size "
            f"{n} of mesh axis {axis!r}"
        )
    if n == 1:
        return y @ w
    rank = jax.lax.axis_index(axis)
    right, left = _hops(n, bidirectional)
    c, seq = y.shape[-2] // n, y.ndim - 2

    def part(index):
        return jax.lax.dynamic_slice_in_dim(y, index * c, c, axis=seq) @ w

    def add(index, *arrived):
        # The matmul does not wait for the arriving sums; only the addition does. The barrier
        # keeps XLA from fusing the addition into the matmul as its epilogue, which would
        # make the matmul wait for the transfer and serialize the two.
        if not arrived:
            return part(index)
        mine, *arrived = jax.lax.optimization_barrier((part(index), *arrived))
        return sum(arrived, mine)

    rightward = leftward = None  # the running sums this device last added to
    for i in range(right):
        arrived = () if rightward is None else (send(rightward, axis, _to_right(n), hop),)
        rightward = add((rank + right - i) % n, *arrived)
        if i < left:
            arrived = () if leftward is None else (send(leftward, axis, _to_left(n), hop),)
            leftward = add((rank - left + i) % n, *arrived)
    arrived = [send(rightward, axis, _to_right(n), hop)]
    if left:
        arrived.append(send(leftward, axis, _to_left(n), hop))
    return add(rank, *arrived)


def allgather_matmul_reference(x: jax.Array, w: jax.Array, axis: str) -> jax.Array:
    """Plain equivalent of `allgather_matmul`: one all-gather, then one matmul."""
    _check_local("allgather_matmul_reference", x, w, "x")
    return jax.lax.all_gather(x, axis, axis=x.ndim - 2, tiled=True) @ w


def matmul_reducescatter_reference(y: jax.Array, w: jax.Array, axis: str) -> jax.Array:
    """Plain equivalent of `matmul_reducescatter`: one matmul, then one reduce-scatter."""
    _check_local("matmul_reducescatter_reference", y, w, "y")
    return jax.lax.psum_scatter(y @ w, axis, scatter_dimension=y.ndim - 2, tiled=True)


# ------------------------------------------------------------------ global-array wrappers


def _batch_axes(batch: str | Sequence[str] | None) -> tuple[str, ...]:
    return () if batch is None else (batch,) if isinstance(batch, str) else tuple(batch)


def _validate(name, impl, mesh, axis, batch, a, a_name, w, divisible):
    """Check names and global shapes before anything is traced; returns the batch mesh axes.
    `divisible`: (array name, array, dimension, what it is) that `axis` shards."""
    if impl not in IMPLS:
        raise ValueError(f"{name}: impl={impl!r} is not one of {IMPLS}")
    if axis not in mesh.axis_names:
        raise ValueError(f"{name}: axis={axis!r} is not a mesh axis; the mesh has {tuple(mesh.axis_names)}")
    _check_local(name, a, w, a_name)
    n = mesh.shape[axis]
    for arr_name, arr, dim, what in divisible:
        size = arr.shape[dim]
        if size % n:
            below, above = size // n * n, (size // n + 1) * n
            hint = f"{below} or {above}" if below else f"{above}"
            raise ValueError(
                f"{name}: {arr_name}.shape[{dim}]={size} ({what}) is not divisible by mesh axis "
                f"{axis!r} of size {n}; use a multiple of {n}, e.g. {hint}"
            )
    axes = _batch_axes(batch)
    for b in axes:
        if b not in mesh.axis_names:
            raise ValueError(f"{name}: batch={batch!r} names {b!r}, which is not a mesh axis {tuple(mesh.axis_names)}")
        if b == axis:
            raise ValueError(f"{name}: batch={batch!r} includes the matmul's own axis {axis!r}")
    if axes:
        if a.ndim < 3:
            raise ValueError(
                f"{name}: batch={batch!r} shards {a_name}'s first dimension, but {a_name} has shape {a.shape} "
                "(no batch dimension)"
            )
        degree = math.prod(mesh.shape[b] for b in axes)
        if a.shape[0] % degree:
            raise ValueError(
                f"{name}: {a_name}.shape[0]={a.shape[0]} (the batch) is not divisible by batch={batch!r} "
                f"of size {degree}"
            )
    return axes


def _spec(ndim: int, batch: tuple[str, ...], seq, last) -> P:
    lead = [None] * (ndim - 2)
    if batch:
        lead[0] = batch[0] if len(batch) == 1 else batch
    return P(*lead, seq, last)


def column_parallel(
    x: jax.Array,
    w: jax.Array,
    mesh: Mesh,
    axis: str = "tensor",
    impl: str = "collective",
    batch: str | Sequence[str] | None = None,
) -> jax.Array:
    """x [..., S, D] @ w [D, F] with X[.., S@axis, D] and W[D, F@axis] -> [..., S, F@axis].

    impl: "collective" (ring all-gather matmul, n-1 sequential hops), "bidirectional" (both
    ways round the ring, n//2 sequential hops) or "plain" (all_gather, then matmul).
    batch: mesh axes sharding x's first dimension (x needs 3 or more dimensions then).
    """
    axes = _validate(
        "column_parallel", impl, mesh, axis, batch, x, "x", w,
        [("x", x, -2, "the sequence"), ("w", w, 1, "the output features")],
    )
    if impl == "plain":
        kernel = partial(allgather_matmul_reference, axis=axis)
    else:
        kernel = partial(allgather_matmul, axis=axis, bidirectional=impl == "bidirectional")
    body = jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(_spec(x.ndim, axes, axis, None), P(None, axis)),
        out_specs=_spec(x.ndim, axes, None, axis),
    )
    return body(x, w)


def row_parallel(
    y: jax.Array,
    w: jax.Array,
    mesh: Mesh,
    axis: str = "tensor",
    impl: str = "collective",
    batch: str | Sequence[str] | None = None,
) -> jax.Array:
    """y [..., S, F] @ w [F, D] with Y[.., S, F@axis] and W[F@axis, D] -> [..., S@axis, D].

    impl and batch as in `column_parallel` ("plain": matmul, then psum_scatter).
    """
    axes = _validate(
        "row_parallel", impl, mesh, axis, batch, y, "y", w,
        [("y", y, -2, "the sequence"), ("y", y, -1, "the input features")],
    )
    if impl == "plain":
        kernel = partial(matmul_reducescatter_reference, axis=axis)
    else:
        kernel = partial(matmul_reducescatter, axis=axis, bidirectional=impl == "bidirectional")
    body = jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(_spec(y.ndim, axes, None, axis), P(axis, None)),
        out_specs=_spec(y.ndim, axes, axis, None),
    )
    return body(y, w)


def column_parallel_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """What `column_parallel` computes, on whole arrays with no sharding."""
    return x @ w


def row_parallel_reference(y: jax.Array, w: jax.Array) -> jax.Array:
    """What `row_parallel` computes, on whole arrays with no sharding."""
    return y @ w
