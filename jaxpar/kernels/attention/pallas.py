"""The block forward of `blocks.forward` as one fused Pallas kernel: each program holds one
query tile of one head in registers and streams the key/value tiles of its kv head past it
with the online softmax, so score tiles never reach device memory.

It returns what the pure-JAX forward returns, the output in float32 and the log-normaliser
(natural log, float32, -inf for a row that sees nothing), so blocks merge exactly and the
pure-JAX `blocks.backward` recomputes from them: the backward never needs gradients through
the kernel (a fused kernel whose log-normaliser carries no gradient, like
`jax.nn.dot_product_attention(return_residual=True)`, is safe here for the same reason).

Masking follows each token's place in the sequence (q_index, kv_index) and its segment, so
the zigzag layout, ring steps and packed documents work unchanged; a key tile wholly in a
query tile's future is skipped (`lax.cond`).

Masking.kernel "pallas" lowers it with Pallas's Triton backend (GPUs), tiles capped at
TRITON_MAX_TILE; "pallas_interpret" runs the same kernel body in Pallas's interpreter, on any
backend (slow: for checking only). Triton wants a power-of-two head dimension of at least 16
and power-of-two tiles: heads are padded with zeros to such a size (and values to the
queries' size: multi-head latent attention), and `shape_problem` says which tile is missing
(the trainer asks it before compiling).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpar.kernels.attention.padding import same_head_dim
from jaxpar.kernels.attention.tiles import NEG_INF, Masking, needed_tiles, tile, tile_visible, visible

TRITON_MAX_TILE = 128  # a program's score tile stays in registers / shared memory


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def triton_tile(tile_length: int) -> int:
    """The tile the Triton kernel uses for a blockwise tile: the largest divisor within
    TRITON_MAX_TILE, so it still never crosses a layout chunk."""
    return tile(tile_length, TRITON_MAX_TILE)


def head_size(query_dim: int, value_dim: int) -> int:
    """The head size the Triton kernel runs: the larger of the two, up to a power of two of
    at least 16 (the heads are padded with zeros to it: jaxpar.kernels.attention.padding)."""
    return max(16, 1 << (max(query_dim, value_dim) - 1).bit_length())


def shape_problem(block_q: int, block_kv: int) -> str | None:
    """Why Triton could not lower the kernel for these tiles, or None."""
    for name, block in (("query", block_q), ("key", block_kv)):
        if block < 16 or not _power_of_two(block):
            return f"power-of-two tiles of at least 16 tokens, not a {name} tile of {block}"
    return None


def forward(q, k, v, q_index, kv_index, q_segment, kv_segment, masking: Masking):
    """Same contract as `blocks.forward`: q [B, Sq, G, R, K], k/v [B, Sk, G, K] ->
    (o float32 [B, Sq, G, R, K], lse [B, G, R, Sq], tiles computed)."""
    scale = q.shape[-1] ** -0.5
    interpret = masking.kernel == "pallas_interpret"
    # one tile shape serves q, k and v: heads padded with zeros to one size (MLA's values
    # are narrower), for Triton a power of two of at least 16
    (q, k, v), value_dim = same_head_dim(q, k, v, None if interpret else head_size(q.shape[-1], v.shape[-1]))
    b, sq, g, r, d = q.shape
    sk = k.shape[1]
    bq, bk = tile(sq, masking.block_q), tile(sk, masking.block_kv)
    if not interpret:
        bq, bk = triton_tile(bq), triton_tile(bk)
        problem = shape_problem(bq, bk)
        if problem:
            raise ValueError(f"the pallas attention kernel needs {problem}")
    has_seg = q_segment is not None
    heads = g * r

    per_q_tile = lambda bi, hi, qi: (bi, qi, hi, 0)  # noqa: E731
    per_kv_head = lambda bi, hi, qi: (bi, 0, hi // r, 0)  # noqa: E731  grouped-query: no repeated K/V
    in_specs = [
        pl.BlockSpec((None, bq, None, d), per_q_tile),
        pl.BlockSpec((None, sk, None, d), per_kv_head),
        pl.BlockSpec((None, sk, None, d), per_kv_head),
        pl.BlockSpec((bq,), lambda bi, hi, qi: (qi,)),
        pl.BlockSpec((sk,), lambda bi, hi, qi: (0,)),
    ]
    args = [q.reshape(b, sq, heads, d), k, v, q_index.astype(jnp.int32), kv_index.astype(jnp.int32)]
    if has_seg:
        in_specs += [pl.BlockSpec((None, bq), lambda bi, hi, qi: (bi, qi)), pl.BlockSpec((None, sk), lambda bi, hi, qi: (bi, 0))]
        args += [q_segment.astype(jnp.int32), kv_segment.astype(jnp.int32)]

    kernel = _kernel(bk, sk // bk, masking.causal, masking.window, has_seg, scale)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        compiler_params = pl_triton.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2)
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, heads, sq // bq),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, None, d), per_q_tile), pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi))],
        out_shape=[jax.ShapeDtypeStruct((b, sq, heads, d), jnp.float32), jax.ShapeDtypeStruct((b, heads, sq), jnp.float32)],
        compiler_params=compiler_params,
        interpret=interpret,
        name="jaxpar_block_attention",
    )(*args)
    tiles = needed_tiles(q_index, kv_index, bq, bk, masking.causal, masking.window)
    return o.reshape(q.shape)[..., :value_dim], lse.reshape(b, g, r, sq), tiles


def _kernel(bk: int, n_kv_tiles: int, causal: bool, window: int, has_seg: bool, scale: float):
    """The body one program runs: one query tile of one head against every key tile."""

    def kernel(q_ref, k_ref, v_ref, qi_ref, ki_ref, *refs):
        qs_ref, ks_ref, o_ref, lse_ref = refs if has_seg else (None, None, *refs)
        q = q_ref[...]
        q_index = qi_ref[...]
        q_seg = qs_ref[...] if has_seg else None
        bq, d = q.shape

        def kv_tile(t, carry):
            span = pl.ds(t * bk, bk)
            kv_index = ki_ref[span]

            def compute(acc, m, l):
                k, v = k_ref[span, :], v_ref[span, :]
                s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
                shown = visible(q_index, kv_index, causal, window)
                if has_seg:
                    shown = shown & (q_seg[:, None] == ks_ref[span][None, :])
                s = jnp.where(shown, s, NEG_INF)
                m_new = jnp.maximum(m, jnp.max(s, axis=1))
                safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row that has seen nothing yet
                p = jnp.exp(s - safe[:, None])
                rescale = jnp.exp(m - safe)
                pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
                return acc * rescale[:, None] + pv, m_new, l * rescale + jnp.sum(p, axis=1)

            if not causal:
                return compute(*carry)
            return jax.lax.cond(tile_visible(q_index, kv_index, causal, window), compute, lambda *c: c, *carry)

        init = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32))
        acc, m, l = jax.lax.fori_loop(0, n_kv_tiles, kv_tile, init)
        seen = l > 0
        o_ref[...] = acc / jnp.where(seen, l, 1.0)[:, None]
        lse_ref[...] = jnp.where(seen, jnp.where(m == NEG_INF, 0.0, m) + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)

    return kernel
