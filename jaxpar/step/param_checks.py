"""Checks of the parameters against the layout, before anything compiles: parameters the
rules leave whole on every device (jaxpar.sharding.replicated), and qwZ's int8 gathers."""

from __future__ import annotations

from typing import Any

import jax

from jaxpar.errors import ConfigError
from jaxpar.kernels.quantized import gathered_axes
from jaxpar.sharding import Layout, ParamNames
from jaxpar.sharding.annotate import gather_target
from jaxpar.sharding.replicated import replicated_params, report_replicated


def check_params(names: Any, shapes: Any, layout: Layout, on_replicated: str) -> None:
    """`on_replicated`: parallel.rules.on_replicated, what a parameter resting whole everywhere gets."""
    # Own logical names that no rule knows would rest whole on every device: say so first.
    report_replicated(replicated_params(names, shapes, layout), on_replicated)
    if layout.params.quantize_block:
        check_quantized_gathers(names, shapes, layout)


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
