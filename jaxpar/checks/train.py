"""The train section: step counts, seed, profiling, how the batch splits, evaluation."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.config import parse_steps
from jaxpar.errors import ConfigError

RULES: list[Rule] = []
rule = collector(RULES)

TRAIN_COUNTS = ("steps", "global_batch", "seq_len", "microbatches")


@rule(
    "train-counts-positive",
    fields=[f"train.{f}" for f in TRAIN_COUNTS],
    summary="Steps, global batch, sequence length and microbatches are positive integers.",
    example=["train.steps=0"],
)
def train_counts_positive(config, sizes) -> None:
    for field in TRAIN_COUNTS:
        if getattr(config.train, field) < 1:
            raise ConfigError(f"train.{field}={getattr(config.train, field)} must be a positive integer")


@rule(
    "train-seed-and-peak",
    fields=["train.seed", "train.peak_tflops"],
    summary="The seed is a non-negative integer; train.peak_tflops is 0 (look the device up) or positive.",
    example=["train.seed=-1"],
    also=[["train.peak_tflops=-1"]],
)
def train_seed_and_peak(config, sizes) -> None:
    if config.train.seed < 0:  # numpy's generators, which draw the data, take none below 0
        raise ConfigError(f"train.seed={config.train.seed} must be 0 or more")
    if not 0 <= config.train.peak_tflops < float("inf"):
        raise ConfigError(f"train.peak_tflops={config.train.peak_tflops} must be 0 (look up the device kind) or a "
                          "positive TFLOP/s per device, e.g. 989 for an H100's bf16")


@rule(
    "fp8-expert-block",
    fields=["train.fp8_expert_block"],
    summary="train.fp8_expert_block, the FP8 experts' scale tile along the contraction, is 0 (one scale per row "
    "and column) or positive (DeepSeek-V3's 128).",
    example=["train.fp8_expert_block=-1"],
)
def fp8_expert_block(config, sizes) -> None:
    if config.train.fp8_expert_block < 0:
        raise ConfigError(f"train.fp8_expert_block={config.train.fp8_expert_block} must be 0 (one scale per row and "
                          "column over the whole contraction) or a positive tile, e.g. 128 (DeepSeek-V3's)")


@rule(
    "profile-steps",
    fields=["train.profile_steps", "train.steps"],
    summary="train.profile_steps is empty or START:STOP with 0 <= START < STOP <= train.steps (it traces steps "
    "START+1 to STOP, as the log lines number them).",
    example=["train.profile_steps=8:5"],
    also=[["train.profile_steps=5"], ["train.steps=10", "train.profile_steps=5:20"]],
)
def profile_steps(config, sizes) -> None:
    window = parse_steps(config.train.profile_steps)
    if window is not None and window[1] > config.train.steps:
        raise ConfigError(f"train.profile_steps={config.train.profile_steps} ends after the run's last step "
                          f"(train.steps={config.train.steps}); use STOP <= {config.train.steps}")


@rule(
    "batch-divides-data-ways",
    fields=["train.global_batch", "train.microbatches", "mesh.data", "mesh.fsdp", "mesh.expert"],
    summary="Every microbatch splits evenly over the batch axes: data x fsdp x expert x microbatches divides "
    "the global batch.",
    example=["train.global_batch=12"],
)
def batch_divides_data_ways(config, sizes) -> None:
    train = config.train
    need = sizes["data"] * sizes["fsdp"] * sizes["expert"] * train.microbatches
    if train.global_batch % need:
        raise ConfigError(
            f"train.global_batch={train.global_batch} is not divisible by data x fsdp x expert x microbatches "
            f"= {sizes['data']} x {sizes['fsdp']} x {sizes['expert']} x {train.microbatches} = {need}; "
            f"use a multiple of {need}, e.g. {need * max(1, round(train.global_batch / need))}"
        )


@rule(
    "two-batch-overlap-rows",
    fields=["parallel.two_batch_overlap", "train.global_batch", "train.microbatches", "mesh.data", "mesh.fsdp",
            "mesh.expert"],
    summary="parallel.two_batch_overlap halves each device's rows of a microbatch: they are even.",
    example=["parallel.two_batch_overlap=true", "mesh.data=8", "train.global_batch=8"],
)
def two_batch_overlap_rows(config, sizes) -> None:
    train = config.train
    ways = sizes["data"] * sizes["fsdp"] * sizes["expert"] * train.microbatches
    rows = train.global_batch // ways
    if config.parallel.two_batch_overlap and rows % 2:
        raise ConfigError(
            f"parallel.two_batch_overlap=true runs each layer on two halves of a device's rows, but each holds "
            f"train.global_batch / (data x fsdp x expert x microbatches) = {train.global_batch} / {ways} = {rows}; "
            f"use train.global_batch={2 * rows * ways}, or parallel.two_batch_overlap=false")


@rule(
    "eval-every",
    fields=["train.eval_every"],
    summary="Held-out evaluation runs every so many steps, or (0) never.",
    example=["train.eval_every=-1"],
)
def eval_every(config, sizes) -> None:
    if config.train.eval_every < 0:
        raise ConfigError(
            f"train.eval_every={config.train.eval_every}; use a number of steps between evaluations "
            "(e.g. train.eval_every=100), or 0 for none"
        )


@rule(
    "eval-batches-positive",
    fields=["train.eval_batches"],
    summary="An evaluation averages the loss over at least one held-out global batch.",
    example=["train.eval_batches=0"],
)
def eval_batches_positive(config, sizes) -> None:
    if config.train.eval_batches < 1:
        raise ConfigError(
            f"train.eval_batches={config.train.eval_batches} must be a positive number of held-out global batches; "
            "e.g. train.eval_batches=4"
        )
