"""Building blocks models use to stay parallelism-agnostic: a layer stack run with
`lax.scan` (compile time independent of depth) and activation recomputation chosen by name.

Remat policies (per layer of a scanned stack):
  none       save what the backward pass needs, except parameters gathered for use
  full       save only each layer's input; recompute the whole layer in the backward pass
  selective  save the linear layers' inputs and outputs (the names in SELECTIVE_SAVED);
             the attention core (scores, softmax, probabilities: the s^2-sized part) and the
             element-wise rest are recomputed (Korthikanti et al., arXiv 2205.05198)
  offload    like full, but each layer's input is kept in pinned host memory
  dots       save matmul outputs, recompute the element-wise rest
  dots_no_batch  save only matmuls without batch dimensions (weight-only products)
  (selective, dots and dots_no_batch also keep a context-parallel attention kernel's
  residuals and cuDNN's fused attention's outputs, which their backward reads, rather than
  run the ring or the kernel again: a blockwise kernel has no s^2 part to drop. The kernel
  is one opaque step to every policy, so no policy keeps its score tiles; full and offload
  run it again. Likewise they keep the buffers the
  MoE all-to-alls deliver, so only full and offload exchange tokens again.)

No policy saves a gathered parameter: under FSDP / ZeRO-3 a weight is all-gathered again for
the backward pass rather than kept whole per layer, which would cost 2 bytes per parameter
of every layer and undo the sharding. Every policy saves hpZ's in-host secondary shard
(HPZ_NAME), the point of which is that the backward gather starts from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, get_args

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.choices import Remat
from jaxpar.kernels.attention.context import RESIDUALS_NAME
from jaxpar.kernels.experts.exchange import EXCHANGED_NAME
from jaxpar.sharding import HPZ_NAME, active_layout
from jaxpar.sharding.kv_cache import active_cache, run_nested
from jaxpar.sharding.layer_hooks import take_layer_hooks

REMAT_POLICIES = get_args(Remat)
# The policies that keep nothing named RESIDUALS_NAME or EXCHANGED_NAME: a context-parallel
# attention kernel runs its forward (ring hops included) again in the backward pass, and the
# MoE layers their forward all-to-alls.
RECOMPUTES_ATTENTION = ("full", "offload")
OFFLOADED_NAME = "layer_input"  # what the offload policy moves to host memory
# What `selective` keeps: the inputs and outputs of the linear layers, as models name them
# with `jax.ad_checkpoint.checkpoint_name`; everything else (norms, RoPE, the attention
# core) is recomputed.
SELECTIVE_SAVED = ("layer_input", "qkv", "attention_out", "mlp_hidden", "residual")


# cuDNN's fused attention (jax.nn.dot_product_attention), by its forward primitive's name:
# its outputs (the attention and each row's softmax statistics) are what its backward
# reads, so the policies that keep matmuls keep them, rather than run the kernel again
# (0.9B Llama, H100, remat dots: 4.5 ms a step, benchmarks/results/step_kernels.json).
FUSED_ATTENTION = ("dot_product_attention_fwd",)


# Outputs recomputed from their (saved) inputs rather than stored: sharding constraints mark
# gathered parameters and resharded activations. The int8 parameter gather
# (jaxpar.kernels.quantized) appears to a policy as `remat_opt` (its custom VJP), or as
# `custom_vmap_call` under the per-replica vmap (its custom batching rule).
LAYOUT_CHANGES = ("sharding_constraint", "remat_opt", "custom_vmap_call")


def _not_a_layout_change(prim: Any, *_, **__) -> bool:
    return prim.name not in LAYOUT_CHANGES


def _both(a: Callable, b: Callable) -> Callable:
    return lambda prim, *args, **params: a(prim, *args, **params) and b(prim, *args, **params)


def _either(a: Callable, b: Callable) -> Callable:
    return lambda prim, *args, **params: a(prim, *args, **params) or b(prim, *args, **params)


def _fused_attention(prim: Any, *_, **__) -> bool:
    return prim.name.startswith(FUSED_ATTENTION)


def layer_policy(remat: str) -> Callable:
    """The jax.checkpoint policy applied to each layer for a remat name."""
    cp = jax.checkpoint_policies
    hpz = cp.save_only_these_names(HPZ_NAME)
    # the attention kernels' outputs, and what the expert all-to-alls deliver
    kept_like_matmuls = _either(cp.save_only_these_names(HPZ_NAME, RESIDUALS_NAME, EXCHANGED_NAME), _fused_attention)
    if remat == "none":
        return _not_a_layout_change
    if remat == "selective":
        return _either(cp.save_only_these_names(*SELECTIVE_SAVED), kept_like_matmuls)
    if remat == "full":
        return hpz
    if remat == "dots":
        return _either(_both(cp.dots_saveable, _not_a_layout_change), kept_like_matmuls)
    if remat == "dots_no_batch":
        return _either(_both(cp.dots_with_no_batch_dims_saveable, _not_a_layout_change), kept_like_matmuls)
    if remat == "offload":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[HPZ_NAME],
            names_which_can_be_offloaded=[OFFLOADED_NAME],
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise ValueError(f"remat={remat!r}; use one of {', '.join(REMAT_POLICIES)}")


def param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], fan_in: int) -> nnx.Param:
    """A float32 weight drawn from N(0, 1 / fan_in), annotated with its logical axis `names`."""
    init = nnx.initializers.normal(stddev=fan_in**-0.5)
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, jnp.float32))


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs,
                 axis_name: str = "layers") -> nnx.Module:
    """`num_layers` independently initialised copies of a layer, parameters stacked on a
    leading axis named `axis_name`: "layers" (pipeline stages split it), or a name of the
    model's own for a second stack (DeepSeek's dense first layers)."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis_name})
    def make(rngs: nnx.Rngs) -> nnx.Module:
        return make_layer(rngs)

    return make(rngs)


def scan_layers(layers: nnx.Module, x: jax.Array, *args: Any, remat: str = "none", unroll: bool = False,
                first_layer: jax.Array | int | None = None) -> Any:
    """Run a stack made by `stack_layers`: x = layer_i(x, *args) for each layer in turn.

    `first_layer`: each layer is called with its index in the whole model as a last
    argument, first_layer + i (a traced integer), for a model whose layers differ by kind
    (Gemma 3's local and global attention); a pipeline stage's stack starts past 0.

    Each step sees one layer's parameters, so FSDP gathers (`compute_value`) happen one
    layer at a time, and the remat policy applies per layer. A layer may return (x, report):
    the reports are stacked on a leading layer axis and returned beside x. Hooks the trainer
    bound to the stacked parameters (jaxpar.sharding.layer_hooks) run on each layer's slice.

    `unroll`: the compiled program holds every layer in line instead of one loop body. XLA
    then keeps each layer's saved activations as buffers of their own rather than copying
    them into stacks it first fills with zeros (the loop's cost: 0.9B Llama on an H100, in
    benchmarks/results/predictions.json), at the price of a compile that grows with the
    depth. A policy's recomputation is then kept from being merged back into the forward
    pass (`prevent_cse`), so remat saves the memory it does in the loop.

    Under parallel.two_batch_overlap each layer runs on two halves of the rows (`on_halves`).
    """
    policy = layer_policy(remat)
    graphdef, stacked = nnx.split(layers)
    leaves, treedef = jax.tree.flatten(stacked)
    states, hooks = take_layer_hooks(leaves)
    cache = active_cache()  # sampling: the stack's key/value cache entry, a layer's slice a step
    layout = active_layout()
    halves = cache is None and layout is not None and layout.two_batch_overlap and x.ndim >= 2 and x.shape[0] % 2 == 0

    def body(carry: jax.Array, xs: tuple[list, list, Any, Any]) -> tuple[jax.Array, Any]:
        carry = checkpoint_name(carry, OFFLOADED_NAME)
        leaves, states, index, cached = xs
        layer = [x if hook is None else hook(x, state) for x, state, hook in zip(leaves, states, hooks)]
        extra = () if index is None else (index,)
        call = nnx.merge(graphdef, jax.tree.unflatten(treedef, layer))
        if cache is not None:
            out, cached = run_nested(cache, cached, call, carry, *args, *extra)
        else:
            out = on_halves(call, carry, *args, *extra) if halves else call(carry, *args, *extra)
        out, report = out if isinstance(out, tuple) else (out, None)
        return out, (report, cached)

    n = leaves[0].shape[0]
    # A loop of one layer is that layer: in line, its offloaded activations reach host memory,
    # where the GPU compiler loses them from a one-trip loop (models/moe.py's runs of one
    # layer under model.remat=offload: benchmarks/gpu_compile.py).
    unroll = unroll or n == 1
    # In a loop XLA cannot merge the recomputed forward with the first one, so prevent_cse's
    # barriers are needed (and paid for) only when unrolled, and only where the policy
    # recomputes more than layout changes.
    step = jax.checkpoint(body, policy=policy, prevent_cse=unroll and remat != "none")
    index = None if first_layer is None else jnp.asarray(first_layer, jnp.int32) + jnp.arange(n, dtype=jnp.int32)
    given = None if cache is None else cache.next_given()
    out, (reports, cached) = jax.lax.scan(step, x, (leaves, states, index, given), unroll=unroll)
    if cache is not None:
        cache.made.append(cached)
    return out if reports is None else (out, reports)


def on_halves(fn: Callable, x: jax.Array, *args: Any) -> Any:
    """fn(x, *args) as two calls on halves of the rows, joined: two independent chains in one
    program, so the scheduler can run one half's collectives (an expert all-to-all) while
    the other half computes (parallel.two_batch_overlap). Row 2i + h goes to half h, so each
    device splits its own rows. An argument whose leading axis is the rows' (ndim >= 2) is
    split with x; the others go to both. Of what fn returns, arrays with a leading rows axis
    are joined back in order, the rest are added: a layer's report must then hold, besides
    per-row values, only sums over the rows (MoE's expert counts)."""
    rows = x.shape[0]
    per_row = lambda a: isinstance(a, jax.Array) and a.ndim >= 2 and a.shape[0] == rows  # noqa: E731
    half = lambda a, h: a.reshape(rows // 2, 2, *a.shape[1:])[:, h] if per_row(a) else a  # noqa: E731
    outs = [fn(*(half(a, h) for a in (x, *args))) for h in (0, 1)]
    whole = jax.eval_shape(fn, x, *args)

    def join(shape, a, b):
        if a.shape == shape.shape:
            return a + b
        return jnp.stack([a, b], axis=1).reshape(shape.shape)

    return jax.tree.map(join, whole, *outs)


# The named scope of a layer's switch over its kinds: jaxpar.inspect counts each branch by the
# share of layers of its kind (the model's layer_windows), not once each.
KIND_SCOPE = "layer_kind"


def window_kinds(windows: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the distinct windows of a model's layers, ascending; each layer's index among them): a
    layer's kind, the branch `by_kind` runs for it."""
    distinct = tuple(sorted(set(windows)))
    return distinct, tuple(distinct.index(w) for w in windows)


def by_kind(kind: Any, branches: Sequence[Callable], *operands: Any) -> Any:
    """branches[kind](*operands): the branch alone where `kind` is a Python int, else a
    `lax.switch` (under KIND_SCOPE) whose branches each keep their static choices (a window
    every attention kernel sees fixed), for a layer whose kind is its traced index's."""
    if isinstance(kind, int):
        return branches[kind](*operands)
    cache = active_cache()  # sampling: the branches' key/value cache entries leave through the switch
    if cache is not None:
        given = cache.next_given()
        branches = [lambda *ops, branch=branch: run_nested(cache, given, branch, *ops) for branch in branches]
    with jax.named_scope(KIND_SCOPE):
        out = jax.lax.switch(kind, list(branches), *operands)
    if cache is None:
        return out
    cache.made.append(out[1])
    return out[0]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x / rms(x) x (offset + scale) over the last axis, in float32, returned in x's dtype.

    Its backward pass keeps only x and each row's 1 / rms (float32, one value a row) and
    rebuilds the rest in one pass: plain autodiff of the same lines keeps float32 copies
    of x and of x / rms(x), which a scanned layer stack writes into stacks twice the
    activations' size and reads back (0.9B Llama on an H100, remat none: about 19 ms of a
    0.23 s step, benchmarks/results/step_kernels.json). Equal to `rms_norm_reference` in
    values and gradients up to float32 rounding (tests/unit/test_nn.py)."""
    return _rms_norm(x, scale, eps, offset)


def rms_norm_reference(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """rms_norm by plain autodiff: the definition its custom backward is checked against."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (offset + scale.astype(jnp.float32))).astype(x.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float) -> jax.Array:
    return rms_norm_reference(x, scale, eps, offset)


def _rms_norm_fwd(x, scale, eps, offset):
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = (x32 * inv * (offset + scale.astype(jnp.float32))).astype(x.dtype)
    return y, (x, scale, inv)


def _rms_norm_bwd(eps, offset, residuals, dy):
    x, scale, inv = residuals
    normed = x.astype(jnp.float32) * inv
    dy32 = dy.astype(jnp.float32)
    g = dy32 * (offset + scale.astype(jnp.float32))
    # d/dx of x * inv(x): inv * (g - normed * mean(g * normed))
    dx = inv * (g - normed * jnp.mean(g * normed, axis=-1, keepdims=True))
    # summed over every leading axis in place: a reshape to rows would gather a sharded sequence
    dscale = jnp.sum(dy32 * normed, axis=tuple(range(x.ndim - 1)))
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def gated(activation: Callable[[jax.Array], jax.Array], gate: jax.Array, up: jax.Array) -> jax.Array:
    """activation(gate) * up (SwiGLU, GeGLU), whose backward pass keeps only gate and up
    and recomputes the activation beside its own derivative in one pass. Plain autodiff
    keeps the activation's intermediates too (silu: the sigmoid and silu(gate)), each a
    [tokens, mlp] buffer a scanned layer stack writes and reads back. `activation` is
    element-wise. Equal to activation(gate) * up in values and gradients
    (tests/unit/test_nn.py)."""
    return _gated(activation, gate, up)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gated(activation, gate, up):
    return activation(gate) * up


def _gated_fwd(activation, gate, up):
    return activation(gate) * up, (gate, up)


def _gated_bwd(activation, residuals, d_out):
    gate, up = residuals
    act, act_vjp = jax.vjp(activation, gate)
    (d_gate,) = act_vjp(d_out * up)
    return d_gate, (d_out * act).astype(up.dtype)


_gated.defvjp(_gated_fwd, _gated_bwd)
