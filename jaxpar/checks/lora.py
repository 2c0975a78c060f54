"""The lora section: adapters' numbers, and what they combine with (jaxpar.step.lora).
Which weights the patterns match, and ranks against their shapes, are checked on the model
itself when the trainer is built (jaxpar.step.lora.plan), still before the compile."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError

RULES: list[Rule] = []
rule = collector(RULES)


@rule(
    "lora-values",
    fields=["lora.rank", "lora.alpha"],
    summary="LoRA's rank is 0 (no adapters) or positive, and its alpha (the adapters' scale is alpha / rank) positive.",
    example=["lora.rank=-4"],
    also=[["lora.rank=8", "lora.alpha=0"]],
)
def lora_values(config, sizes) -> None:
    lora = config.lora
    if lora.rank < 0:
        raise ConfigError(f"lora.rank={lora.rank} makes no sense; use 0 for no adapters, or a rank such as 8 or 16")
    if lora.rank and not lora.alpha > 0:
        raise ConfigError(f"lora.alpha={lora.alpha} must be positive (the adapters add alpha / rank x A @ B); 16 or "
                          "2 x lora.rank are usual")


@rule(
    "lora-settings-need-rank",
    fields=["lora.targets", "lora.init_from", "lora.rank"],
    summary="lora.targets and lora.init_from shape adapters, which need lora.rank > 0.",
    example=["lora.targets=*.wq"],
    also=[["lora.init_from=/adapters/a"]],
)
def lora_settings_need_rank(config, sizes) -> None:
    for field in ("targets", "init_from"):
        value = getattr(config.lora, field)
        if value and not config.lora.rank:
            raise ConfigError(f"lora.{field}={value!r} shapes adapters, but lora.rank=0 adds none; set lora.rank (the "
                              f"adapter's r), or leave lora.{field} empty")


@rule(
    "lora-adapter-needs-base",
    fields=["lora.init_from", "checkpoint.init_from"],
    summary="An adapter to start from (lora.init_from) adapts the Hugging Face checkpoint it was trained on, "
    "checkpoint.init_from.",
    example=["lora.rank=4", "lora.init_from=/adapters/a"],
)
def lora_adapter_needs_base(config, sizes) -> None:
    if config.lora.init_from and not config.checkpoint.init_from:
        raise ConfigError(f"lora.init_from={config.lora.init_from!r} is an adapter of a Hugging Face checkpoint, but "
                          "checkpoint.init_from is empty; train the recipe hf:BASE (the adapter's base model folder)")


@rule(
    "lora-without-compression",
    fields=["lora.rank", "parallel.compression.method"],
    summary="LoRA runs under every layout; not with gradient compression (the adapters' gradients are small already).",
    example=["lora.rank=4", "parallel.compression.method=powersgd", "mesh.data=2", "mesh.hosts.data=2", "mesh.fsdp=4"],
)
def lora_without_compression(config, sizes) -> None:
    if not config.lora.rank:
        return
    if config.parallel.compression.method != "none":
        raise ConfigError(f"parallel.compression.method={config.parallel.compression.method} with lora.rank="
                          f"{config.lora.rank}: the adapters' gradients are small already, and compression is not "
                          "built for them; set parallel.compression.method=none")
