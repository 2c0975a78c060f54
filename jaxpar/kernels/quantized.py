"""Quantized collectives (ZeRO++, arXiv 2306.10209): int8 with one float32 scale per block.

  quantized_all_gather       qwZ: each device quantizes its shard, the int8 codes and scales
                             are all-gathered, every device dequantizes. 1 byte per element
                             on the wire (plus 4 per block) instead of 2 (bf16) or 4 (fp32).
  quantized_reduce_scatter   qgZ: each replica quantizes the chunk every other replica owns,
                             one all-to-all delivers them, the owner dequantizes and sums in
                             float32. An int8 sum would overflow, so this cannot be a plain
                             reduce-scatter of int8.

Both are `shard_map` kernels over named mesh axes and know nothing of models. Beside each is
a plain reference (`*_reference`) computing the same numbers on the global array with no
collective, which the tests compare against. Quantization is symmetric and per block of
`block` consecutive elements of a device's local shard (flattened, the last block
zero-padded), so what a device sends depends only on what it holds.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

LEVELS = 127  # symmetric int8: codes in [-127, 127]


# ------------------------------------------------------------------ block quantization


def quantize(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """x (any shape) -> (int8 codes [blocks, block], float32 scales [blocks]). An x smaller
    than a block is one block of its own size (padding it would send zeros)."""
    block = min(block, x.size)
    flat = x.reshape(-1).astype(jnp.float32)
    flat = jnp.pad(flat, (0, -flat.size % block))
    blocks = flat.reshape(-1, block)
    scale = jnp.max(jnp.abs(blocks), axis=1) / LEVELS
    scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero block: any scale, codes are 0
    codes = jnp.clip(jnp.round(blocks / scale[:, None]), -LEVELS, LEVELS).astype(jnp.int8)
    return codes, scale


def dequantize(codes: jax.Array, scale: jax.Array, shape: Sequence[int], dtype) -> jax.Array:
    """Inverse of `quantize` up to rounding: back to `shape` and `dtype`."""
    flat = (codes.astype(jnp.float32) * scale[:, None]).reshape(-1)
    return flat[: math.prod(shape)].reshape(shape).astype(dtype)


def fake_quantize(x: jax.Array, block: int) -> jax.Array:
    """What `x` becomes after a quantized trip over the wire."""
    return dequantize(*quantize(x, block), x.shape, x.dtype)


# ------------------------------------------------------------------ spec helpers


def entries(spec: P, ndim: int) -> list[tuple[str, ...]]:
    """PartitionSpec -> one tuple of mesh axes per dimension."""
    padded = tuple(spec) + (None,) * (ndim - len(spec))
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in padded]


def gathered_axes(source: P, target: P, ndim: int) -> list[tuple[str, ...]]:
    """Per dimension, the mesh axes a gather from `source` to `target` removes.

    Each target entry must be a prefix of the source entry (the gathered axes minor-most),
    so gathering them leaves each device a contiguous block. Raises ValueError otherwise.
    """
    out = []
    for dim, (s, t) in enumerate(zip(entries(source, ndim), entries(target, ndim))):
        if s[: len(t)] != t:
            raise ValueError(
                f"dimension {dim}: cannot gather {P(*entries(source, ndim))} into {P(*entries(target, ndim))}; "
                "the target's mesh axes must be the leading ones of the source's"
            )
        out.append(s[len(t) :])
    return out


def per_shard(x: jax.Array, spec: P, mesh: Mesh, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Apply `fn` to every shard of `x` under `spec` separately, in one program (for references)."""
    degrees = [math.prod(mesh.shape[a] for a in e) for e in entries(spec, x.ndim)]
    local = [size // d for size, d in zip(x.shape, degrees)]
    split = x.reshape([v for pair in zip(degrees, local) for v in pair])
    order = list(range(0, 2 * x.ndim, 2)) + list(range(1, 2 * x.ndim, 2))
    shards = split.transpose(order).reshape(-1, *local)
    done = jax.vmap(fn)(shards).reshape(*degrees, *local)
    inverse = [i for pair in zip(range(x.ndim), range(x.ndim, 2 * x.ndim)) for i in pair]
    return done.transpose(inverse).reshape(x.shape)


# ------------------------------------------------------------------ qwZ


def quantized_all_gather(x: jax.Array, mesh: Mesh, source: P, target: P, block: int) -> jax.Array:
    """`x`, sharded as `source`, resharded to `target` by an int8 all-gather.

    Differentiable as the identity (a straight-through estimator): the cotangent is passed
    back unchanged and reduced by whoever reduces the parameter's gradient.
    """
    return _gather(x, mesh, source, target, block)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather(x, mesh, source, target, block):
    return _gather_kernel(x, mesh, source, target, block)


def _gather_fwd(x, mesh, source, target, block):
    return _gather_kernel(x, mesh, source, target, block), None


def _gather_bwd(mesh, source, target, block, _, cotangent):
    return (cotangent,)


# optimize_remat: under jax.checkpoint the gather is one opaque step (`remat_opt`) that a
# policy can refuse to save, so it is re-run for the backward pass like a plain all-gather.
_gather.defvjp(_gather_fwd, _gather_bwd, optimize_remat=True)


def _gather_kernel(x, mesh, source, target, block):
    # A shard_map may not be traced under a vmap with spmd_axis_name, which is how gradients
    # are taken per replica (jaxpar.step.replicas). Parameters are shared by the replicas,
    # so the gather needs no batching: the vmap rule runs it once, outside that vmap.
    @custom_vmap
    def gather(x):
        return _gather_body(x, mesh, source, target, block)

    @gather.def_vmap
    def _(axis_size, in_batched, x):
        if in_batched[0]:
            raise ValueError("quantized_all_gather gathers parameters shared by a vmap, not batched values")
        return gather(x), False

    return gather(x)


def _gather_body(x, mesh, source, target, block):
    per_dim = gathered_axes(source, target, x.ndim)
    axes = tuple(a for dim_axes in per_dim for a in dim_axes)
    if not axes:
        return x

    @partial(jax.shard_map, mesh=mesh, in_specs=source, out_specs=target, check_vma=False)
    def body(local):
        codes, scale = quantize(local, block)
        codes = jax.lax.all_gather(codes, axes)  # [n, blocks, block], n over `axes` row-major
        scale = jax.lax.all_gather(scale, axes)
        pieces = jax.vmap(lambda c, s: dequantize(c, s, local.shape, local.dtype))(codes, scale)
        return _assemble(pieces, [math.prod(mesh.shape[a] for a in g) for g in per_dim])

    return body(x)


def _assemble(pieces: jax.Array, counts: list[int]) -> jax.Array:
    """[prod(counts), *local] (pieces indexed row-major over dims) -> each dim i `counts[i]`
    times longer, pieces laid out in order."""
    local = pieces.shape[1:]
    ndim = len(local)
    split = pieces.reshape(*counts, *local)
    order = [i for pair in zip(range(ndim), range(ndim, 2 * ndim)) for i in pair]
    return split.transpose(order).reshape([c * s for c, s in zip(counts, local)])


def quantized_all_gather_reference(x: jax.Array, mesh: Mesh, source: P, block: int) -> jax.Array:
    """Plain equivalent of `quantized_all_gather`: every source shard quantized on its own."""
    return per_shard(x, source, mesh, lambda s: fake_quantize(s, block))


# ------------------------------------------------------------------ qgZ


def quantized_reduce_scatter(x: jax.Array, mesh: Mesh, axis: str, source: P, target: P, block: int) -> jax.Array:
    """Sum over the leading `axis`-sharded dimension of x [n, ...], through int8.

    x[i] is replica i's value, sharded as `source` over the other mesh axes; the result is
    sharded as `target`, which is `source` with `axis` appended (minor-most) to one dimension.
    Each device sends (n-1)/n of its shard as int8 once (an all-to-all) and sums n dequantized
    chunks in float32.
    """
    dim, n = _scattered_dim(x, mesh, axis, source, target)

    @partial(jax.shard_map, mesh=mesh, in_specs=P(axis, *entries(source, x.ndim - 1)), out_specs=target,
             check_vma=False)
    def body(local):
        chunks = _chunks(local[0], dim, n)  # [n, *chunk]: chunk j belongs to replica j
        codes, scale = jax.vmap(lambda c: quantize(c, block))(chunks)
        codes = jax.lax.all_to_all(codes, axis, 0, 0, tiled=True)  # [n sources, blocks, block]
        scale = jax.lax.all_to_all(scale, axis, 0, 0, tiled=True)
        parts = jax.vmap(lambda c, s: dequantize(c, s, chunks.shape[1:], jnp.float32))(codes, scale)
        return parts.sum(0).astype(x.dtype)

    return body(x)


def reduce_scatter_rounding(x: jax.Array, mesh: Mesh, axis: str, source: P, target: P, block: int) -> jax.Array:
    """x [n, ...] as `quantized_reduce_scatter` sends it: each replica's chunks rounded to
    int8 and back, in x's sharding. x minus this is what the rounding left out (error
    feedback adds it to the next value sent)."""
    dim, n = _scattered_dim(x, mesh, axis, source, target)
    spec = P(axis, *entries(source, x.ndim - 1))

    @partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    def body(local):
        mine = local[0]
        rounded = jax.vmap(lambda c: fake_quantize(c, block))(_chunks(mine, dim, n))
        return jnp.moveaxis(rounded, 0, dim).reshape(mine.shape)[None]

    return body(x)


def reduce_scatter_rounding_reference(x: jax.Array, mesh: Mesh, target: P, block: int) -> jax.Array:
    """Plain equivalent of `reduce_scatter_rounding`: each replica's value quantized per
    target shard."""
    return jnp.stack([per_shard(x[i], target, mesh, lambda s: fake_quantize(s, block)) for i in range(x.shape[0])])


def _scattered_dim(x: jax.Array, mesh: Mesh, axis: str, source: P, target: P) -> tuple[int, int]:
    """(the dimension of x[i] that `target` adds `axis` to, the size of `axis`)."""
    ndim = x.ndim - 1
    pairs = list(zip(entries(source, ndim), entries(target, ndim)))
    grown = [d for d, (s, t) in enumerate(pairs) if s != t]
    if len(grown) != 1 or pairs[grown[0]][1] != pairs[grown[0]][0] + (axis,):
        raise ValueError(f"target {target} must be source {source} with {axis!r} appended to one dimension")
    return grown[0], mesh.shape[axis]


def _chunks(mine: jax.Array, dim: int, n: int) -> jax.Array:
    """A shard cut into n along `dim`: [n, *chunk], chunk j the j-th piece."""
    shape = list(mine.shape)
    return jnp.moveaxis(mine.reshape(shape[:dim] + [n, shape[dim] // n] + shape[dim + 1:]), dim, 0)


def quantized_reduce_scatter_reference(x: jax.Array, mesh: Mesh, target: P, block: int) -> jax.Array:
    """Plain equivalent of `quantized_reduce_scatter`: each replica's value quantized per
    target shard, then summed in float32."""
    parts = [per_shard(x[i], target, mesh, lambda s: fake_quantize(s, block)) for i in range(x.shape[0])]
    return sum(p.astype(jnp.float32) for p in parts).astype(x.dtype)
