"""Logical sharding: rules tables, layouts, and annotations."""

from jaxpar.sharding.annotate import (
    HPZ_NAME,
    Layout,
    ParamGather,
    active_layout,
    compute_value,
    constrain,
    logical_names,
    param_names,
    shardings_for,
    use_layout,
)
from jaxpar.sharding.rules import Rules, default_rules, parse_table

__all__ = [
    "HPZ_NAME",
    "Layout",
    "ParamGather",
    "Rules",
    "active_layout",
    "compute_value",
    "constrain",
    "default_rules",
    "logical_names",
    "param_names",
    "parse_table",
    "shardings_for",
    "use_layout",
]
