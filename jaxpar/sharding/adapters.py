"""A frozen weight with a low-rank adapter (LoRA): W + scale * A @ B.

jaxpar.step.lora puts a `LoraWeight` where a model had the parameter it adapts. Models
never see the difference: the projection helpers (jaxpar.sharding.projections) multiply
it unmerged, x @ W + scale * (x @ A) @ B, and `compute_value` (a model that lays a weight
out itself) gives the merged W + scale * A @ B. The base W is a `Frozen` variable: it is
not an nnx.Param, so the trainer keeps it out of the gradient, the float32 master weights
and the optimizer state, in the compute dtype only.

A weight's dimensions split into an input side, which the adapter's A keeps, and an
output side, which B keeps; the rank sits between them, unsharded:

  W [*lead, *in, *out]   A [*lead, *in, r]   B [*lead, r, *out]

`lead` are stacked dimensions (the layer stack's "layers"), which A and B share with W, so
each layer has its own adapter and A and B rest like W on every dimension they share
(FSDP's shards, tensor parallelism's heads).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx


class Frozen(nnx.Variable):
    """A weight the trainer does not train: no gradient, no master copy, no optimizer state."""


class LoraWeight(nnx.Module):
    """W (`base`, Frozen) + `scale` * A (`lora_a`) @ B (`lora_b`), A over W's first `inputs`
    dimensions past the stacked ones (see the module's docstring). `base_scale` (Frozen, or
    None): W rests in FP8 as W / s, s one per input row [*lead, *in] (in the compute dtype)."""

    def __init__(self, base: Frozen, lora_a: nnx.Param, lora_b: nnx.Param, scale: float, inputs: int,
                 base_scale: Frozen | None = None):
        self.base, self.lora_a, self.lora_b, self.base_scale = base, lora_a, lora_b, base_scale
        self.scale, self.inputs = float(scale), int(inputs)  # static: part of the graph, not of the state


def base_value(weight: LoraWeight, value_of: Callable[[nnx.Variable], jax.Array], dtype) -> jax.Array:
    """W laid out for use, in `dtype`: an FP8 one dequantized (each row times its scale)."""
    base = value_of(weight.base)
    if weight.base_scale is None:
        return base.astype(dtype)
    return dequantized(base, value_of(weight.base_scale), dtype)


def dequantized(base: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """FP8 rows [*rows, *out] times their scales [*rows], in `dtype`."""
    scale = scale.reshape(*scale.shape, *(1,) * (base.ndim - scale.ndim))
    return (base.astype(jnp.float32) * scale).astype(dtype)


def quantized(base: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """(W / s in e4m3, s [first `rows` dims]): s each row's largest magnitude over e4m3's 448."""
    base = base.astype(jnp.float32)
    out_axes = tuple(range(rows, base.ndim))
    scale = jnp.maximum(jnp.max(jnp.abs(base), axis=out_axes) / E4M3_MAX, jnp.finfo(jnp.float32).tiny)
    q = (base / scale.reshape(*scale.shape, *(1,) * len(out_axes))).astype(jnp.float8_e4m3fn)
    return q, scale


E4M3_MAX = 448.0


SEED_STREAM = 0x10A  # the adapters' draws: a stream of train.seed of their own


def drawn_a(seed: int, index: int, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    """The `index`-th adapted weight's A (targets in sorted order) at train.seed `seed`:
    U(+-1/sqrt(fan_in)) as PEFT draws it, the same wherever it is drawn (the model's build,
    a Hugging Face import)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), SEED_STREAM), index)
    bound = 1 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def initial_adapter(index: int, lead: int, inputs: int, shape: tuple[int, ...], rank: int, seed: int
                    ) -> tuple[jax.Array, jax.Array]:
    """(A, B) of the `index`-th adapted weight (targets in sorted order), of `shape` with
    `lead` leading dimensions before its `inputs` input ones, as the model's build draws
    them: A as `drawn_a`, B zero. A Hugging Face import and a test's starting state draw
    the adapters alone, without the model."""
    cut = lead + inputs
    a = drawn_a(seed, index, (*shape[:cut], rank), math.prod(shape[lead:cut]))
    return a, jnp.zeros((*shape[:lead], rank, *shape[cut:]), jnp.float32)


def adapter_output(h: jax.Array, lora_b: jax.Array, scale: float) -> jax.Array:
    """(x @ A) [.., r] -> scale * (x @ A) @ B; B laid out for use (one layer's)."""
    return jnp.tensordot(h * jnp.asarray(scale, h.dtype), lora_b.astype(h.dtype), axes=1)


def check_inputs(weight: LoraWeight, axes: int) -> None:
    """A projection contracts `axes` leading dimensions of the weight: its adapter must have
    been split there (jaxpar.step.lora.split_of decides from the weight's names)."""
    if weight.inputs != axes:
        raise ValueError(
            f"lora: a weight of shape {tuple(weight.base.shape)} is multiplied here over its first {axes} "
            f"dimension(s), but its adapter's A takes {weight.inputs}; name the weight's residual axis 'embed' "
            "(first for a column projection, last for a row projection), or leave it out of lora.targets"
        )


def merged(weight: LoraWeight, value_of: Callable[[nnx.Variable], jax.Array]) -> jax.Array:
    """W + scale * A @ B, each read through `value_of` (compute_value: laid out for use), in
    the adapters' dtype (the compute dtype)."""
    a, b = value_of(weight.lora_a), value_of(weight.lora_b)
    base = base_value(weight, value_of, a.dtype)
    return base + (low_rank_product(a, b, base.ndim) * weight.scale).astype(base.dtype)


def low_rank_product(a: jax.Array, b: jax.Array, ndim: int) -> jax.Array:
    """A [*lead, *in, r] @ B [*lead, r, *out] -> [*lead, *in, *out], of rank `ndim`; the lead
    dimensions (as many as make the ranks add up) are batched, not contracted."""
    lead = a.ndim + b.ndim - 2 - ndim
    shape_in, shape_out, r = a.shape[lead:-1], b.shape[lead + 1:], a.shape[-1]
    a2 = a.reshape(*a.shape[:lead], math.prod(shape_in), r)
    b2 = b.reshape(*b.shape[:lead], r, math.prod(shape_out))
    return jnp.matmul(a2, b2, preferred_element_type=jnp.float32).reshape(*a.shape[:lead], *shape_in, *shape_out)


def merge_adapters(weights: dict, scale: float) -> dict:
    """A pure-dict tree of weights with each {base, lora_a, lora_b} node replaced by
    W + scale * A @ B, in float32: the base model's tree (jit it to merge sharded weights
    where they rest)."""
    if {"base", "lora_a", "lora_b"} <= set(weights) <= {"base", "base_scale", "lora_a", "lora_b"}:
        base = jnp.asarray(weights["base"])
        # an FP8 base as the state holds it; a float32 one (read again from its checkpoint) as it is
        base = dequantized(base, weights["base_scale"], jnp.float32) if base.dtype == jnp.float8_e4m3fn else \
            base.astype(jnp.float32)
        product = low_rank_product(*(jnp.asarray(weights[k], jnp.float32) for k in ("lora_a", "lora_b")), base.ndim)
        return base + scale * product
    return {k: merge_adapters(v, scale) if isinstance(v, dict) else v for k, v in weights.items()}


def split(tree: dict, paths: frozenset[tuple], _prefix: tuple = ()) -> tuple[dict, dict]:
    """(everything else, the leaves at `paths`): a pure-dict tree cut in two (the trainer's
    trained and frozen weights, jaxpar.step.lora)."""
    rest, frozen = {}, {}
    for key, value in tree.items():
        path = (*_prefix, key)
        if isinstance(value, dict):
            a, b = split(value, paths, path)
            if a:
                rest[key] = a
            if b:
                frozen[key] = b
        elif path in paths:
            frozen[key] = value
        else:
            rest[key] = value
    return rest, frozen


def join(tree: dict, other: dict | None) -> dict:
    """The two halves `split` made, one tree again: `other`'s leaves added to, or put over,
    `tree`'s."""
    if not other:
        return tree
    out = dict(tree)
    for key, value in other.items():
        out[key] = join(out[key], value) if key in out and isinstance(value, dict) else value
    return out
