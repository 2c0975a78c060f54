"""What the experts' dispatch carries (parallel.expert_dispatch_dtype): the tokens in the
compute dtype, or in FP8 as DeepSeek-V3 sent them.

fp8   each token's row cut into 1 x 128 tiles (their greatest common divisor with a
      shorter row), each tile e4m3 with a float32 power-of-two scale: per bf16 element,
      1 + 4/128 bytes instead of 2 (0.52x). The bytes travel as uint8 (one all-to-all),
      the scales beside them (a second), and are dequantized to the compute dtype on
      arrival. The expert matmul that reads them in FP8 (train.matmul_dtype=fp8, the same
      1 x 128 tiles) quantizes them again to the same values: nothing is lost twice.

The quantization applies whether or not an exchange moves the rows (one device, or
expert-parallel degree 1), so every layout computes the same values. Only the dispatch
is quantized: the combine and the backward pass's exchanges (the gradient of the
dispatch goes back through the exchange's transpose) stay in the compute dtype, and the
gradient passes the rounding straight through.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxpar.kernels.experts.fp8 import DEEPSEEK_BLOCK, tile
from jaxpar.kernels.fp8 import FORWARD, dequantize_blocks, quantize_blocks


def dispatched(x: jax.Array, move: Callable, *aux: jax.Array, dtype: str = "compute") -> jax.Array:
    """move(x, *aux), x's rows moved by a linear exchange (an all-to-all) that is
    indifferent to the length of the last axis; with dtype fp8, as e4m3 tiles and their
    scales. `aux` (offsets, sizes) are not differentiated."""
    if dtype == "compute":
        return move(x, *aux)
    blocks = (*(1,) * (x.ndim - 1), tile(x.shape[-1], DEEPSEEK_BLOCK))

    @jax.custom_vjp
    def send(x, *aux):
        q, scales = quantize_blocks(x, blocks, FORWARD)
        moved = move(jax.lax.bitcast_convert_type(q, jnp.uint8), *aux)  # bytes: the same 8 bits on any backend
        return dequantize_blocks(jax.lax.bitcast_convert_type(moved, FORWARD), move(scales, *aux), x.dtype)

    def forward(x, *aux):
        return send(x, *aux), aux

    def backward(aux, g):
        _, transpose = jax.vjp(lambda v: move(v, *aux), jnp.zeros(x.shape, g.dtype))
        return (*transpose(g), *(None,) * len(aux))

    send.defvjp(forward, backward)
    return send(x, *aux)
