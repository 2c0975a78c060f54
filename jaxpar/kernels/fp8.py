"""FP8 matmuls with per-tensor current scaling, as `train.matmul_dtype=fp8` runs the
projections (jaxpar.sharding.projections).

  forward    y  = (x/sx)_e4m3 . (w/sw)_e4m3 * sx*sw
  backward   dx = (g/sg)_e5m2 . (w/sw)_e4m3 * sg*sw
             dw = (x/sx)_e4m3 . (g/sg)_e5m2 * sx*sg

e4m3 (3 mantissa bits, range +-448) for weights and activations; e5m2 (range +-57344) for
gradients, whose range is wider. Each tensor's scale comes from its own absolute maximum
in this step ("current" scaling), rounded up to a power of two:
  - no scaling state: nothing to carry through microbatches, pipeline stages and
    checkpoints, and no overflow when a distribution jumps between steps (the failure of
    delayed scaling, which reads last steps' amax history);
  - a power of two divides exactly, so an element's 8-bit value depends only on itself and
    the exponent of the tensor's amax. Under FSDP or TP the amax is taken over the whole
    (logical) tensor, a scalar all-reduce, so every layout quantizes as one device does.
The cost is one more read of each operand for its amax, which XLA fuses into the op that
produces it. The forward keeps the 8-bit operands for the backward: half the bytes of bf16.

Dots take 8-bit operands and accumulate in float32, the form XLA's GPU compiler turns into
cuBLASLt FP8 GEMMs on Hopper (e4m3 x e4m3, e5m2 x e4m3); on CPU they run upcast. The plain
reference, `reference_tensordot`, quantizes and dequantizes in float32 and multiplies in
float32: the kernel equals it up to float32 rounding.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

FORWARD = jnp.float8_e4m3fn
GRADIENT = jnp.float8_e5m2


def _power_of_two(amax: jax.Array, dtype) -> jax.Array:
    """The float32 power of two by which a block whose largest magnitude is `amax` is divided
    to fill dtype's range; an all-zero block gets 1.
    2^ceil(log2(amax / max)) from the exponent's bits (frexp), never from a logarithm:
    XLA:CPU's log2 is not exact at powers of two in every fusion, and a ratio that is one
    (a block quantized before, whose maximum is 1.75 x 2^k) then got twice its scale in
    one program and not in another."""
    ratio = amax / float(jnp.finfo(dtype).max)
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa x 2^exponent, mantissa in [0.5, 1)
    power = jnp.ldexp(jnp.float32(1.0), jnp.where(mantissa == 0.5, exponent - 1, exponent))
    power = jnp.where(jnp.isfinite(ratio), power, ratio)  # a non-finite amax keeps the tensor non-finite
    return jnp.where(amax > 0, power, 1.0).astype(jnp.float32)


def quantize_blocks(x: jax.Array, blocks: tuple[int, ...], dtype) -> tuple[jax.Array, jax.Array]:
    """(x in dtype, scales): x cut into blocks of `blocks` elements along each axis (each
    dividing its axis: 1 gives every index its own scale, the axis's size one for all of
    it), each block divided by its own power-of-two scale (`_power_of_two`). The scales
    have one entry per block: shape [d // b for d, b in zip(x.shape, blocks)].

    A power of two divides exactly, so quantizing a block's dequantized values again with
    the same blocks gives back the same values: a payload quantized before an exchange
    loses nothing more when the matmul that reads it quantizes it again."""
    split = [n for d, b in zip(x.shape, blocks) for n in (d // b, b)]
    within = tuple(range(1, 2 * x.ndim, 2))
    xr = x.astype(jnp.float32).reshape(split)
    scales = _power_of_two(jnp.max(jnp.abs(xr), axis=within), dtype)
    return _saturated(xr / jnp.expand_dims(scales, within), dtype).reshape(x.shape), scales


def _saturated(v: jax.Array, dtype) -> jax.Array:
    """v (float32, already scaled) in dtype, clipped to its largest finite value."""
    limit = float(jnp.finfo(dtype).max)
    return jnp.clip(v, -limit, limit).astype(dtype)


def dequantize_blocks(q: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """`quantize_blocks` undone: each block times its scale, in dtype."""
    blocks = [d // n for d, n in zip(q.shape, scales.shape)]
    return (q.astype(jnp.float32) * expand_scales(scales, blocks)).astype(dtype)


def expand_scales(scales: jax.Array, blocks) -> jax.Array:
    """One scale an element: each block's scale repeated over its block."""
    for axis, b in enumerate(blocks):
        if b > 1:
            scales = jnp.repeat(scales, b, axis=axis)
    return scales


def quantize(x: jax.Array, dtype, over: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """(x / scale in dtype, scale): the whole tensor one block of `quantize_blocks`, its
    scalar scale; saturated at dtype's maximum (a non-finite x stays non-finite, for the
    step's guard to see). `over`: manual mesh axes x is split over, whose devices take the
    largest of their maxima (a scalar all-reduce), so each quantizes as the whole tensor."""
    if not over:
        q, scales = quantize_blocks(x, x.shape, dtype)
        return q, scales.reshape(())
    x = x.astype(jnp.float32)
    scale = _power_of_two(jax.lax.pmax(jnp.max(jnp.abs(x)), over), dtype)
    return _saturated(x / scale, dtype), scale


def _dot(a: jax.Array, b: jax.Array, contract_a: tuple[int, ...], contract_b: tuple[int, ...], scale: jax.Array,
         dtype) -> jax.Array:
    """a . b * scale, in `dtype`: the GEMM accumulates in float32 and writes `dtype`, and
    the power-of-two scale is exact in it. Written in `dtype`, a product sharded over its
    contraction (FSDP's weight gradients, tensor parallelism's row outputs) is summed
    across devices in `dtype`, as the compute dtype's matmuls are; a float32 product
    cast after was all-reduced in float32 (3.7x the bytes of ZeRO-3's bf16
    reduce-scatter, compiled for 8 H100s)."""
    product = jax.lax.dot_general(a, b, ((contract_a, contract_b), ((), ())), preferred_element_type=dtype)
    return product * scale.astype(dtype)


def fp8_tensordot(x: jax.Array, w: jax.Array, axes: int, gather: Callable | None = None,
                  rest: Callable | None = None, rows_over: tuple[str, ...] = ()) -> jax.Array:
    """jnp.tensordot(x, w, axes) (x's last `axes` dimensions against w's first) in FP8; the
    result in x's dtype, the gradients in their operands' dtypes.

    With `gather` (where `w` is used) and `rest` (where it rests), `w` is quantized where
    it rests: its shards are gathered as e4m3, one byte an element and one scale, instead
    of in the compute dtype, in the forward pass and again in the backward pass (the
    residual is the shard, as ZeRO-3 keeps no gathered weight), and its gradient leaves
    pinned to the shards, so it is reduce-scattered. The amax is the whole tensor's (a
    scalar all-reduce), so each gathered byte is the one quantizing the gathered weight
    gives: the values are those of this product on the gathered weight. `rows_over`: the
    manual mesh axes x's leading dimensions (and the gradient's) are split over (the pipeline
    executor's rows): their amax is taken over those devices too, so each quantizes as one
    device holding every row does."""
    batch = x.ndim - axes  # x's leading, uncontracted dimensions; the gradient's too
    gather, rest = gather or (lambda a: a), rest or (lambda a: a)

    @jax.custom_vjp
    def dot(x, w):
        return forward(x, w)[0]

    def forward(x, w):
        qx, sx = quantize(x, FORWARD, rows_over)
        qw, sw = quantize(w, FORWARD)
        qw = rest(qw)  # quantized where it rests, so a gather moves bytes
        y = _dot(qx, gather(qw), tuple(range(batch, x.ndim)), tuple(range(axes)), sx * sw, x.dtype)
        return y, (_bytes(qx), sx, _bytes(qw), sw)

    def backward(residuals, g):
        bx, sx, bw, sw = residuals
        qx, qw = _fp8(bx), gather(_fp8(bw))
        qg, sg = quantize(g, GRADIENT, rows_over)
        dx = _dot(qg, qw, tuple(range(batch, qg.ndim)), tuple(range(axes, qw.ndim)), sg * sw, x.dtype)
        dw = _dot(qx, qg, tuple(range(batch)), tuple(range(batch)), sx * sg, w.dtype)
        return dx, rest(dw)

    dot.defvjp(forward, backward)
    return dot(x, w)


def _bytes(q: jax.Array) -> jax.Array:
    """An e4m3 residual kept for the backward as its raw bytes (the same 8 bits, reread by
    `_fp8`). Kept as float8, residuals made NaN losses inside pipeline stages on XLA:CPU
    (jaxlib 0.12): the same program with the same bytes typed uint8 computes the float32
    reference's losses exactly (tests/equivalence/test_fp8.py runs FP8 in stages)."""
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def _fp8(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(b, FORWARD)


def reference_tensordot(x: jax.Array, w: jax.Array, axes: int) -> jax.Array:
    """The plain reference: each operand quantized and dequantized in float32, one float32
    tensordot, the gradient quantized the same way on its way back."""

    @jax.custom_vjp
    def dot(x, w):
        return forward(x, w)[0]

    def forward(x, w):
        y = jnp.tensordot(_round_trip(x, FORWARD), _round_trip(w, FORWARD), axes=axes)
        return y.astype(x.dtype), (x, w)

    def backward(residuals, g):
        x, w = residuals
        dx, dw = jax.vjp(lambda x, w: jnp.tensordot(x, w, axes=axes),
                         _round_trip(x, FORWARD), _round_trip(w, FORWARD))[1](_round_trip(g, GRADIENT))
        return dx.astype(x.dtype), dw.astype(w.dtype)

    dot.defvjp(forward, backward)
    return dot(x, w)


def _round_trip(x: jax.Array, dtype) -> jax.Array:
    q, scale = quantize(x, dtype)
    return q.astype(jnp.float32) * scale
