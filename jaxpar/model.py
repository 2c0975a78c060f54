"""The model contract: what jaxpar asks of a model config, and what a model may declare.

A model config is a frozen dataclass (so `--set model.field=value` and checkpoints work).

Required (`ModelConfig`):
  task                       "lm" (next-token batches: inputs/targets/weights [B, S] token ids)
                             or "classify" (inputs [B, F] float features, targets [B]); it picks
                             the batch fields and the built-in loss (`build(loss_fn=...)`
                             replaces the loss).
  build(rngs)                the Flax NNX module, its parameters annotated with logical axis
                             names (`nnx.with_partitioning(init, ("embed", "mlp"))`).
  param_count()              parameters, for the report and the planner.
  flops_per_token(seq_len)   training FLOPs per token (per example for classify), for MFU.

Optional, each read by asking (`capabilities`, `axis_names`, `mesh_divides`, `check_model`),
never by testing the class:
  capabilities   a frozenset of the names below: what the model routes through jaxpar's
                 helpers, and so which strategies apply to it. A layout that needs a
                 capability the model lacks is refused before compile.
  axis_names     {own logical name: jaxpar's name}, for a model written with its own names
                 ("dm" -> "embed", "ff" -> "mlp"): the default rules then shard them; None
                 for a name never sharded on purpose (a position table's rows).
  mesh_divides   {mesh axis: (config fields it must divide, ...)}: checked before compile
                 with one line naming the field and the sizes that work.
  check(sizes)   the model's own field checks, given the resolved mesh axis sizes; raises
                 jaxpar.errors.ConfigError naming `model.<field>`.
  sequence_length  models with the 'sequence' capability whose activations' sequence is not
                 train.seq_len (a ViT's patch count): what sequence parallelism divides.
  input_shape    classify models: each example's `inputs` shape (default (in_features,)),
                 e.g. (H, W, C) for images.
  batch_fields(seq_len)  {name: jaxpar.data.batch.Field}: batches of other fields than the
                 task's (then the data comes from jaxpar.train.run(data=...)).
  head_param_count()  the output matmul's weights (`jaxpar explain` splits a pipeline's
                 recompute by them; default vocab_size x embed where the config has them).
  layer_param_count()  one repeated layer's parameters (the XLA overlap preset's combine
                 thresholds; default param_count() / num_layers).
  vocab_size     lm models: the token ids the synthetic data draws (and files must fit).
  in_features    classify models: the width of `inputs`; num_classes: the targets' range.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

from flax import nnx

from jaxpar.errors import ConfigError

# Capabilities a model declares (its config's `capabilities`).
SEQUENCE = "sequence"  # activations carry a "seq"/"norm_seq" axis: sequence parallelism shards it
ATTENTION = "attention"  # attention through jaxpar.sharding.attend (context parallel, flash, cuDNN);
#                          the config has num_heads, num_kv_heads and head_dim
PROJECTIONS = "projections"  # matmuls through column_project / row_project: collective matmul
EXPERTS = "experts"  # experts through jaxpar's MoE helpers; the config has num_experts
STAGES = "stages"  # the module implements `PipelineStages`: a pipeline can cut it
REMAT = "remat"  # the config's `remat` names a jaxpar.nn policy the model applies to its layers

CAPABILITIES = {
    SEQUENCE: "sequence parallelism (parallel.sequence_parallel) shards its sequence",
    ATTENTION: "context parallelism (mesh.context) and the attention kernels (parallel.attention)",
    PROJECTIONS: "collective matmul (parallel.collective_matmul) and FP8 matmuls (train.matmul_dtype=fp8)",
    EXPERTS: "expert parallelism (mesh.expert)",
    STAGES: "pipeline stages (mesh.stage)",
    REMAT: "rematerialisation policies (model.remat)",
}


@runtime_checkable
class ModelConfig(Protocol):
    """What every model config provides (see the module docstring)."""

    task: str

    def build(self, rngs: nnx.Rngs) -> nnx.Module: ...

    def param_count(self) -> int: ...

    def flops_per_token(self, seq_len: int) -> float: ...


@runtime_checkable
class PipelineStages(Protocol):
    """What a module declaring STAGES offers the pipeline (jaxpar.pipeline.stages). Its
    repeated layers are stacked (jaxpar.nn.stack_layers) under the attribute `layers`;
    the stages rebuild the module with a slice of that stack, so one definition serves
    every stage. `output(apply_layers(embed(batch), batch))` must equal the module's call
    on the batch: the embedding runs on the first stage, the output (and the loss) on the
    last. Everything outside `layers` is held by every stage.

    A module whose call returns (outputs, aux) (jaxpar.train.loss.model_loss: MoE's
    penalties and counts) returns (x, report) from `apply_layers` instead, for the layers
    it was given: {"loss": its share of aux["penalty"] summed under batch["weights"],
    "sums": {"token_metrics": {name: its share of the weighted sum}}, "per_layer":
    {"counts": {name: [its layers, ...]}}} (models.moe.MoETransformer.apply_layers).
    """

    layers: nnx.Module

    def embed(self, batch: Mapping[str, Any]) -> Any: ...

    def apply_layers(self, x: Any, batch: Mapping[str, Any]) -> Any: ...

    def output(self, x: Any) -> Any: ...


def capabilities(model: Any) -> frozenset[str]:
    return frozenset(getattr(model, "capabilities", ()))


def supports(model: Any, capability: str) -> bool:
    return capability in capabilities(model)


def model_name(model: Any) -> str:
    return type(model).__name__


def lacks(model: Any, capability: str, setting: str, instead: str) -> ConfigError:
    """The one-line refusal of a layout that needs a capability the model does not declare."""
    return ConfigError(
        f"{setting}: model {model_name(model)} does not declare the {capability!r} capability "
        f"({CAPABILITIES[capability]} needs it; see jaxpar.model); {instead}"
    )


def axis_names(model: Any) -> dict[str, str]:
    return dict(getattr(model, "axis_names", {}) or {})


def mesh_divides(model: Any) -> dict[str, tuple[str, ...]]:
    return {axis: tuple(fields) for axis, fields in (getattr(model, "mesh_divides", {}) or {}).items()}


def check_model(model: Any, sizes: Mapping[str, int]) -> None:
    """The contract's required members, then the model's own `check`."""
    missing = [m for m in ("task", "build", "param_count", "flops_per_token") if not hasattr(model, m)]
    if missing:
        raise ConfigError(
            f"model {model_name(model)} lacks {', '.join(missing)}: a model config provides task, build(rngs), "
            "param_count() and flops_per_token(seq_len) (jaxpar.model.ModelConfig; docs/your_model.md)"
        )
    unknown = sorted(capabilities(model) - set(CAPABILITIES))
    if unknown:
        raise ConfigError(f"model {model_name(model)} declares unknown capabilities {unknown}; use {sorted(CAPABILITIES)}")
    if hasattr(model, "check"):
        model.check(dict(sizes))


__all__ = [
    "ATTENTION", "CAPABILITIES", "EXPERTS", "PROJECTIONS", "REMAT", "SEQUENCE", "STAGES", "ModelConfig",
    "PipelineStages", "axis_names", "capabilities", "check_model", "lacks", "mesh_divides", "supports",
]
