"""The experts' matmuls in FP8 with fine-grained scales (train.matmul_dtype=fp8), as
DeepSeek-V3 trained its experts, and the plain reference beside them.

Each product quantizes its two operands in blocks, each block with its own power-of-two
scale (jaxpar.kernels.fp8.quantize_blocks), b = train.fp8_expert_block:

  forward    y  = x . w     x (e4m3) in 1 x b tiles along the contraction, w (e4m3) in b x b blocks
  backward   dx = g . w^T   g (e5m2) in 1 x b tiles along w's outputs, w in b x b blocks
             dw = x^T . g   x and g in b x 1 tiles along the tokens

A dimension b does not divide gets tiles of their greatest common divisor. A contraction
of several blocks runs as one 8-bit matmul per block (batched), each accumulating in
float32 and scaled by its blocks' scales before the blocks are summed. XLA has no
block-scaled GEMM for Hopper (DeepSeek's DeepGEMM promotes the partial sums inside its
kernel), so these partial products go through memory: the numerics are DeepSeek's, the
speed is not. b = 0 keeps one scale per row of an activation and per column of a weight
over the whole contraction: one 8-bit GEMM a product, its scales applied to the output,
the form XLA's GPU compiler runs as a cuBLASLt FP8 GEMM. Dropless routing's dw contracts
rows that are ragged per expert, which no batched matmul cuts into tiles: there the
operands are rounded to FP8 in their tiles and multiplied as compute-dtype values (exact:
an e4m3 value times a power of two is a bf16 one), FP8's numerics at bf16's speed.

The operands are kept for the backward pass in the compute dtype (each product quantizes
its own); the plain reference, `reference_expert_matmul`, quantizes and dequantizes the
same blocks in float32 and multiplies in float32: the kernel equals it up to float32
rounding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxpar.kernels.experts.grouped import replica_mapped
from jaxpar.kernels.fp8 import FORWARD, GRADIENT, dequantize_blocks, expand_scales, quantize_blocks

DEEPSEEK_BLOCK = 128  # DeepSeek-V3's tiles (1 x 128) and blocks (128 x 128)


def tile(dim: int, block: int) -> int:
    """The tile along a dimension of `dim` for block size `block` (0: the whole dimension)."""
    return math.gcd(dim, block) if block else dim


def expert_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array | None = None, block: int = DEEPSEEK_BLOCK
                  ) -> jax.Array:
    """x . w in FP8, in x's dtype: x [E, C, K] against w [E, K, N] (an expert's rows each),
    or x [M, K] grouped by expert with `group_sizes` [E] against w [E, K, N] (rows past the
    groups give zeros). Gradients in their operands' dtypes."""
    if group_sizes is None:
        return _batched(block)(x, w)
    return _grouped(block)(x, w, group_sizes)


def reference_expert_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array | None = None,
                            block: int = DEEPSEEK_BLOCK) -> jax.Array:
    """The plain reference: every product's operands quantized in the kernel's blocks and
    dequantized in float32, one float32 matmul (einsum or ragged_dot) each."""

    @jax.custom_vjp
    def mm(x, w, group_sizes):
        return forward(x, w, group_sizes)[0]

    def forward(x, w, group_sizes):
        return _plain(_round_trip(x, _activation_blocks(x, block), FORWARD),
                      _round_trip(w, _weight_blocks(w, block), FORWARD), group_sizes).astype(x.dtype), (x, w, group_sizes)

    def backward(residuals, g):
        x, w, group_sizes = residuals
        wt = jnp.swapaxes(w, 1, 2)
        dx = _plain(_round_trip(g, _activation_blocks(g, block), GRADIENT),
                    _round_trip(wt, _weight_blocks(wt, block), FORWARD), group_sizes)
        dw = _plain_dw(_round_trip(x, _token_blocks(x, block), FORWARD), _round_trip(g, _token_blocks(g, block), GRADIENT),
                       group_sizes)
        return dx.astype(x.dtype), dw.astype(w.dtype), None

    mm.defvjp(forward, backward)
    return mm(x, w, group_sizes)


# The blocks of each operand, for an array laid out [..., rows, contraction] (an activation)
# or [E, contraction, outputs] (a weight).

def _activation_blocks(a: jax.Array, block: int) -> tuple[int, ...]:
    return (*(1,) * (a.ndim - 1), tile(a.shape[-1], block))


def _weight_blocks(w: jax.Array, block: int) -> tuple[int, ...]:
    return 1, tile(w.shape[1], block), tile(w.shape[2], block) if block else 1


def _token_blocks(x: jax.Array, block: int) -> tuple[int, ...]:
    """The blocks of x or g for dw = x^T . g, whose contraction is the tokens: b x 1 tiles."""
    return (*(1,) * (x.ndim - 2), tile(x.shape[-2], block), 1)


def _round_trip(a: jax.Array, blocks, dtype) -> jax.Array:
    return dequantize_blocks(*quantize_blocks(a, blocks, dtype))


def _plain(x, w, group_sizes):
    if group_sizes is None:
        return jnp.einsum("eck,ekn->ecn", x, w)
    return jax.lax.ragged_dot(x, w, group_sizes)


def _plain_dw(x, g, group_sizes):
    if group_sizes is None:
        return jnp.einsum("eck,ecn->ekn", x, g)
    return jax.lax.ragged_dot_general(x, g, group_sizes, _RAGGED_CONTRACTION)


_RAGGED_CONTRACTION = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


# Capacity routing: x [E, C, K], w [E, K, N].

@functools.cache
def _batched(block: int):
    @jax.custom_vjp
    def mm(x, w):
        return forward(x, w)[0]

    def forward(x, w):
        return _batched_product(x, w, block, FORWARD).astype(x.dtype), (x, w)

    def backward(residuals, g):
        x, w = residuals
        dx = _batched_product(g, jnp.swapaxes(w, 1, 2), block, GRADIENT)
        qx, sx = quantize_blocks(x, _token_blocks(x, block), FORWARD)  # sx [E, C/t, K]
        qg, sg = quantize_blocks(g, _token_blocks(g, block), GRADIENT)  # sg [E, C/t, N]
        dw = _blocked_dot(jnp.swapaxes(qx, 1, 2), jnp.swapaxes(sx, 1, 2), qg, sg)
        return dx.astype(x.dtype), dw.astype(w.dtype)

    mm.defvjp(forward, backward)
    return mm


def _batched_product(a: jax.Array, w: jax.Array, block: int, a_dtype) -> jax.Array:
    """a [E, M, K] . w [E, K, N] in float32, a in `a_dtype` tiles, w in e4m3 blocks."""
    qa, sa = quantize_blocks(a, _activation_blocks(a, block), a_dtype)  # sa [E, M, K/t]
    qw, sw = quantize_blocks(w, _weight_blocks(w, block), FORWARD)  # sw [E, K/t, N/u]
    return _blocked_dot(qa, sa, qw, expand_scales(sw, (1, 1, w.shape[2] // sw.shape[2])))


def _blocked_dot(qa: jax.Array, sa: jax.Array, qb: jax.Array, sb: jax.Array) -> jax.Array:
    """sum over contraction blocks k of (qa_k . qb_k) x sa_k x sb_k: qa [E, M, K] with
    scales sa [E, M, K/t], qb [E, K, N] with sb [E, K/t, N]. One 8-bit matmul per block,
    batched, accumulating in float32."""
    e, m, k = qa.shape
    n, blocks = qb.shape[2], sa.shape[2]
    t = k // blocks
    partial = jax.lax.dot_general(qa.reshape(e, m, blocks, t), qb.reshape(e, blocks, t, n),
                                  (((3,), (2,)), ((0, 2), (0, 1))), preferred_element_type=jnp.float32)  # [E, K/t, M, N]
    return jnp.einsum("ekmn,emk,ekn->emn", partial, sa, sb)


# Dropless routing: x [M, K] grouped by expert, w [E, K, N].

@functools.cache
def _grouped(block: int):
    forward_fn = replica_mapped(functools.partial(_grouped_product, block=block, a_dtype=FORWARD))
    backward_fn = replica_mapped(functools.partial(_grouped_backward, block=block))

    @jax.custom_vjp
    def mm(x, w, group_sizes):
        return forward(x, w, group_sizes)[0]

    def forward(x, w, group_sizes):
        return forward_fn(x, w, group_sizes).astype(x.dtype), (x, w, group_sizes)

    def backward(residuals, g):
        x, w, group_sizes = residuals
        dx, dw = backward_fn(x, w, group_sizes, g)
        return dx.astype(x.dtype), dw.astype(w.dtype), None

    mm.defvjp(forward, backward)
    return mm


def _grouped_product(a: jax.Array, w: jax.Array, group_sizes: jax.Array, block: int, a_dtype) -> jax.Array:
    """a [M, K] (rows grouped by expert) . w [E, K, N] in float32: one ragged 8-bit matmul
    per contraction block, batched; each row scaled by its expert's weight scales."""
    m, k = a.shape
    qa, sa = quantize_blocks(a, _activation_blocks(a, block), a_dtype)  # sa [M, K/t]
    qw, sw = quantize_blocks(w, _weight_blocks(w, block), FORWARD)  # sw [E, K/t, N/u]
    blocks, n, e = sa.shape[1], w.shape[2], w.shape[0]
    t = k // blocks
    partial = jax.lax.ragged_dot_general(
        jnp.swapaxes(qa.reshape(m, blocks, t), 0, 1), jnp.swapaxes(qw.reshape(e, blocks, t, n), 0, 1), group_sizes,
        _RAGGED_BLOCKS, preferred_element_type=jnp.float32)  # [K/t, M, N]
    expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right"), e - 1)
    sw_rows = expand_scales(sw[expert], (1, 1, n // sw.shape[2]))  # [M, K/t, N]
    return jnp.einsum("kmn,mk,mkn->mn", partial, sa, sw_rows)


def _grouped_backward(x, w, group_sizes, g, block: int):
    dx = _grouped_product(g, jnp.swapaxes(w, 1, 2), group_sizes, block, GRADIENT)
    rounded = lambda a, dtype: _round_trip(a, _token_blocks(a, block), dtype).astype(a.dtype)  # noqa: E731
    dw = jax.lax.ragged_dot_general(rounded(x, FORWARD), rounded(g, GRADIENT), group_sizes, _RAGGED_CONTRACTION,
                                    preferred_element_type=jnp.float32)
    return dx, dw


_RAGGED_BLOCKS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([2], [2]), ([0], [0])), lhs_ragged_dimensions=[1], rhs_group_dimensions=[1])
