"""The model contract: what jaxpar asks of a model config, and what a model may declare.

A model config is a frozen dataclass (so `--set model.field=value` and checkpoints work;
check_model refuses any other).

Required (`ModelConfig`):
  task                       "lm" (next-token batches: inputs/targets/weights [B, S] token ids)
                             or "classify" (inputs [B, F] float features, targets [B]); it picks
                             the batch fields and the built-in loss (`build(loss_fn=...)`
                             replaces the loss).
  build(rngs)                the Flax NNX module, its parameters annotated with logical axis
                             names (`nnx.with_partitioning(init, ("embed", "mlp"))`).
  param_count()              parameters, for the report and the planner.
  flops_per_token(seq_len)   training FLOPs per token (per example for classify), for MFU.

Optional: every member below is declared here (`MEMBERS`, with the value a model without
it gets) and read through `declared(model, name)` (`has(model, name)`: whether the model
declares it), never by hasattr/getattr on the config
or by testing its class; `declared` refuses a name not listed, so a typo cannot read a
default.
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
  max_seq_len    the longest sequence the model's positions cover (a learned position
                 table's rows; None for none, as RoPE's): a longer train.seq_len is refused
                 before compile (it would read past the table and train on NaN).
  sequence_length  models with the 'sequence' capability whose activations' sequence is not
                 train.seq_len (a ViT's patch count): what sequence parallelism divides.
  input_shape    classify models: each example's `inputs` shape (default (in_features,)),
                 e.g. (H, W, C) for images.
  batch_fields(seq_len)  {name: jaxpar.data.batch.Field}: batches of other fields than the
                 task's (then the data comes from jaxpar.train.run(data=...)).
  head_param_count()  the output matmul's weights (`jaxpar explain` splits a pipeline's
                 recompute by them; default vocab_size x embed where the config has them).
  leading_layers()  the layers a pipelined module's `embed` runs before its stack (DeepSeek's
                 dense ones), counted on the first stage in parallel.pipeline.layers (default 0).
  layer_param_count()  one repeated layer's parameters (the XLA overlap preset's combine
                 thresholds; default param_count() / num_layers).
  update(params, counts)  the model's own change to its float32 weights after each optimizer
                 step, from the step's summed `counts` (MoE's bias balancing).
  summarise(counts)  {metric name: scalar} from the step's summed `counts` (MoE's load).
  stack_axes     logical names of dims that index a stack of same-shape weights
                 (jaxpar.nn.stack_layers' axis names; default ("layers", "experts")): Muon
                 orthogonalises each matrix of a stack on its own (jaxpar.step.muon).
  not_matrices   dotted paths (fnmatch patterns) of parameters with two or more dims that
                 are no weight matrix (Qwen2's q/k/v biases): Muon leaves them to AdamW.
  clip_qk(params, logit_max, threshold)  QK-clip (optim.qk_clip): the float32 weights with
                 the query and key projections of each head whose largest logit this step
                 (logit_max [layers, heads], what its attention layers reported through
                 jaxpar.sharding.reports_logits) passed `threshold` scaled so that it would
                 have been `threshold` (jaxpar.kernels.attention.logits.clip_factors).
                 Under pipeline stages, logit_max comes as the stack rests (pipeline
                 order, each stage's rows padded: padding rows -inf), as `update`'s counts do.
Fields some parts read where a config has them (a decoder's shape):
  vocab_size     lm models: the token ids the synthetic data draws (and files must fit).
  in_features    classify models: the width of `inputs`; num_classes: the targets' range.
  embed, num_layers, num_heads, num_kv_heads, head_dim, mlp, tie_embeddings  a decoder's
                 shape: the planner's cost model (jaxpar.plan, which needs all but
                 tie_embeddings) and `jaxpar explain`'s traffic formulas read them.
  v_head_dim     the values' head dim where it differs from head_dim (DeepSeek's MLA); the
                 fused attention kernels pad both to the larger (0 without: head_dim).
  num_experts    routed experts (0 without): the planner's expert layouts, explain's
                 all-to-all formula.
  expert_groups  groups of consecutive experts a token's choices are limited to (1 without),
  top_groups     and how many of them a token chooses within (1 without): the planner's
                 two-hop candidates (a token crossing to a host once per group).
  group_capacity whether the groups have a capacity too (False without): explain's
                 two-hop traffic row.
  mtp_layers     prediction layers outside the stack with the stack's experts (DeepSeek-V3's
                 multi-token prediction; 0 without): the planner splits their experts too.
  remat          the name of the jaxpar.nn remat policy the model applies ("none" without).
  sliding_window the keys each query sees (0 without: all earlier ones), for explain's
                 context traffic (a ring over the contiguous order stops early).
  layer_windows()  each layer's window in the model's order, for a model whose layers
                 differ (Gemma 3's local and global ones; default: sliding_window for every
                 layer): explain's traffic formulas sum over them, and a layer that picks its
                 kind with jaxpar.nn.by_kind has each branch counted by its share of layers.

A model's Hugging Face format is no member of its config: a model family (a config class
with its formats, planner presets and recipes) registers it with the model, once, with
`jaxpar.families.register(Family(name, ConfigClass, hf=jaxpar.hf.HFFormat(...)))`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol, runtime_checkable

from flax import nnx

from jaxpar.errors import QUOTED, ConfigError, did_you_mean
from jaxpar.mesh import AXES

# A model's reports (its aux, a pipeline chunk's "per_layer") under this key combine across
# microbatches, replicas and devices by their largest value, not their sum (QK-clip's logits).
MAXIMA = "maxima"

# Capabilities a model declares (its config's `capabilities`).
SEQUENCE = "sequence"  # activations carry a "seq"/"norm_seq" axis: sequence parallelism shards it
ATTENTION = "attention"  # attention through jaxpar.sharding.attend (context parallel, flash, cuDNN);
#                          the config has num_heads, num_kv_heads and head_dim
PROJECTIONS = "projections"  # matmuls through column_project / row_project: collective matmul
EXPERTS = "experts"  # experts through jaxpar's MoE helpers; the config has num_experts
STAGES = "stages"  # the module implements `PipelineStages`: a pipeline can cut it
REMAT = "remat"  # the config's `remat` names a jaxpar.nn policy the model applies to its layers

CAPABILITIES = {
    SEQUENCE: "sequence parallelism (parallel.tensor.sequence_parallel) shards its sequence",
    ATTENTION: "context parallelism (mesh.context) and the attention kernels (parallel.attention)",
    PROJECTIONS: "collective matmul (parallel.tensor.collective_matmul) and FP8 matmuls (train.matmul_dtype=fp8)",
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


FIRST_LAYER = "first_layer"  # a pipeline stage's batch key (PipelineStages)


@runtime_checkable
class PipelineStages(Protocol):
    """What a module declaring STAGES offers the pipeline (jaxpar.pipeline.stages). Its
    repeated layers are stacked (jaxpar.nn.stack_layers) under the attribute `layers`;
    the stages rebuild the module with a slice of that stack, so one definition serves
    every stage. `output(apply_layers(embed(batch), batch))` must equal the module's call
    on the batch: the embedding runs on the first stage, the output (and the loss) on the
    last. Everything outside `layers` is held by every stage.

    A module whose call returns (outputs, aux) (jaxpar.step.loss.model_loss: MoE's
    penalties and counts) returns (x, report) from `apply_layers` instead, for the layers
    it was given: {"loss": its share of aux["penalty"] summed under batch["weights"],
    "sums": {"token_metrics": {name: its share of the weighted sum}}, "per_layer":
    {"counts": {name: [its layers, ...]}}} (models.moe.MoETransformer.apply_layers).

    A stage's `batch` also holds FIRST_LAYER, the index (in the model's order, a traced
    integer) of the first layer of its chunk of `layers`, for a model whose layers differ by
    their place (Gemma 3's local and global attention, jaxpar.nn.scan_layers' first_layer);
    a module holding all its layers starts at 0.

    Optionally `output_report(x, batch)`, on the last stage beside the output: a loss of
    the module's own computed from the last hidden states and the batch (DeepSeek-V3's
    multi-token prediction), {"loss": its weighted sum, "sums": {"token_metrics": {name:
    its weighted sum}}}, whose metric names `apply_layers` also reports (as 0), so every
    stage's report has one structure (models.deepseek.DeepSeek).
    """

    layers: nnx.Module

    def embed(self, batch: Mapping[str, Any]) -> Any: ...

    def apply_layers(self, x: Any, batch: Mapping[str, Any]) -> Any: ...

    def output(self, x: Any) -> Any: ...


# The optional members (module docstring), each with what a model without it gets.
MEMBERS: dict[str, Any] = {
    "capabilities": frozenset(), "axis_names": None, "mesh_divides": None, "check": None,
    "sequence_length": None, "input_shape": None, "batch_fields": None, "head_param_count": None,
    "layer_param_count": None, "leading_layers": None, "update": None, "summarise": None,
    "vocab_size": None, "in_features": None, "num_classes": None, "embed": None, "num_layers": None,
    "num_heads": None, "num_kv_heads": None, "head_dim": None, "mlp": None, "tie_embeddings": None,
    "num_experts": 0, "expert_groups": 1, "top_groups": 1, "group_capacity": False, "mtp_layers": 0,
    "remat": "none", "sliding_window": 0, "layer_windows": None, "v_head_dim": 0,
    "stack_axes": None, "not_matrices": None, "clip_qk": None, "max_seq_len": None,
}
_DEFAULT = object()


def declared(model: Any, member: str, default: Any = _DEFAULT) -> Any:
    """The model's `member` (an optional member of the contract: `MEMBERS`), or `default`
    (else the contract's) when it does not declare it. A name the contract does not list
    is refused: every optional member is read here, and a misspelt one cannot read a default."""
    if member not in MEMBERS:
        raise KeyError(f"{member!r} is no optional member of the model contract; declare it in jaxpar.model.MEMBERS "
                       f"(and the module docstring), or use one of {', '.join(MEMBERS)}")
    value = getattr(model, member, None)
    if value is not None:
        return value
    return MEMBERS[member] if default is _DEFAULT else default


def layer_windows(model: Any) -> tuple[int, ...]:
    """Each layer's window: the model's layer_windows(), else its sliding_window for each of
    its num_layers (none without them)."""
    own = declared(model, "layer_windows")
    if own is not None:
        return tuple(own())
    return (declared(model, "sliding_window"),) * (declared(model, "num_layers") or 0)


def has(model: Any, member: str) -> bool:
    """Whether the model declares `member` (one of `MEMBERS`)."""
    return declared(model, member, None) is not None


def capabilities(model: Any) -> frozenset[str]:
    return frozenset(declared(model, "capabilities"))


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
    return dict(declared(model, "axis_names", {}))


def mesh_divides(model: Any) -> dict[str, tuple[str, ...]]:
    return {axis: tuple(fields) for axis, fields in declared(model, "mesh_divides", {}).items()}


def check_model(model: Any, sizes: Mapping[str, int], *, seq_len: int | None = None, staged: bool = False) -> None:
    """The contract's members, then the model's own `check`: each mistake one line before
    compile, not a traceback from the part that reads the member. `seq_len`: the run's
    train.seq_len, held against `max_seq_len`; `staged`: the run calls the module's
    PipelineStages members (mesh.stage > 1, train.loss_chunks > 1), so a model declaring
    STAGES has its module built (abstractly) and checked for them."""
    missing = [m for m in ("task", "build", "param_count", "flops_per_token") if not hasattr(model, m)]
    if missing:
        raise ConfigError(
            f"model {model_name(model)} lacks {', '.join(missing)}: a model config provides task, build(rngs), "
            "param_count() and flops_per_token(seq_len) (jaxpar.model.ModelConfig; docs/your_model.md)"
        )
    if not dataclasses.is_dataclass(model) or not model.__dataclass_params__.frozen:
        # --set, --print-config and checkpoints read and replace its fields as a dataclass's
        raise ConfigError(f"model {model_name(model)} is not a frozen dataclass, so --set model.<field>, "
                          "--print-config and checkpoints cannot read its fields; decorate its class with "
                          "@dataclasses.dataclass(frozen=True) (docs/your_model.md §1)")
    unknown = sorted(capabilities(model) - set(CAPABILITIES))
    if unknown:
        raise ConfigError(f"model {model_name(model)} declares unknown capabilities {unknown}; use {sorted(CAPABILITIES)}")
    _check_task_fields(model)
    _check_mesh_divides(model)
    if staged and supports(model, STAGES):
        _check_stages(model)
    if seq_len is not None:
        _check_max_seq_len(model, seq_len)
    if has(model, "check"):
        model.check(dict(sizes))


# What jaxpar's own batches and synthetic data read of a model of each task (one member of
# each tuple): without it they end in a numpy traceback (jaxpar.data.batch, .sources).
TASK_FIELDS = {
    "lm": ((("vocab_size",), "the token ids the data draws and token files must fit"),),
    "classify": ((("in_features", "input_shape"), "each example's inputs"), (("num_classes",), "the targets' range")),
}


def _check_task_fields(model: Any) -> None:
    if has(model, "batch_fields"):  # its own batches, from run(data=...): jaxpar makes none
        return
    for fields, what in TASK_FIELDS.get(model.task, ()):
        if not any(has(model, f) for f in fields):
            raise ConfigError(f"model {model_name(model)}: task={model.task!r} reads model.{' or model.'.join(fields)} "
                              f"({what}), which the config lacks; give it such a field, or a property returning "
                              "yours (docs/your_model.md §1)")


def _check_mesh_divides(model: Any) -> None:
    """Every axis `mesh_divides` names is a mesh axis, every field an integer of the config:
    a misspelt one would be skipped, or end in an AttributeError."""
    where = f"model {model_name(model)}'s mesh_divides"
    for axis, fields in mesh_divides(model).items():
        if axis not in AXES:
            raise ConfigError(f"{where} names mesh axis {axis!r}{did_you_mean(axis, AXES, QUOTED)}; "
                              f"use one of {', '.join(AXES)}")
        for field in fields:
            value = getattr(model, field, None)
            if not isinstance(value, int) or isinstance(value, bool):
                sizes = _int_members(model)
                what = f"which is {value!r}, not an integer" if hasattr(model, field) else "which it lacks"
                raise ConfigError(f"{where}[{axis!r}] names {field!r}, {what}{did_you_mean(field, sizes, QUOTED)}; "
                                  f"name integer fields of the config, such as {', '.join(sizes[:8])}")


def _int_members(model: Any) -> list[str]:
    """The config's public integer members (fields and properties), for a did-you-mean."""
    fields = [f.name for f in dataclasses.fields(model)]
    names = fields + sorted(set(dir(type(model))) - set(fields))
    return [n for n in names if not n.startswith("_") and type(_get(model, n)) is int]


def _get(model: Any, name: str) -> Any:
    try:
        return getattr(model, name)
    except Exception:  # a property of the user's that fails is no candidate, not the error to report
        return None


def _check_stages(model: Any) -> None:
    """A model declaring STAGES whose module lacks the members would fail while tracing
    (a KeyError on 'layers'); its module is built abstractly (no weights) to ask it."""
    if not has(model, "num_layers"):
        raise ConfigError(f"model {model_name(model)} declares the {STAGES!r} capability but has no num_layers (the "
                          "pipeline splits its layer stack by it); give the config a num_layers field or property, or "
                          f"leave {STAGES!r} out of its capabilities")
    with nnx.use_eager_sharding(False):  # shardings come from jaxpar's rules, not a global mesh
        module = nnx.eval_shape(lambda: model.build(nnx.Rngs(0)))
    if not isinstance(module, PipelineStages):
        lacking = [m for m in ("layers", "embed", "apply_layers", "output") if not hasattr(module, m)]
        raise ConfigError(
            f"model {model_name(model)} declares the {STAGES!r} capability, but its module "
            f"{type(module).__name__} lacks {', '.join(lacking)} (jaxpar.model.PipelineStages: its layers stacked "
            "under `layers` by jaxpar.nn.stack_layers, and embed, apply_layers, output); add them, or leave "
            f"{STAGES!r} out of its capabilities and use mesh.stage=1, train.loss_chunks=1"
        )


def _check_max_seq_len(model: Any, seq_len: int) -> None:
    longest = declared(model, "max_seq_len")
    if longest is not None and seq_len > longest:
        field = settable_field(model, "max_seq_len")
        larger = f", or a larger {field}" if field else ""
        raise ConfigError(f"train.seq_len={seq_len} is longer than the {longest} positions model "
                          f"{model_name(model)} covers ({field_name(model, 'max_seq_len', longest)}); use "
                          f"train.seq_len <= {longest}{larger}")


def settable_field(model: Any, member: str) -> str | None:
    """`model.<field>` for the dataclass field that holds `member`: the member itself, or the
    one field a property of that name returns (`num_layers = property(lambda self:
    self.depth)`); None for a property computed otherwise or a class attribute, which
    --set cannot change."""
    fields = {f.name for f in dataclasses.fields(model)} if dataclasses.is_dataclass(model) else set()
    if member in fields:
        return f"model.{member}"
    getter = getattr(getattr(type(model), member, None), "fget", None)
    read = [n for n in getattr(getattr(getter, "__code__", None), "co_names", ()) if n in fields]
    if len(read) == 1 and _get(model, read[0]) == _get(model, member):  # it returns that field as it is
        return f"model.{read[0]}"
    return None


def field_name(model: Any, member: str, value: Any = _DEFAULT) -> str:
    """How an error names the model's `member` (jaxpar's word for it, e.g. num_layers), with
    `=value` where given: the field the user sets (`model.depth=4`), or, where no field holds
    it, the member marked as one --set cannot change."""
    shown = "" if value is _DEFAULT else f"={value}"
    field = settable_field(model, member)
    if field:
        return field + shown
    kind = "property" if isinstance(getattr(type(model), member, None), property) else "class attribute"
    return f"the model's {member}{shown} (a {kind} of {model_name(model)}, not a field --set can change)"


__all__ = [
    "ATTENTION", "CAPABILITIES", "EXPERTS", "MEMBERS", "PROJECTIONS", "REMAT", "SEQUENCE", "STAGES",
    "ModelConfig", "PipelineStages", "axis_names", "capabilities", "check_model", "declared", "field_name", "has",
    "lacks", "mesh_divides", "settable_field", "supports",
]
