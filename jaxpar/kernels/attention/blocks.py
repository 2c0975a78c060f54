"""Attention one device computes: tiles of queries against tiles of keys with an online
softmax (FlashAttention-2's recurrence), in pure JAX, plus the matching backward pass.

Every context-parallel kernel is built from these two functions. They never materialise
more than a [block_q x block_kv] score tile per head, so memory grows linearly with the
sequence. A tile whose keys all lie after its queries (causal), or all before their sliding
window, is skipped with `lax.cond`
and counted, so the work a device does can be read back from the kernel itself.

Shapes (G kv heads, R query heads per kv head):
  q  [B, Sq, G, R, K]     k, v [B, Sk, G, K]     o [B, Sq, G, R, K]
  lse [B, G, R, Sq] float32 (log of the softmax denominator; -inf for a row that sees nothing)
  q_index [Sq], kv_index [Sk]: each token's place in the whole sequence (causal masking)
  q_segment [B, Sq], kv_segment [B, Sk] or None: tokens attend only inside their segment
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.kernels.attention.tiles import NEG_INF, Masking, tile, tile_visible, visible

def _tiles(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Split `axis` into [n_tiles, size] and move the tile index to the front."""
    shape = x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _untile(x: jax.Array, axis: int) -> jax.Array:
    """Inverse of `_tiles`: [n_tiles, ..., size, ...] -> [..., n_tiles * size, ...]."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2 :])


def _mask(q_index, kv_index, q_segment, kv_segment, masking: Masking) -> jax.Array:
    """[B or 1, 1, 1, bq, bk] visibility of each key to each query."""
    shown = visible(q_index, kv_index, masking.causal, masking.window)[None, None, None]
    if q_segment is not None:
        same = q_segment[:, :, None] == kv_segment[:, None, :]
        shown = shown & same[:, None, None]
    return shown


def _scores(q, k, visible) -> jax.Array:
    """Scaled, masked logits [B, G, R, bq, bk] in float32."""
    s = jnp.einsum("bqgrk,bsgk->bgrqs", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    return jnp.where(visible, s, NEG_INF)


def forward(q, k, v, q_index, kv_index, q_segment, kv_segment, masking: Masking):
    """(o float32, lse, tiles computed): attention of `q` over this block of keys only.
    Blocks combine exactly with `merge`."""
    if masking.kernel != "jax":
        from jaxpar.kernels.attention import pallas

        return pallas.forward(q, k, v, q_index, kv_index, q_segment, kv_segment, masking)
    bq, bk = tile(q.shape[1], masking.block_q), tile(k.shape[1], masking.block_kv)
    has_seg = q_segment is not None
    kt, vt, kit = _tiles(k, 1, bk), _tiles(v, 1, bk), _tiles(kv_index, 0, bk)
    kst = _tiles(kv_segment, 1, bk) if has_seg else None

    def one_q_tile(args):
        q_t, qi_t, qs_t = args
        b, _, g, r, _ = q_t.shape
        d = v.shape[-1]  # the output's head size is the values' (MLA: not the queries')

        def kv_step(carry, kv):
            acc, m, l, count = carry
            k_t, v_t, ki_t, ks_t = kv

            def compute(acc, m, l):
                s = _scores(q_t, k_t, _mask(qi_t, ki_t, qs_t, ks_t, masking))
                m_new = jnp.maximum(m, s.max(-1))
                safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row that has seen nothing yet
                p = jnp.exp(s - safe[..., None])
                scale = jnp.exp(m - safe)
                l = l * scale + p.sum(-1)
                pv = jnp.einsum("bgrqs,bsgk->bqgrk", p.astype(v_t.dtype), v_t, preferred_element_type=jnp.float32)
                acc = acc * jnp.moveaxis(scale, -1, 1)[..., None] + pv
                return acc, m_new, l

            seen = tile_visible(qi_t, ki_t, masking.causal, masking.window)
            acc, m, l = jax.lax.cond(seen, compute, lambda *c: c, acc, m, l)
            return (acc, m, l, count + seen.astype(jnp.int32)), None

        init = (
            jnp.zeros((b, bq, g, r, d), jnp.float32),
            jnp.full((b, g, r, bq), NEG_INF, jnp.float32),
            jnp.zeros((b, g, r, bq), jnp.float32),
            jnp.int32(0),
        )
        (acc, m, l, count), _ = jax.lax.scan(kv_step, init, (kt, vt, kit, kst))
        o = acc / jnp.moveaxis(jnp.where(l == 0, 1.0, l), -1, 1)[..., None]
        lse = jnp.where(l == 0, NEG_INF, jnp.where(m == NEG_INF, 0.0, m) + jnp.log(jnp.where(l == 0, 1.0, l)))
        return o, lse, count

    qs = _tiles(q_segment, 1, bq) if has_seg else None
    o, lse, counts = jax.lax.map(one_q_tile, (_tiles(q, 1, bq), _tiles(q_index, 0, bq), qs))
    return _untile(o, 1), _untile(lse, 3), counts.sum()


def merge(o1, lse1, o2, lse2):
    """Combine attention over two disjoint key sets: softmax-weighted by their denominators."""
    lse = jnp.logaddexp(lse1, lse2)
    safe = jnp.where(lse == NEG_INF, 0.0, lse)
    w1 = jnp.moveaxis(jnp.exp(lse1 - safe), -1, 1)[..., None]
    w2 = jnp.moveaxis(jnp.exp(lse2 - safe), -1, 1)[..., None]
    return o1 * w1 + o2 * w2, lse


def backward(q, k, v, o, lse, do, q_index, kv_index, q_segment, kv_segment, masking: Masking):
    """(dq, dk, dv) in float32 for this block of keys, given the final `o` and `lse` of the
    full attention (so per-block contributions simply add up)."""
    bq, bk = tile(q.shape[1], masking.block_q), tile(k.shape[1], masking.block_kv)
    has_seg = q_segment is not None
    delta = jnp.einsum("bqgrk,bqgrk->bgrq", do.astype(jnp.float32), o.astype(jnp.float32))
    safe_lse = jnp.where(lse == NEG_INF, 0.0, lse)
    q_tiles = (
        _tiles(q, 1, bq),
        _tiles(do, 1, bq),
        _tiles(safe_lse, 3, bq),
        _tiles(delta, 3, bq),
        _tiles(q_index, 0, bq),
        _tiles(q_segment, 1, bq) if has_seg else None,
    )
    scale = q.shape[-1] ** -0.5

    def one_kv_tile(args):
        k_t, v_t, ki_t, ks_t = args

        def q_step(carry, qa):
            dk, dv = carry
            q_t, do_t, lse_t, delta_t, qi_t, qs_t = qa

            def compute(dk, dv):
                s = _scores(q_t, k_t, _mask(qi_t, ki_t, qs_t, ks_t, masking))
                p = jnp.exp(s - lse_t[..., None])  # masked logits are -inf: p = 0 there
                # Matmul operands in the inputs' dtype (bf16 runs at bf16 rate), sums in float32.
                f32 = dict(preferred_element_type=jnp.float32)
                dv = dv + jnp.einsum("bgrqs,bqgrk->bsgk", p.astype(do_t.dtype), do_t, **f32)
                dp = jnp.einsum("bqgrk,bsgk->bgrqs", do_t, v_t.astype(do_t.dtype), **f32)
                ds = p * (dp - delta_t[..., None]) * scale
                dq = jnp.einsum("bgrqs,bsgk->bqgrk", ds.astype(k_t.dtype), k_t, **f32)
                dk = dk + jnp.einsum("bgrqs,bqgrk->bsgk", ds.astype(q_t.dtype), q_t, **f32)
                return dk, dv, dq

            skip = lambda dk, dv: (dk, dv, jnp.zeros(q_t.shape, jnp.float32))
            dk, dv, dq = jax.lax.cond(tile_visible(qi_t, ki_t, masking.causal, masking.window), compute, skip, dk, dv)
            return (dk, dv), dq

        zeros = (jnp.zeros(k_t.shape, jnp.float32), jnp.zeros(v_t.shape, jnp.float32))
        (dk, dv), dq_parts = jax.lax.scan(q_step, zeros, q_tiles)
        return dk, dv, _untile(dq_parts, 1)

    kv_tiles = (_tiles(k, 1, bk), _tiles(v, 1, bk), _tiles(kv_index, 0, bk), _tiles(kv_segment, 1, bk) if has_seg else None)

    def accumulate(dq, kv):
        dk, dv, dq_part = one_kv_tile(kv)
        return dq + dq_part, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(accumulate, jnp.zeros(q.shape, jnp.float32), kv_tiles)
    return dq, _untile(dk, 1), _untile(dv, 1)
