"""LoRA (`lora.rank`, `lora.alpha`, `lora.targets`): low-rank adapters on a model's weights,
the rest of the model frozen.

  plan(abstract base state, lora, axis_names) -> {path: Target}   checked before compile
  adapt(model, plan, lora, seed)        puts a LoraWeight (jaxpar.sharding.adapters) where
                                        each targeted weight was: W frozen, A drawn, B zero;
                                        freezes every other weight
  quantize_bases(frozen)                the adapted weights in FP8 (lora.base_dtype=fp8)
  frozen_paths                          the paths of the frozen weights, which split and join
                                        (jaxpar.sharding.adapters) cut the trainer's tree at:
                                        what it trains (the adapters) and the rest
  jaxpar.sharding.adapters.merge_adapters  W + (alpha / rank) * A @ B folded back: the base
                                        model's tree (export)

With B zero the adapted model starts equal to the base. The frozen weights rest in the
compute dtype (the adapted ones in FP8 with lora.base_dtype=fp8: `quantize_bases`), sharded
as parameters are (FSDP, ZeRO-3, tensor parallelism); A and B are ordinary parameters named
with the weight's own axes on their sides (the rank unsharded), so they and their optimizer
state rest as the weight would.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import LoraConfig
from jaxpar.errors import ConfigError
from jaxpar.sharding.adapters import Frozen, LoraWeight, initial_adapter, quantized
from jaxpar.sharding.annotate import logical_names

RESIDUAL = "embed"  # the residual axis: a projection's input (column) or output (row) side
STACKED = ("layers", "experts")  # leading dimensions each slice of which is a weight of its own
LEFT_OUT = ("vocab", "experts")  # not adapted unless named: vocabulary tables, expert weights (grouped kernels)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a weight's dimensions split: `lead` stacked ones, then `inputs` that A keeps;
    the rest are B's."""

    lead: int
    inputs: int


def plan(abstract: nnx.State, lora: LoraConfig, axis_names: Mapping[str, str | None] | None = None) -> dict[str, Target]:
    """{dotted path: Target} of the weights `lora.targets` adapts, from the base model's
    abstract state; ConfigError for a pattern that matches nothing, a weight whose sides
    cannot be told apart, an expert weight, or a rank above a weight's smaller side."""
    aliases = dict(axis_names or {})
    patterns = [p.strip() for p in lora.targets.split(",") if p.strip()]
    found: dict[str, Target] = {}
    matched = {p: False for p in patterns}
    for path, variable in nnx.to_flat_state(abstract):
        if not isinstance(variable, nnx.Param):
            continue
        dotted = ".".join(map(str, path))
        # a stacked name stays itself (DeepSeek's "dense_layers" rests whole: aliased to None)
        names = tuple(n if n is None or stacked(n) else aliases.get(n, n) for n in logical_names(variable))
        hits = [p for p in patterns if fnmatch.fnmatchcase(dotted, p)]
        for p in hits:
            matched[p] = True
        if patterns and not hits:
            continue
        target = split_of(names)
        if not patterns:  # the default: every projection
            if target is not None and None not in names and not set(names) & set(LEFT_OUT):
                found[dotted] = target
            continue
        if "experts" in names:
            raise ConfigError(f"lora.targets={lora.targets!r} matches {dotted}, an expert weight {names}: expert "
                              "weights run through grouped kernels that take no adapter yet; narrow the pattern")
        if target is None:
            raise ConfigError(f"lora.targets={lora.targets!r} matches {dotted}, whose names {names} do not say its "
                              f"input and output sides (two or more dimensions past the stacked ones, '{RESIDUAL}' "
                              "first or last); narrow the pattern to projection weights")
        found[dotted] = target
    missing = [p for p, hit in matched.items() if not hit]
    if missing:
        some = [".".join(map(str, p)) for p, v in nnx.to_flat_state(abstract) if isinstance(v, nnx.Param)][:8]
        raise ConfigError(f"lora.targets: {', '.join(repr(m) for m in missing)} matches no parameter; the model's "
                          f"parameters are named like {', '.join(some)}; use fnmatch patterns such as '*.wq'")
    if not found:
        raise ConfigError("lora.rank > 0 but no weight is a projection to adapt (two or more dimensions with "
                          f"'{RESIDUAL}' first or last); name the weights in lora.targets")
    shapes = {".".join(map(str, p)): v.shape for p, v in nnx.to_flat_state(abstract)}
    for dotted, t in found.items():
        shape = shapes[dotted]
        smaller = min(math.prod(shape[t.lead:t.lead + t.inputs]), math.prod(shape[t.lead + t.inputs:]))
        if lora.rank > smaller:
            raise ConfigError(f"lora.rank={lora.rank} is above the smaller side of {dotted} {tuple(shape)} ({smaller}); "
                              f"use lora.rank <= {smaller}, or leave that weight out of lora.targets")
    return found


def split_of(names: tuple[str | None, ...]) -> Target | None:
    """A weight's Target from its (jaxpar) names: column weights put the residual axis
    first, row weights last; a weight of two dimensions splits after the first."""
    lead = 0
    while lead < len(names) and names[lead] is not None and stacked(names[lead]):
        lead += 1
    core = names[lead:]
    if len(core) < 2:
        return None
    if core[0] == RESIDUAL or len(core) == 2:
        return Target(lead, 1)
    if core[-1] == RESIDUAL:
        return Target(lead, len(core) - 1)
    return None


def stacked(name: str) -> bool:
    """A leading dimension each slice of which is a weight of its own: the layer stacks
    ("layers", and any "*_layers" as DeepSeek's dense ones) and the experts."""
    return name in STACKED or name.endswith("_layers")


def adapt(model: nnx.Module, targets: Mapping[str, Target], lora: LoraConfig, seed: int) -> nnx.Module:
    """`model` with a LoraWeight in place of each targeted weight (changed in place): W as
    it was (Frozen), A ~ U(+-1/sqrt(fan_in)) as PEFT draws it, B zero. Every other
    parameter is frozen too (embeddings, norms, untargeted weights): the adapters are all
    that trains."""
    scale = lora.alpha / lora.rank
    with nnx.use_eager_sharding(False):
        for path, variable in list(nnx.to_flat_state(nnx.state(model, nnx.Param))):
            dotted = ".".join(map(str, path))
            if dotted not in targets:
                owner, attr = _owner(model, dotted)
                _set(owner, attr, Frozen(variable[...], out_sharding=logical_names(variable)))
        for i, (dotted, t) in enumerate(sorted(targets.items())):
            owner, attr = _owner(model, dotted)
            weight = _get(owner, attr)
            value, names = weight[...], logical_names(weight)
            cut = t.lead + t.inputs
            a, b = initial_adapter(i, t.lead, t.inputs, value.shape, lora.rank, seed)
            base_scale = Frozen(jnp.ones(value.shape[:cut], jnp.float32), out_sharding=names[:cut]) \
                if lora.base_dtype == "fp8" else None  # the scales quantize_bases sets
            _set(owner, attr, LoraWeight(
                Frozen(value, out_sharding=names),
                nnx.Param(a, out_sharding=(*names[:cut], None)),
                nnx.Param(b, out_sharding=(*names[:t.lead], None, *names[cut:])),
                scale, t.inputs, base_scale))
    return model


def adapted_weights(weights: dict, targets: Mapping[str, Target], lora: LoraConfig, seed: int) -> dict:
    """The base model's float32 weights (a nested dict in model order, as nnx.to_pure_dict
    gives them) with each target's adapters drawn beside it: the tree `trainer.init()` starts
    from, without building the model or compiling its draws."""
    out = jax.tree.map(lambda x: x, weights)  # a copy whose nodes this may replace
    for i, (dotted, t) in enumerate(sorted(targets.items())):
        *parents, leaf = _keys(dotted)
        node = out
        for k in parents:
            node = node[k]
        base = node[leaf]
        a, b = initial_adapter(i, t.lead, t.inputs, base.shape, lora.rank, seed)
        node[leaf] = {"base": base, "lora_a": a, "lora_b": b,
                      **({"base_scale": jnp.ones(base.shape[:t.lead + t.inputs], jnp.float32)}
                         if lora.base_dtype == "fp8" else {})}
    return out


def _keys(dotted: str) -> list[str | int]:
    """A target's dotted path as keys of the model, or of its pure dict (list positions as ints)."""
    return [int(k) if k.isdigit() else k for k in dotted.split(".")]


def _owner(model: nnx.Module, dotted: str) -> tuple[Any, str | int]:
    node = model
    *parents, last = _keys(dotted)
    for key in parents:
        node = _get(node, key)
    return node, last


def _get(node: Any, key: str | int) -> Any:
    return node[key] if isinstance(key, int) else getattr(node, key)


def _set(node: Any, key: str | int, value: Any) -> None:
    if isinstance(key, int):
        node[key] = value
    else:
        setattr(node, key, value)


# ------------------------------------------------------------- the trainer's two trees


def quantize_bases(frozen: dict) -> dict:
    """The frozen tree with each weight that rests in FP8 (lora.base_dtype=fp8: a node with a
    `base_scale`) quantized from its float32 `base` (jaxpar.sharding.adapters.quantized)."""
    if "base_scale" in frozen:
        base, scale = quantized(frozen["base"], frozen["base_scale"].ndim)
        return {**frozen, "base": base, "base_scale": scale}
    return {k: quantize_bases(v) if isinstance(v, dict) else v for k, v in frozen.items()}


def frozen_paths(abstract: nnx.State) -> frozenset[tuple]:
    """Paths (as nnx.to_pure_dict nests them) of the Frozen variables."""
    return frozenset(path for path, v in nnx.to_flat_state(abstract) if isinstance(v, Frozen))
