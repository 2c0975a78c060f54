"""DiLoCo (parallel.diloco): its numbers, and what a group's step composes with."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError
from jaxpar.model import declared

RULES: list[Rule] = []
rule = collector(RULES)


@rule(
    "diloco-values",
    fields=["parallel.diloco.inner_steps", "parallel.diloco.outer_lr", "parallel.diloco.outer_momentum",
            "parallel.diloco.fragments", "parallel.diloco.delay", "parallel.diloco.mix",
            "parallel.diloco.quantization_block", "parallel.diloco.topk_fraction"],
    summary="DiLoCo's numbers: inner_steps >= 0 (0: off), a positive outer_lr, outer_momentum in [0, 1), fragments "
    "that divide inner_steps into periods of at least delay + 1 steps (delay 0 or 1), mix in [0, 1], a positive "
    "quantization_block, a topk_fraction in (0, 1].",
    example=["parallel.diloco.inner_steps=4", "parallel.diloco.fragments=3"],
    also=[["parallel.diloco.inner_steps=-1"], ["parallel.diloco.inner_steps=4", "parallel.diloco.outer_lr=0"],
          ["parallel.diloco.inner_steps=4", "parallel.diloco.outer_momentum=1"],
          ["parallel.diloco.inner_steps=4", "parallel.diloco.delay=2"],
          ["parallel.diloco.inner_steps=2", "parallel.diloco.fragments=2", "parallel.diloco.delay=1"],
          ["parallel.diloco.inner_steps=4", "parallel.diloco.mix=1.5"],
          ["parallel.diloco.inner_steps=4", "parallel.diloco.quantization_block=0"],
          ["parallel.diloco.inner_steps=4", "parallel.diloco.topk_fraction=0"]],
)
def diloco_values(config, sizes) -> None:
    d = config.parallel.diloco
    if d.inner_steps < 0:
        raise ConfigError(f"parallel.diloco.inner_steps={d.inner_steps}; use 0 (off) or the inner steps between "
                          "synchronisations, e.g. 100")
    if not d.inner_steps:
        return
    ranges = {"outer_lr": (d.outer_lr > 0, "a positive outer learning rate, e.g. 0.7"),
              "outer_momentum": (0 <= d.outer_momentum < 1, "in [0, 1), e.g. 0.9"),
              "mix": (0 <= d.mix <= 1, "in [0, 1] (0: the new global weights)"),
              "quantization_block": (d.quantization_block > 0, "a positive block, e.g. 256"),
              "topk_fraction": (0 < d.topk_fraction <= 1, "in (0, 1], e.g. 0.01"),
              "delay": (d.delay in (0, 1), "0 (the exchange after the step) or 1 (beside it)")}
    for field, (holds, what) in ranges.items():
        if not holds:
            raise ConfigError(f"parallel.diloco.{field}={getattr(d, field)}; use {what}")
    if d.fragments < 1 or d.inner_steps % d.fragments:
        raise ConfigError(f"parallel.diloco.fragments={d.fragments} must divide parallel.diloco.inner_steps="
                          f"{d.inner_steps} (a fragment synchronises every inner_steps / fragments steps); use one of "
                          f"{[f for f in range(1, d.inner_steps + 1) if d.inner_steps % f == 0]}")
    if d.delay >= d.inner_steps // d.fragments:
        raise ConfigError(f"parallel.diloco.delay={d.delay} needs periods longer than it, but inner_steps / fragments = "
                          f"{d.inner_steps // d.fragments}; use delay=0, or more inner_steps per fragment")
    layers = declared(config.model, "num_layers")
    if d.fragments > 1 and layers is not None and d.fragments > layers:
        raise ConfigError(f"parallel.diloco.fragments={d.fragments} strides the {layers} layers of the stack; use at "
                          f"most {layers} fragments")


@rule(
    "diloco-support",
    fields=["parallel.diloco.inner_steps", "parallel.zero.stage", "mesh.stage", "parallel.compression.method",
            "parallel.zero.quantized_gradients", "parallel.zero.offload_optimizer", "parallel.zero.offload_params",
            "lora.rank"],
    summary="DiLoCo's groups are mesh.data's replicas, each with its own weights and optimizer state: no ZeRO over "
    "data (shard inside a group with mesh.fsdp), no reduction over data to compress, and not yet with pipeline "
    "stages, host offload or LoRA.",
    example=["parallel.diloco.inner_steps=4", "mesh.data=8", "mesh.tensor=1", "parallel.zero.stage=1"],
    also=[["parallel.diloco.inner_steps=4", "mesh.stage=2", "mesh.data=4", "mesh.tensor=1", "train.microbatches=2"],
          ["parallel.diloco.inner_steps=4", "mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1", "parallel.compression.method=topk",
           "mesh.hosts.data=2"],
          ["parallel.diloco.inner_steps=4", "mesh.data=8", "mesh.tensor=1", "parallel.zero.offload_optimizer=true"],
          ["parallel.diloco.inner_steps=4", "lora.rank=4"]],
)
def diloco_support(config, sizes) -> None:
    d = config.parallel.diloco
    if not d.inner_steps:
        return
    zero, head = config.parallel.zero, f"parallel.diloco.inner_steps={d.inner_steps}"
    if zero.stage:
        raise ConfigError(f"{head} with parallel.zero.stage={zero.stage}: ZeRO shards state over mesh.data, whose "
                          "replicas are DiLoCo's groups, each with its own; set parallel.zero.stage=0 and shard inside "
                          "a group with mesh.fsdp")
    if config.parallel.compression.method != "none" or zero.quantized_gradients:
        raise ConfigError(f"{head}: no gradient is reduced over mesh.data between DiLoCo's groups, so there is none "
                          "to compress; set parallel.compression.method=none (and parallel.zero.quantized_gradients="
                          "false), and parallel.diloco.compression=int8 for the outer exchange")
    unsupported = {"mesh.stage": sizes.get("stage", 1) > 1, "parallel.zero.offload_optimizer": zero.offload_optimizer,
                   "parallel.zero.offload_params": zero.offload_params, "lora.rank": config.lora.rank > 0}
    for field, on in unsupported.items():
        if on:
            raise ConfigError(f"{head} with {field} set: a DiLoCo group's step does not run that yet; set "
                              "parallel.diloco.inner_steps=0, or leave " + field + " at its default")
