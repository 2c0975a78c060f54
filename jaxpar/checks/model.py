"""The model's own fields, before any mesh axis is held against them: the model contract
(jaxpar.model) and whatever the model's config checks itself (its `check`)."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.model import check_model

RULES: list[Rule] = []
rule = collector(RULES)


@rule(
    "model-contract",
    fields=["model", "model.num_kv_heads", "model.head_dim", "model.num_layers", "model.num_experts",
            "model.top_k", "model.capacity_factor", "model.aux_loss_weight", "model.in_features", "train.seq_len"],
    summary="The model config is a frozen dataclass that provides the contract of jaxpar.model (task, build, "
    "param_count, flops_per_token; known capabilities; vocab_size for task lm, in_features or input_shape and "
    "num_classes for classify; mesh_divides naming mesh axes and integer fields; under pipeline stages or "
    "loss chunks a module with the PipelineStages members; train.seq_len within its max_seq_len), and its own "
    "`check` passes: for Llama, kv heads divide heads, head_dim is even "
    "and every size is positive; for MoE also 1 <= top_k <= num_experts, a positive capacity factor, non-negative balancing weights, and capacity routing only on whole "
    "sequences (mesh.context=1); for the MLP positive sizes.",
    example=["model.num_kv_heads=3"],
    also=[["model.head_dim=7"], ["model.num_layers=0"], ["model.num_kv_heads=0"]],
)
def model_contract(config, sizes) -> None:
    staged = sizes["stage"] > 1 or config.train.loss_chunks > 1  # the runs that call its PipelineStages members
    check_model(config.model, sizes, seq_len=config.train.seq_len, staged=staged)
