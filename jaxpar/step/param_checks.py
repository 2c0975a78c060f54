"""Checks of the parameters against the layout, before anything compiles: each parameter's
names as many as its dimensions, storage rules that name something, parameters the rules
leave whole on every device (jaxpar.sharding.replicated), and qwZ's int8 gathers."""

from __future__ import annotations

from typing import Any

import jax

from jaxpar.errors import QUOTED, ConfigError, did_you_mean
from jaxpar.kernels.quantized import gathered_axes
from jaxpar.sharding import Layout, ParamNames
from jaxpar.sharding.annotate import gather_target
from jaxpar.sharding.replicated import replicated_params, report_replicated
from jaxpar.sharding.rules import LOGICAL_NAMES, parse_table
from jaxpar.specs import RulesConfig


def check_params(names: Any, shapes: Any, layout: Layout, rules: RulesConfig) -> None:
    """`rules`: parallel.rules, whose storage overrides must name what some parameter carries
    and whose on_replicated says what a parameter resting whole everywhere gets."""
    check_name_counts(names, shapes)
    check_storage_names(names, parse_table(rules.storage, "parallel.rules.storage"), rules.storage)
    # Own logical names that no rule knows would rest whole on every device: say so first.
    report_replicated(replicated_params(names, shapes, layout), rules.on_replicated)
    if layout.params.quantize_block:
        check_quantized_gathers(names, shapes, layout)


def check_name_counts(names: Any, shapes: Any) -> None:
    """Each parameter annotated with one name a dimension: a name short, the dimensions past
    the names would silently never be sharded (an activation with the same mistake is
    refused where it is constrained)."""

    def one(path, n: ParamNames, shape: Any) -> None:
        if len(n.names) != len(shape.shape):
            raise ConfigError(
                f"parameter {jax.tree_util.keystr(path, simple=True, separator='.')} has shape {tuple(shape.shape)} "
                f"but {len(n.names)} logical name(s) {n.names}; annotate it with one name a dimension "
                "(None for a dimension never sharded) in nnx.with_partitioning"
            )

    jax.tree_util.tree_map_with_path(one, names, shapes, is_leaf=lambda x: isinstance(x, ParamNames))


def check_storage_names(names: Any, storage: dict[str, tuple[str, ...]], text: str) -> None:
    """Every logical name parallel.rules.storage places is jaxpar's or carried by some
    parameter: the storage table places only parameters, so a misspelt name would shard
    nothing, silently."""
    carried = {n for leaf in jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, ParamNames))
               for n in leaf.names if n is not None}
    for name in storage:
        if name not in carried and name not in LOGICAL_NAMES:
            raise ConfigError(
                f"parallel.rules.storage={text!r}: no parameter carries the logical name {name!r}"
                f"{did_you_mean(name, sorted(carried), QUOTED)}; "
                f"the parameters' names are {', '.join(sorted(carried))}"
            )


def check_quantized_gathers(names: Any, shapes: Any, layout: Layout) -> None:
    """qwZ gathers blocks that must stay contiguous: a parameter's compute axes must lead
    its storage axes on every dimension."""

    def one(path, n: Any, shape: Any) -> None:
        try:
            gathered_axes(layout.param_spec(n.names, shape.shape), gather_target(n.names, layout), len(shape.shape))
        except ValueError as e:
            raise ConfigError(
                f"parallel.zero.quantized_weights: parameter {jax.tree_util.keystr(path)} cannot be gathered in int8: {e}; "
                "order parallel.rules.storage so the compute axes come first"
            ) from None

    jax.tree_util.tree_map_with_path(one, names, shapes, is_leaf=lambda x: isinstance(x, ParamNames))
