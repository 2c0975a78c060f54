"""Blockwise attention on one device (no collectives), differentiable with a recomputing
backward pass: `blocks.forward` / `blocks.backward` behind a custom VJP, the same pair the
context-parallel kernels call per block; usable alone."""

from __future__ import annotations

from functools import partial

import jax

from jaxpar.kernels.attention import blocks
from jaxpar.kernels.attention.tiles import Masking


def out_shape(q: jax.Array, v: jax.Array) -> tuple[int, ...]:
    """The attention output's shape: the queries' but for the last axis, the values' head
    size (which may differ from the queries' and keys', as in MLA)."""
    return (*q.shape[:-1], v.shape[-1])


def grouped(q_BSHK: jax.Array, kv_heads: int) -> jax.Array:
    """[B, S, H, K] -> [B, S, G, H/G, K]: query heads grouped by the kv head they share."""
    b, s, h, k = q_BSHK.shape
    return q_BSHK.reshape(b, s, kv_heads, h // kv_heads, k)


def flash_attention(q, k, v, q_index, kv_index, q_segment=None, kv_segment=None, masking: Masking = Masking()):
    """q [B, Sq, H, K], k [B, Sk, G, K], v [B, Sk, G, V] -> [B, Sq, H, V]; O(Sq x block)
    memory per head."""
    o, _ = _flash(q, k, v, q_index, kv_index, q_segment, kv_segment, masking)
    return o


@partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, q_index, kv_index, q_segment, kv_segment, masking):
    o, lse, _ = blocks.forward(grouped(q, k.shape[2]), k, v, q_index, kv_index, q_segment, kv_segment, masking)
    return o.reshape(out_shape(q, v)).astype(q.dtype), lse


def _flash_fwd(q, k, v, q_index, kv_index, q_segment, kv_segment, masking):
    o, lse = _flash(q, k, v, q_index, kv_index, q_segment, kv_segment, masking)
    return (o, lse), (q, k, v, o, lse, q_index, kv_index, q_segment, kv_segment)


def _flash_bwd(masking, res, cotangents):
    q, k, v, o, lse, q_index, kv_index, q_segment, kv_segment = res
    do, _ = cotangents  # lse is an internal residual: its cotangent is not propagated
    g = k.shape[2]
    dq, dk, dv = blocks.backward(
        grouped(q, g), k, v, grouped(o, g), lse, grouped(do, g), q_index, kv_index, q_segment, kv_segment, masking
    )
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
