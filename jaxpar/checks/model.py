"""The model's own fields, before any mesh axis is held against them (what the model
configs' `validate()` checked)."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError
from jaxpar.kernels.experts import ROUTINGS
from jaxpar.mesh import divisors
from jaxpar.nn import REMAT_POLICIES
from models.llama import LlamaConfig
from models.mlp import MLPConfig
from models.moe import MoEConfig

RULES: list[Rule] = []
rule = collector(RULES)

LLAMA_SIZES = ("vocab_size", "embed", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp")
MLP_SIZES = ("in_features", "hidden", "num_classes")
MOE_WEIGHTS = ("shared_experts", "aux_loss_weight", "z_loss_weight", "bias_update_rate")


@rule(
    "kv-heads-divide-heads",
    fields=["model.num_kv_heads", "model.num_heads"],
    summary="Grouped-query attention shares each kv head among a whole number of query heads.",
    example=["model.num_kv_heads=3"],
)
def kv_heads_divide_heads(config, sizes) -> None:
    model = config.model
    if isinstance(model, LlamaConfig) and model.num_kv_heads != 0 and model.num_heads % model.num_kv_heads:
        raise ConfigError(
            f"model.num_kv_heads={model.num_kv_heads} does not divide model.num_heads={model.num_heads}; "
            f"use one of {divisors(model.num_heads)}"
        )


@rule(
    "head-dim-even",
    fields=["model.head_dim"],
    summary="RoPE rotates pairs of channels, so the head dimension is even.",
    example=["model.head_dim=7"],
)
def head_dim_even(config, sizes) -> None:
    model = config.model
    if isinstance(model, LlamaConfig) and model.head_dim >= 1 and model.head_dim % 2:
        raise ConfigError(f"model.head_dim={model.head_dim} must be even for RoPE; use {model.head_dim + 1}")


@rule(
    "remat-policy",
    fields=["model.remat"],
    summary="model.remat names one of the rematerialisation policies of jaxpar.nn.",
    example=["model.remat=some"],
)
def remat_policy(config, sizes) -> None:
    model = config.model
    if isinstance(model, LlamaConfig) and model.remat not in REMAT_POLICIES:
        raise ConfigError(f"model.remat={model.remat!r} is not a remat policy; use one of {', '.join(REMAT_POLICIES)}")


# After the rules above, as before the catalogue; they leave kv heads of 0 (which used to
# divide by zero) and a head_dim below 1 (-3 was told to use -2) to this one.
@rule(
    "model-sizes-positive",
    fields=[f"model.{f}" for f in LLAMA_SIZES + MLP_SIZES],
    summary="Every size of the model (layers, widths, heads, vocabulary; an MLP's features and classes) is a "
    "positive integer.",
    example=["model.num_layers=0"],
    also=[["model.num_kv_heads=0"]],
)
def model_sizes_positive(config, sizes) -> None:
    model = config.model
    for field in LLAMA_SIZES if isinstance(model, LlamaConfig) else MLP_SIZES if isinstance(model, MLPConfig) else ():
        if getattr(model, field) < 1:
            raise ConfigError(f"model.{field}={getattr(model, field)} must be a positive integer")


@rule(
    "moe-num-experts-positive",
    fields=["model.num_experts"],
    summary="An MoE model has at least one expert.",
    example=["model.num_experts=0"],
    base="moe",
)
def moe_num_experts_positive(config, sizes) -> None:
    model = config.model
    if isinstance(model, MoEConfig) and model.num_experts < 1:
        raise ConfigError(f"model.num_experts={model.num_experts} must be a positive integer; e.g. model.num_experts=8")


@rule(
    "moe-top-k-range",
    fields=["model.top_k", "model.num_experts"],
    summary="Each token picks between 1 and model.num_experts experts.",
    example=["model.top_k=5"],
    base="moe",
)
def moe_top_k_range(config, sizes) -> None:
    model = config.model
    if isinstance(model, MoEConfig) and not 1 <= model.top_k <= model.num_experts:
        raise ConfigError(
            f"model.top_k={model.top_k} must be between 1 and model.num_experts={model.num_experts}; "
            f"e.g. model.top_k={min(2, model.num_experts)}"
        )


@rule(
    "moe-routing",
    fields=["model.routing"],
    summary="model.routing names a router: capacity (drops past the capacity factor) or dropless.",
    example=["model.routing=random"],
    base="moe",
)
def moe_routing(config, sizes) -> None:
    model = config.model
    if isinstance(model, MoEConfig) and model.routing not in ROUTINGS:
        raise ConfigError(f"model.routing={model.routing!r} is not a router option; use one of {', '.join(ROUTINGS)}")


@rule(
    "moe-capacity-factor-positive",
    fields=["model.capacity_factor"],
    summary="Capacity routing gives each expert a positive multiple of its balanced share.",
    example=["model.capacity_factor=0"],
    base="moe",
)
def moe_capacity_factor_positive(config, sizes) -> None:
    model = config.model
    if isinstance(model, MoEConfig) and not model.capacity_factor > 0:
        raise ConfigError(
            f"model.capacity_factor={model.capacity_factor} must be > 0 (1.0 is each expert's balanced share); "
            "e.g. 1.25, or model.routing=dropless to drop nothing"
        )


@rule(
    "moe-weights-nonnegative",
    fields=[f"model.{f}" for f in MOE_WEIGHTS],
    summary="Shared experts, the balancing loss weights and the bias update rate are >= 0 (0 turns one off).",
    example=["model.aux_loss_weight=-1"],
    base="moe",
)
def moe_weights_nonnegative(config, sizes) -> None:
    model = config.model
    for field in MOE_WEIGHTS if isinstance(model, MoEConfig) else ():
        if getattr(model, field) < 0:
            raise ConfigError(f"model.{field}={getattr(model, field)} must be >= 0; use 0 to turn it off")
