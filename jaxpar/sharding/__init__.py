"""Logical sharding: rules tables, layouts, and annotations."""

from jaxpar.sharding.annotate import (
    HPZ_NAME,
    Layout,
    ParamGather,
    ParamNames,
    Projections,
    active_layout,
    compute_value,
    constrain,
    logical_names,
    param_names,
    shardings_for,
    use_layout,
)
from jaxpar.sharding.attend import attend, context_spec, largest_logits, reports_logits, sequence_degree
from jaxpar.sharding.embedding import lookup
from jaxpar.sharding.experts import expert_matmul, run_experts, top_k_indices
from jaxpar.sharding.projections import column_project, row_project
from jaxpar.sharding.rules import Rules, default_rules, parse_table
from jaxpar.sharding.sequence import ahead

__all__ = [
    "ahead",
    "column_project",
    "lookup",
    "row_project",
    "HPZ_NAME",
    "Layout",
    "ParamGather",
    "ParamNames",
    "Projections",
    "Rules",
    "active_layout",
    "attend",
    "context_spec",
    "expert_matmul",
    "compute_value",
    "constrain",
    "default_rules",
    "largest_logits",
    "logical_names",
    "param_names",
    "parse_table",
    "reports_logits",
    "sequence_degree",
    "shardings_for",
    "run_experts",
    "top_k_indices",
    "use_layout",
]
