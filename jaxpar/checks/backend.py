"""What `build` checked itself before the catalogue: the devices' backend (run only when
validate is told the platform), then the rule-table overrides."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError
from jaxpar.sharding.rules import parse_table

RULES: list[Rule] = []
rule = collector(RULES)


@rule(
    "pallas-needs-gpu",
    fields=["parallel.attention_kernel"],
    summary="attention_kernel=pallas lowers through Triton, so it needs GPUs (pallas_interpret runs anywhere).",
    example=["mesh.context=2", "parallel.attention_kernel=pallas", "model.head_dim=16", "train.seq_len=128"],
    needs="platform",
)
def pallas_needs_gpu(config, platform: str) -> None:
    if config.parallel.attention_kernel == "pallas" and platform != "gpu":
        raise ConfigError(
            f"parallel.attention_kernel=pallas lowers through Triton for GPUs, but the devices are {platform}; "
            "use pallas_interpret (the same kernel in the Pallas interpreter: slow, for checking) or jax"
        )


@rule(
    "ragged-exchange-needs-gpu",
    fields=["parallel.expert_exchange"],
    summary="expert_exchange=ragged needs jax.lax.ragged_all_to_all, which only GPUs have.",
    example=["parallel.expert_exchange=ragged"],
    needs="platform",
)
def ragged_exchange_needs_gpu(config, platform: str) -> None:
    if config.parallel.expert_exchange == "ragged" and platform != "gpu":
        raise ConfigError(
            f"parallel.expert_exchange=ragged needs jax.lax.ragged_all_to_all, which the {platform} backend "
            "lacks; use padded (or auto, which picks ragged on GPUs)"
        )


@rule(
    "compiler-preset",
    fields=["compiler.preset"],
    summary="The XLA option preset is auto (overlap on GPUs), overlap or none.",
    example=["compiler.preset=fast"],
)
def compiler_preset(config, sizes) -> None:
    from jaxpar.xla_options import PRESETS

    if config.compiler.preset not in PRESETS:
        raise ConfigError(f"compiler.preset={config.compiler.preset!r}; use one of {', '.join(PRESETS)}")


@rule(
    "compiler-options-parse",
    fields=["compiler.options"],
    summary="Compiler options read 'name=value,...'.",
    example=["compiler.options=xla_gpu_enable_latency_hiding_scheduler"],
)
def compiler_options_parse(config, sizes) -> None:
    from jaxpar.xla_options import parse_options

    parse_options(config.compiler.options)


@rule(
    "compiler-options-known",
    fields=["compiler.options"],
    summary="Every compiler option is one the installed jaxlib accepts, with a valid value (an unknown one "
    "would fail the compile; the preset's own options are checked too and left out when unknown).",
    example=["compiler.options=xla_gpu_no_such_option=true"],
    also=[["compiler.options=xla_gpu_pipeline_all_gather=on"]],
    needs="platform",
)
def compiler_options_known(config, platform: str) -> None:
    from jaxpar.xla_options import step_options

    step_options(config, platform)


# parse_table also reads the tables for build, so its two messages stay there and this
# rule wraps them; `also` breaks the other one.
@rule(
    "rule-overrides-parse",
    fields=["parallel.storage_rules", "parallel.compute_rules"],
    summary="Rule overrides read 'logical=axis+axis,...' and name only mesh axes.",
    example=["parallel.storage_rules=embed=gpu"],
    also=[["parallel.compute_rules=embed"]],
)
def rule_overrides_parse(config, sizes) -> None:
    for field in ("storage_rules", "compute_rules"):
        parse_table(getattr(config.parallel, field), f"parallel.{field}")
