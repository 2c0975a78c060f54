"""The checkpoint section: saving, keeping, and starting from a Hugging Face checkpoint."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError

RULES: list[Rule] = []
rule = collector(RULES)


@rule(
    "checkpoint-every",
    fields=["checkpoint.every"],
    summary="Checkpoints are saved every so many steps, or (0) only at the end.",
    example=["checkpoint.every=-1"],
)
def checkpoint_every(config, sizes) -> None:
    if config.checkpoint.every < 0:
        raise ConfigError(f"checkpoint.every={config.checkpoint.every}; use a number of steps, or 0 to save only at the end")


@rule(
    "checkpoint-keep",
    fields=["checkpoint.keep"],
    summary="At least the newest checkpoint is kept.",
    example=["checkpoint.keep=0"],
)
def checkpoint_keep(config, sizes) -> None:
    if config.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep={config.checkpoint.keep}; keep at least 1 checkpoint, e.g. checkpoint.keep=3")


@rule(
    "init-from-needs-hf-format",
    fields=["checkpoint.init_from", "model"],
    summary="Starting from a Hugging Face checkpoint needs a model that declares Hugging Face's format (jaxpar.hf).",
    example=["checkpoint.init_from=checkpoints/llama"],
    base="mlp",
)
def init_from_needs_hf_format(config, sizes) -> None:
    if config.checkpoint.init_from:
        from jaxpar.hf.format import format_of

        try:
            format_of(config.model)
        except ConfigError as e:
            raise ConfigError(f"checkpoint.init_from={config.checkpoint.init_from!r}: {e}") from None
