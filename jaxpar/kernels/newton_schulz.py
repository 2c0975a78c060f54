"""Newton-Schulz orthogonalisation (Muon's), of every matrix in an array, each matrix whole.

`newton_schulz(x)` orthogonalises one matrix: the plain reference. `orthogonalize(x,
axes)` does every matrix of a stack on one device. `orthogonalize_sharded(x, axes, spec,
mesh)` does the same to an array sharded as `spec`, where a matrix may be split over
devices (ZeRO, FSDP, tensor parallelism) and the iteration needs it whole. Inside one
shard_map:

0. several arrays whose matrices are cut the same way (`share_key`) join one local stack
   (`orthogonalize_together`), rounded to the iteration's dtype (bfloat16 halves what
   moves);
1. the local stack is padded with zero matrices to a multiple of the devices that share it;
2. mesh axes that hold none of the array (replicas) each take their slice of the stack;
3. an all-to-all per mesh axis that splits a matrix trades pieces of matrices for whole
   ones, so that each device holds whole matrices: a share of the stack;
4. the iteration runs on them, and steps 3 and 2 run backwards.

Every device works on its ceil(stack / devices) matrices, and each matrix's arithmetic is the
reference's: the sharded result equals `orthogonalize` (Moonlight's "distributed Muon"
gathers each matrix to every data-parallel rank instead; here a matrix goes to one owner).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.quantized import entries

# Keller Jordan's quintic coefficients (modded-nanogpt; Moonlight and optax use them too).
JORDAN_COEFFS = (3.4445, -4.7750, 2.0315)


@dataclasses.dataclass(frozen=True)
class MatrixAxes:
    """How an array is a stack of matrices: `batch` dims index them (a layer stack,
    experts), `rows` are each matrix's input side (contracted with the activations) and
    `cols` its output side. Every dim is in exactly one of them."""

    batch: tuple[int, ...]
    rows: tuple[int, ...]
    cols: tuple[int, ...]

    @property
    def order(self) -> tuple[int, ...]:
        return self.batch + self.rows + self.cols

    def shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """(rows, cols) of each matrix of an array of `shape`."""
        return math.prod(shape[d] for d in self.rows), math.prod(shape[d] for d in self.cols)

    def count(self, shape: Sequence[int]) -> int:
        return math.prod(shape[d] for d in self.batch)


def flops(shape: Sequence[int], axes: MatrixAxes, steps: int) -> float:
    """The iteration's matmul FLOPs on every matrix of an array of `shape`: per step, with
    m <= k the sides, X X^T (2 m^2 k), its square (2 m^3) and the product with X (2 m^2 k)."""
    m, k = sorted(axes.shape(shape))
    return axes.count(shape) * steps * (4 * m * m * k + 2 * m ** 3)


def newton_schulz(x: jax.Array, steps: int = 5, coeffs: Sequence[float] = JORDAN_COEFFS,
                  eps: float = 1e-7, dtype=jnp.float32) -> jax.Array:
    """One matrix [m, n] scaled to unit Frobenius norm, then `steps` quintic iterations
    X <- aX + (bA + cA^2)X, A = XX^T, on the wider orientation (X^T when m > n, as the
    iteration commutes with transposing). Near U V^T of the SVD U S V^T, with the singular
    values in about [0.7, 1.2] rather than all 1 (the coefficients trade accuracy for speed).

    `dtype`: what the iteration multiplies in (optim.ns_dtype). bfloat16 is Keller Jordan's
    and Moonlight's choice: the iteration only needs singular values near 1, not exact ones.
    The matrix is rounded to it first and its norm summed in float32; the result comes back
    in x's dtype."""
    a, b, c = coeffs
    given = x.dtype
    tall = x.shape[0] > x.shape[1]
    x = (x.T if tall else x).astype(dtype)
    wide = x.astype(jnp.float32)
    x = (wide / (jnp.linalg.norm(wide) + eps)).astype(dtype)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).astype(given)


@dataclasses.dataclass(frozen=True)
class Iteration:
    """The Newton-Schulz settings (optim.ns_steps, ns_coeffs, ns_dtype): one matrix
    orthogonalised by calling it."""

    steps: int = 5
    coeffs: tuple[float, float, float] = JORDAN_COEFFS
    eps: float = 1e-7
    dtype: str = "float32"

    def __call__(self, m: jax.Array) -> jax.Array:
        return newton_schulz(m, self.steps, self.coeffs, self.eps, jnp.dtype(self.dtype))


def orthogonalize(x: jax.Array, axes: MatrixAxes, iteration: Iteration = Iteration()) -> jax.Array:
    """Every matrix of `x` orthogonalised, on one device: the reference."""
    stacked = _stack(x, axes)
    done = jax.vmap(iteration)(stacked.reshape(-1, *axes.shape(x.shape)))
    return _unstack(done.reshape(stacked.shape), x.shape, axes)


def orthogonalize_sharded(x: jax.Array, axes: MatrixAxes, spec: P, mesh: Mesh, iteration: Iteration = Iteration(),
                          held: tuple[str, ...] = ()) -> jax.Array:
    """`orthogonalize(x, axes)` for `x` sharded as `spec` on `mesh` (the module docstring).
    `held`: mesh axes a vmap around the call maps over (DiLoCo's groups on `data`), whose
    devices hold different values, not replicas to share the work with."""
    return orthogonalize_together([x], [axes], [spec], mesh, iteration, held)[0]


def share_key(shape: Sequence[int], axes: MatrixAxes, spec: P, mesh: Mesh, held: tuple[str, ...] = ()) -> tuple:
    """Arrays with equal keys can be orthogonalised together (`orthogonalize_together`): on
    one mesh, their matrices' local pieces have one shape, made whole by the same
    all-to-alls and shared by the same replicas."""
    local = NamedSharding(mesh, spec).shard_shape(tuple(shape))
    dims = axes.rows + axes.cols
    split = tuple((a, dims.index(d)) for a, d in splitting_axes(spec, axes, mesh, len(shape)))
    return mesh, tuple(local[d] for d in dims), len(axes.rows), split, idle_axes(spec, mesh, held), held


def orthogonalize_together(xs: Sequence[jax.Array], axes: Sequence[MatrixAxes], specs: Sequence[P], mesh: Mesh,
                           iteration: Iteration = Iteration(), held: tuple[str, ...] = ()) -> list[jax.Array]:
    """`orthogonalize_sharded` of several arrays of one `share_key`, their stacks joined into
    one before they are spread (the module docstring): one set of all-to-alls for all of
    them, and the padding paid once, so that parameters whose stacks are shorter than the
    devices sharing them (a stage's few layers on many devices) fill each other's gaps.
    Each matrix's arithmetic is still the reference's. The pieces travel in the
    iteration's dtype."""
    keys = {share_key(x.shape, a, s, mesh, held) for x, a, s in zip(xs, axes, specs)}
    if len(keys) > 1:  # the exchange below is the first array's: another cut would come back scrambled
        raise ValueError(f"orthogonalize_together: arrays cut differently ({len(keys)} share keys); "
                         "group them by share_key")
    split = splitting_axes(specs[0], axes[0], mesh, xs[0].ndim)
    at = [1 + (axes[0].rows + axes[0].cols).index(dim) for _, dim in split]  # each all-to-all's piece dim
    idle = idle_axes(specs[0], mesh, held)
    ways = sharers(specs[0], axes[0], mesh, xs[0].ndim, held)
    row_dims = len(axes[0].rows)

    def body(*blocks: jax.Array) -> tuple[jax.Array, ...]:
        stacks = [_stack(b, a).astype(iteration.dtype) for b, a in zip(blocks, axes)]  # [stack, rows..., cols...]
        counts = [y.shape[0] for y in stacks]
        y = jnp.concatenate(stacks) if len(stacks) > 1 else stacks[0]
        y = jnp.concatenate([y, jnp.zeros((-y.shape[0] % ways, *y.shape[1:]), y.dtype)]) if y.shape[0] % ways else y
        if idle:
            share = y.shape[0] // _size(mesh, idle)
            y = lax.dynamic_slice_in_dim(y, lax.axis_index(idle) * share, share)
        for (axis, _), dim in zip(split, at):
            y = lax.all_to_all(y, axis, 0, dim, tiled=True)
        rows = math.prod(y.shape[1:1 + row_dims])
        y = jax.vmap(iteration)(y.reshape(y.shape[0], rows, -1)).reshape(y.shape)
        for (axis, _), dim in reversed(list(zip(split, at))):
            y = lax.all_to_all(y, axis, dim, 0, tiled=True)
        if idle:
            y = lax.all_gather(y, idle, axis=0, tiled=True)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return tuple(_unstack(y[s:s + n], b.shape, a).astype(b.dtype)
                     for s, n, b, a in zip(starts, counts, blocks, axes))

    sharded = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=tuple(specs), check_vma=False)
    return list(sharded(*xs))


def splitting_axes(spec: P, axes: MatrixAxes, mesh: Mesh, ndim: int) -> list[tuple[str, int]]:
    """(mesh axis, dim) for each mesh axis of size > 1 that splits a matrix dim of an array
    sharded as `spec`, the minor axis of a dim first: the all-to-alls that make matrices
    whole, in the order they run."""
    out = []
    for dim, names in enumerate(entries(spec, ndim)):
        if dim in axes.rows + axes.cols:
            out += [(a, dim) for a in reversed(names) if mesh.shape[a] > 1]
    return out


def idle_axes(spec: P, mesh: Mesh, held: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Mesh axes of size > 1 that hold none of an array sharded as `spec` (nor a vmap's
    values: `held`): its replicas, which share its stack out instead of each doing all of it."""
    used = {a for names in entries(spec, len(spec)) for a in names} | set(held)
    return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in used)


def sharers(spec: P, axes: MatrixAxes, mesh: Mesh, ndim: int, held: tuple[str, ...] = ()) -> int:
    """The devices one local stack is spread over: the mesh axes that split its matrices
    times its replicas. The stack is padded to a multiple of them."""
    return _size(mesh, [a for a, _ in splitting_axes(spec, axes, mesh, ndim)]) * _size(mesh, idle_axes(spec, mesh, held))


def parse_coeffs(text: str) -> tuple[float, float, float]:
    """optim.ns_coeffs ("a,b,c") as the iteration's three numbers; ValueError otherwise."""
    a, b, c = (float(v) for v in text.split(","))
    return a, b, c


def _size(mesh: Mesh, names: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in names)


def _stack(x: jax.Array, axes: MatrixAxes) -> jax.Array:
    """[matrices, rows..., cols...]: the batch dims first and merged."""
    moved = x.transpose(axes.order)
    return moved.reshape((-1, *moved.shape[len(axes.batch):]))


def _unstack(y: jax.Array, shape: Sequence[int], axes: MatrixAxes) -> jax.Array:
    """`_stack`'s inverse, for an array of `shape`."""
    moved = y.reshape(tuple(shape[d] for d in axes.order))
    return moved.transpose(tuple(axes.order.index(d) for d in range(len(shape))))
