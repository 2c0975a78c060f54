"""Pipeline parallelism over mesh.stage: its options, the layers and microbatches it splits, and what does
not run inside its stages yet."""

from __future__ import annotations

import dataclasses

from jaxpar.checks.rule import Rule, collector
from jaxpar.config import PipelineConfig
from jaxpar.errors import ConfigError
from jaxpar.mesh import divisors
from jaxpar.model import STAGES, field_name, lacks, settable_field, supports
from jaxpar.pipeline.split import balanced_layers, compact, leading_layers, parse_layers

RULES: list[Rule] = []
rule = collector(RULES)



@rule(
    "pipeline-chunks-positive",
    fields=["parallel.pipeline.chunks"],
    summary="Each device holds a positive number of model chunks.",
    example=["parallel.pipeline.chunks=0"],
)
def pipeline_chunks_positive(config, sizes) -> None:
    v = config.parallel.pipeline.chunks
    if v < 1:
        raise ConfigError(f"parallel.pipeline.chunks={v} must be a positive number of chunks per device; e.g. 2")


@rule(
    "pipeline-chunks-need-interleaved",
    fields=["parallel.pipeline.chunks", "parallel.pipeline.schedule"],
    summary="Only the interleaved schedule runs several model chunks per device.",
    example=["parallel.pipeline.chunks=2"],
)
def pipeline_chunks_need_interleaved(config, sizes) -> None:
    name, v = config.parallel.pipeline.schedule, config.parallel.pipeline.chunks
    if v > 1 and name != "interleaved":
        raise ConfigError(
            f"parallel.pipeline.chunks={v} gives each device several model chunks, which only the interleaved "
            f"schedule runs, but parallel.pipeline.schedule={name}; use parallel.pipeline.schedule=interleaved or parallel.pipeline.chunks=1"
        )


# The parallel.pipeline.chunks arm cannot fire: chunks > 1 needs interleaved (the rule above), and a
# non-default schedule fails here first. It stays so the rule reads as what it means.
@rule(
    "pipeline-options-need-stages",
    fields=["parallel.pipeline.schedule", "parallel.pipeline.chunks", "mesh.stage"],
    summary="Pipeline options left off their defaults need a pipeline, mesh.stage > 1.",
    example=["parallel.pipeline.schedule=gpipe"],
)
def pipeline_options_need_stages(config, sizes) -> None:
    if sizes["stage"] > 1:
        return
    asked, default = config.parallel.pipeline, PipelineConfig()
    for field in dataclasses.fields(PipelineConfig):
        value, plain = getattr(asked, field.name), getattr(default, field.name)
        if value != plain:
            raise ConfigError(
                f"parallel.pipeline.{field.name}={value!r} shapes a pipeline, but mesh.stage=1 runs none; "
                f"set mesh.stage>1, or leave parallel.pipeline.{field.name} at {plain!r}"
            )


@rule(
    "pipeline-needs-stages",
    fields=["mesh.stage", "model"],
    summary="Only a model that declares the 'stages' capability (jaxpar.model.PipelineStages: embed, layer stack, "
    "output) is cut into pipeline stages; its config has num_layers.",
    example=["mesh.stage=2"],
    base="mlp",
)
def pipeline_needs_stages(config, sizes) -> None:
    p = sizes["stage"]
    if p > 1 and not supports(config.model, STAGES):
        raise lacks(config.model, STAGES, f"mesh.stage={p}", "use mesh.stage=1")


@rule(
    "pipeline-layers-or-balance",
    fields=["parallel.pipeline.layers", "parallel.pipeline.balance"],
    summary="Layers per stage come from a list or from a rule, not both.",
    example=["mesh.stage=2", "parallel.pipeline.layers=1,3", "parallel.pipeline.balance=balanced"],
)
def pipeline_layers_or_balance(config, sizes) -> None:
    pipeline = config.parallel.pipeline
    if pipeline.layers and pipeline.balance != "even":
        raise ConfigError(f"parallel.pipeline.layers={pipeline.layers!r} lists each stage's layers, and "
                          f"parallel.pipeline.balance={pipeline.balance} would choose them; set one of the two")


@rule(
    "pipeline-layers-list",
    fields=["parallel.pipeline.layers", "mesh.stage", "parallel.pipeline.chunks"],
    summary="parallel.pipeline.layers lists one count per virtual stage (mesh.stage x parallel.pipeline.chunks), "
    "written N or N*K.",
    example=["mesh.stage=2", "parallel.pipeline.layers=1,1,2"],
)
def pipeline_layers_list(config, sizes) -> None:
    text, p, v = config.parallel.pipeline.layers, sizes["stage"], config.parallel.pipeline.chunks
    if not text or p == 1:
        return
    try:
        counts = parse_layers(text)
    except ValueError as e:
        raise ConfigError(f"parallel.pipeline.layers={text!r}: {e}; write counts like '3,4*14,2'") from None
    if len(counts) != p * v:
        raise ConfigError(f"parallel.pipeline.layers={text!r} lists {len(counts)} stages, but mesh.stage x "
                          f"parallel.pipeline.chunks = {p} x {v} = {p * v} virtual stages run; give {p * v} counts")


@rule(
    "pipeline-layers-sum",
    fields=["parallel.pipeline.layers", "model.num_layers"],
    summary="parallel.pipeline.layers counts every layer of the model once (a model's leading layers, DeepSeek's "
    "dense ones, on the first stage).",
    example=["mesh.stage=2", "parallel.pipeline.layers=1,2"],
)
def pipeline_layers_sum(config, sizes) -> None:
    counts = _listed(config, sizes)
    if counts is None:
        return
    model, leading = config.model, leading_layers(config.model)
    total = model.num_layers + leading
    if sum(counts) != total:
        parts = f" = {leading} leading + {model.num_layers} in the stack" if leading else ""
        raise ConfigError(f"parallel.pipeline.layers={config.parallel.pipeline.layers!r} holds {sum(counts)} layers, "
                          f"but the model has {total}{parts}; give counts that sum to {total}")


@rule(
    "pipeline-layers-leading",
    fields=["parallel.pipeline.layers"],
    summary="The first stage holds the layers the model runs with its embedding (DeepSeek's leading dense ones).",
    example=["mesh.stage=2", "mesh.data=4", "parallel.pipeline.layers=0,3"],
    base="deepseek",
)
def pipeline_layers_leading(config, sizes) -> None:
    counts, leading = _listed(config, sizes), leading_layers(config.model)
    if counts is not None and counts[0] < leading:
        raise ConfigError(f"parallel.pipeline.layers={config.parallel.pipeline.layers!r} puts {counts[0]} layers on "
                          f"the first stage, but the model's embedding runs its {leading} leading layers there; "
                          f"start the list with at least {leading}")


@rule(
    "pipeline-layers-empty-stage",
    fields=["parallel.pipeline.layers"],
    summary="Only the first and last virtual stages may hold no layers (a middle one would pass its input on "
    "for a tick and do nothing).",
    example=["mesh.stage=4", "mesh.data=2", "parallel.pipeline.layers=1,0,1,0"],
)
def pipeline_layers_empty_stage(config, sizes) -> None:
    counts = _listed(config, sizes)
    if counts is not None and 0 in counts[1:-1]:
        raise ConfigError(f"parallel.pipeline.layers={config.parallel.pipeline.layers!r} leaves virtual stage "
                          f"{counts.index(0, 1)} empty; give every stage but the first and last at least one layer")


@rule(
    "pipeline-layers-split",
    fields=["model.num_layers", "mesh.stage", "parallel.pipeline.chunks", "parallel.pipeline.balance"],
    summary="Without a list of layers per stage, parallel.pipeline.balance=even splits the layers into equal "
    "chunks (mesh.stage x parallel.pipeline.chunks divides them), and balanced needs a layer for every middle stage.",
    example=["mesh.stage=4"],
    also=[["mesh.stage=4", "mesh.data=2", "parallel.pipeline.schedule=interleaved", "parallel.pipeline.chunks=2",
           "train.microbatches=4", "parallel.pipeline.balance=balanced"]],
)
def pipeline_layers_split(config, sizes) -> None:
    p, v, pipeline = sizes["stage"], config.parallel.pipeline.chunks, config.parallel.pipeline
    layers = config.model.num_layers if p > 1 else 0  # a model with stages here: pipeline-needs-stages passed
    if p == 1 or pipeline.layers:
        return
    suggested = _suggest(config, sizes)
    named = field_name(config.model, "num_layers", layers)  # the user's own field where an alias reads one
    if pipeline.balance == "balanced" and suggested is None:
        raise ConfigError(f"parallel.pipeline.balance=balanced: {named} cannot fill mesh.stage x "
                          f"parallel.pipeline.chunks = {p} x {v} = {p * v} virtual stages (each but the first and last "
                          f"holds a layer); use fewer stages or chunks")
    if layers % (p * v) and pipeline.balance == "even":
        stages = [d // v for d in divisors(layers) if d % v == 0 and d // v > 1]
        field = settable_field(config.model, "num_layers")
        raise ConfigError(
            f"{named} does not split evenly into mesh.stage x parallel.pipeline.chunks = "
            f"{p} x {v} = {p * v} chunks; use "
            + (f"parallel.pipeline.balance=balanced (here parallel.pipeline.layers={compact(suggested)}), "
               if suggested else "")
            + (f"{field} a multiple of {p * v}" if field else f"a multiple of {p * v} layers")
            + (f", or mesh.stage in {stages}" if stages else "")
        )


def _listed(config, sizes) -> tuple[int, ...] | None:
    """The listed counts, where the list applies and parses (else the rules above refuse it)."""
    text, p, v = config.parallel.pipeline.layers, sizes["stage"], config.parallel.pipeline.chunks
    if not text or p == 1:
        return None
    try:
        counts = parse_layers(text)
    except ValueError:
        return None
    return counts if len(counts) == p * v else None


def _suggest(config, sizes) -> tuple[int, ...] | None:
    """The balanced whole-model counts (None: too few layers to fill the stages)."""
    try:
        return balanced_layers(config.model, sizes["stage"] * config.parallel.pipeline.chunks, config.train.seq_len)
    except ValueError:
        return None


@rule(
    "pipeline-microbatches-per-stage",
    fields=["train.microbatches", "mesh.stage", "parallel.pipeline.schedule"],
    summary="1f1b and zb-h1 need at least one microbatch per stage.",
    example=["mesh.stage=2"],
)
def pipeline_microbatches_per_stage(config, sizes) -> None:
    p, name, m = sizes["stage"], config.parallel.pipeline.schedule, config.train.microbatches
    if p > 1 and name in ("1f1b", "zb-h1") and m < p:
        raise ConfigError(
            f"parallel.pipeline.schedule={name} needs at least one microbatch per stage: train.microbatches={m} < "
            f"mesh.stage={p}; use train.microbatches>={p} (more shrinks the bubble, "
            f"{'(p-1)/(3m+p-1)' if name == 'zb-h1' else '(p-1)/(m+p-1)'})"
        )


@rule(
    "interleaved-microbatch-groups",
    fields=["train.microbatches", "mesh.stage", "parallel.pipeline.schedule"],
    summary="The interleaved schedule sends microbatches in groups of mesh.stage.",
    example=["mesh.stage=2", "parallel.pipeline.schedule=interleaved", "train.microbatches=3", "train.global_batch=24"],
)
def interleaved_microbatch_groups(config, sizes) -> None:
    p, m = sizes["stage"], config.train.microbatches
    if p > 1 and config.parallel.pipeline.schedule == "interleaved" and m % p:
        raise ConfigError(
            f"parallel.pipeline.schedule=interleaved sends microbatches in groups of mesh.stage={p}, but "
            f"train.microbatches={m}; use a multiple of {p}, e.g. {p * max(1, round(m / p))}"
        )


@rule(
    "pipeline-ring-of-two",
    fields=["mesh.stage", "mesh.context", "parallel.context.impl"],
    summary="Inside pipeline stages ring attention runs on rings of two devices (mesh.context=2).",
    example=["mesh.stage=2", "train.microbatches=2", "mesh.context=4", "parallel.context.impl=ring"],
)
def pipeline_ring_of_two(config, sizes) -> None:
    p, n = sizes["stage"], sizes["context"]
    if p > 1 and n > 2 and config.parallel.context.impl == "ring":
        raise ConfigError(
            f"parallel.context.impl=ring with mesh.stage={p} and mesh.context={n}: inside pipeline stages, where "
            "devices of different stages run different branches of one switch, a ring step is an all-to-all "
            "between two devices (a collective-permute would wait for every stage), so the ring holds two; "
            "use mesh.context=2, or parallel.context.impl=ulysses or allgather"
        )


@rule(
    "pipeline-collective-matmul-pairs",
    fields=["mesh.stage", "mesh.tensor", "parallel.tensor.collective_matmul"],
    summary="Inside pipeline stages collective matmul runs on tensor rings of two devices (mesh.tensor=2).",
    example=["mesh.stage=2", "train.microbatches=2", "mesh.tensor=4", "parallel.tensor.sequence_parallel=true",
             "parallel.tensor.collective_matmul=ring"],
)
def pipeline_collective_matmul_pairs(config, sizes) -> None:
    p, n, value = sizes["stage"], sizes["tensor"], config.parallel.tensor.collective_matmul
    if p > 1 and n > 2 and value != "none":
        raise ConfigError(
            f"parallel.tensor.collective_matmul={value} with mesh.stage={p} and mesh.tensor={n}: inside pipeline stages, "
            "where devices of different stages run different branches of one switch, a ring step is an all-to-all "
            "between two devices (a collective-permute would wait for every stage), so the ring holds two; use "
            "mesh.tensor=2 there, or parallel.tensor.collective_matmul=none"
        )


@rule(
    "pipeline-zero-stage",
    fields=["parallel.zero.stage", "mesh.stage"],
    summary="A pipeline reduces its gradients once per step, so ZeRO-2/3 would only add traffic: parallel.zero.stage <= 1.",
    example=["mesh.stage=2", "train.microbatches=2", "parallel.zero.stage=2"],
)
def pipeline_zero_stage(config, sizes) -> None:
    p, stage = sizes["stage"], config.parallel.zero.stage
    if p > 1 and stage >= 2:
        raise ConfigError(
            f"parallel.zero.stage={stage} with mesh.stage={p}: a pipeline stage accumulates its "
            "microbatches' gradients unreduced and reduces them over data once per step, so ZeRO-2/3 would only "
            "add traffic (DeepSpeed refuses the pair too); use parallel.zero.stage 0 or 1, and mesh.fsdp to shard "
            "parameters and gradients inside each stage"
        )


@rule(
    "pipeline-without-zero-plus-plus",
    fields=["parallel.zero.quantized_weights", "parallel.zero.quantized_gradients", "parallel.compression.method", "mesh.stage"],
    summary="ZeRO++ quantized collectives and gradient compression are not wired into pipeline stages yet.",
    example=["mesh.stage=2", "train.microbatches=2", "mesh.fsdp=2", "parallel.zero.quantized_weights=true"],
    also=[["mesh.stage=2", "train.microbatches=2", "mesh.data=2", "mesh.hosts.data=2", "mesh.fsdp=2",
           "parallel.compression.method=topk"]],
)
def pipeline_without_zero_plus_plus(config, sizes) -> None:
    p = sizes["stage"]
    for flag in ("quantized_weights", "quantized_gradients") if p > 1 else ():
        if getattr(config.parallel.zero, flag):
            raise ConfigError(
                f"parallel.zero.{flag}=true with mesh.stage={p}: ZeRO++ collectives are not wired into pipeline stages "
                f"yet; set parallel.zero.{flag}=false or mesh.stage=1"
            )
    if p > 1 and config.parallel.compression.method != "none":
        raise ConfigError(
            f"parallel.compression.method={config.parallel.compression.method} with mesh.stage={p}: compressed "
            "gradient reductions are not wired into pipeline stages yet; set parallel.compression.method=none or "
            "mesh.stage=1"
        )
