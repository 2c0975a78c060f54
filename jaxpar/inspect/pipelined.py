"""Explain under pipeline stages: the executor's recomputed forwards and passes (which the
FLOPs, gradient and expert rows count), the traffic over `stage`, and the schedule as the
papers draw it."""

from __future__ import annotations

from typing import Any

from jaxpar.inspect.facts import NO_FORMULA, Facts, decoder_fields, elements, line, row
from jaxpar.model import declared, has
from jaxpar.pipeline import bubble_fraction, build_schedule, peak_in_flight
from jaxpar.pipeline import render as draw
from jaxpar.pipeline.schedule import published_bubble
from jaxpar.pipeline.split import compact, leading_layers
from jaxpar.sharding.embedding import rows_sharded
from jaxpar.units import count


def chunk_layers(program) -> tuple[int, int, int]:
    """(layers of the first virtual stage, of the last, of all): a chunk's work is its layers
    (equal chunks: 1 each, so the forms below are the (n-1)/n ones of n chunks)."""
    split, t = program.layers, program.timeline
    counts = split.counts if split is not None else (1,) * (t.p * t.v)
    return counts[0], counts[-1], sum(counts)


def pipeline_recompute(program) -> tuple[float, float]:
    """Matmul work of a pipelined step over that of a plain one: (for the layers, for the
    head). In units of one layer's forward, a plain step does 3 per layer and microbatch
    (forward, input and weight gradients). The executor's backward runs the forward again
    (4), except that the last chunk's forward is left to its backward (3). Split, the input
    gradient is forward + input gradients (2; none on the first chunk), and the weight
    gradient forward + input gradients + weight gradients (3): inside a chunk a layer's
    weight gradient needs the gradient flowing back from the layers above it. The head runs
    only in the last chunk's backward: 3 fused, 2 + 3 split. Each chunk weighs by its layers."""
    first, last, n = chunk_layers(program)
    if program.split:
        return ((n - last) * 1 + (n - first) * 2 + n * 3) / (3 * n), 5 / 3
    return ((n - last) * 1 + n * 3) / (3 * n), 1.0


def head_params(model) -> int:
    """The weights of the output matmul the last pipeline stage runs (a tied head: the
    embedding table): the model's `head_param_count()` (jaxpar.model), else a decoder's
    vocab_size x embed, else 0 (its recompute share then goes with the layers')."""
    if has(model, "head_param_count"):
        return model.head_param_count()
    return declared(model, "vocab_size", 0) * declared(model, "embed", 0)


def one_hot_lookup_flops(model, layout) -> float:
    """Per token: inside pipeline stages a vocab-sharded embedding lookup is a one-hot matmul
    (jaxpar.sharding.embedding), 2 x vocab x embed flops for its forward, again for the
    first stage's recomputed forward, and again for the table's gradient. Read from a
    decoder's vocab_size and embed (0 for other models)."""
    if not rows_sharded(layout):
        return 0.0
    return 3 * 2 * declared(model, "vocab_size", 0) * declared(model, "embed", 0)


def expert_passes(program) -> float:
    """All-to-alls per layer and microbatch under the executor, averaged over the layers.
    Fused: a forward (not on the last chunk), the backward's recompute and the backward:
    2 + 2 + 2, the last chunk 4. Split: a forward (not last), the input-gradient op's
    forward and backward (not first), the weight-gradient op's forward and backward."""
    first, last, n = chunk_layers(program)
    if program.split:
        return (2 * (n - last) + 4 * (n - first) + 4 * n) / n
    return (6 * (n - last) + 4 * last) / n


def gather_passes(program) -> float:
    """Gathers or reduce-scatters over fsdp of a layer's weights per microbatch, averaged
    over the layers: a forward 1 (not on the last chunk); fused, a backward 3; split, an
    input gradient 2 (not on the first chunk) and a weight gradient 3."""
    first, last, n = chunk_layers(program)
    if program.split:
        return ((n - last) * 1 + (n - first) * 2 + n * 3) / n
    return ((n - last) * 1 + n * 3) / n


def pipeline_gradient_traffic(facts: Facts) -> tuple[float | None, str]:
    """Elements over data and fsdp per device per step under a pipeline, and the formula's
    text. Over data: one reduction of what a stage holds, 2(Ψ_s/f)(d-1)/d. Over fsdp:
    every use of a weight gathers it, and every weight gradient reduce-scatters, per
    microbatch: per chunk a forward gathers once (not the last chunk), a fused backward
    twice (recompute, and again for the backward: gathered weights are never kept) and
    reduce-scatters once; split, the input gradient gathers twice (not the first chunk) and
    the weight gradient twice plus its reduce-scatter. The embedding is used by the first
    chunk (3 passes: a lookup's gradient needs no gathered table), the final norm and head
    by the last (3, split 5), on 1 stage in p. Expert weights (Ψ_E of the layers; Ψ_s
    holds none of them) are split e ways besides and reduce over data only; the rest reduce
    over data x expert. Passes weigh each chunk by its layers (gather_passes); gathers move
    the model's layers, the reduction over data what a stage stores (padding rows too).
    Measured within 3% on CPU; the rest is gathers the compiler shares between a recompute
    and its backward."""
    program, model = facts.pipeline, facts.config.model
    if not decoder_fields(model):
        return None, NO_FORMULA
    psi_layers, psi_stage, psi_experts = facts.psi_layers, facts.psi_stage, facts.psi_experts
    p, m = program.timeline.p, program.timeline.m
    d, f, t, e = (facts.mesh[a] for a in ("data", "fsdp", "tensor", "expert"))
    layer_passes = gather_passes(program)
    head_passes = 5 if program.split else 3
    psi_embedding = facts.params_named("vocab") - (0 if model.tie_embeddings else model.vocab_size * model.embed)
    psi_head = facts.psi - psi_layers - psi_embedding  # final norm and head
    if model.tie_embeddings:
        psi_head += psi_embedding  # the one table serves the head too
    layers_here = (psi_layers - psi_experts + psi_experts / e) / p
    uses = layers_here * layer_passes + (psi_embedding * 3 + psi_head * head_passes) / p
    fsdp_part = uses / t * m * (f - 1) / f
    data_part = (2 * psi_stage / (t * f) * (d * e - 1) / (d * e)
                 + 2 * facts.psi_experts_stage / (e * t * f) * (d - 1) / d)
    return fsdp_part + data_part, (
        f"over fsdp, per microbatch, {layer_passes:.2f} gathers or reduce-scatters of a stage's layers (Ψ_L/p, "
        f"experts /e), 3 of the embedding and {head_passes} of the head on 1 stage in p: x m (f-1)/f / tensor; "
        "over data (x expert), 2(Ψ_s/f)(de-1)/de of what a stage holds but experts, Ψ_s = Ψ_L/p + the rest, / tensor"
        + ("; experts 2(Ψ_E/pef)(d-1)/d" if e > 1 else "")
    )


def pipeline_traffic_rows(facts: Facts) -> dict[str, Any]:
    """The traffic over `stage`: the executor sends a microbatch's activation forward and a
    gradient back at every tick (in lockstep, idle ticks send zeros), and sums the
    replicated weights' gradients once."""
    program, mesh = facts.pipeline, facts.mesh
    if program is None:
        return {}
    t, model, train = program.timeline, facts.config.model, facts.config.train
    rows = train.global_batch // (mesh["data"] * mesh["fsdp"]) // facts.layout.microbatches
    seq = train.seq_len // (mesh["tensor"] if facts.layout.tensor.sequence_parallel else 1)
    message = rows * seq * model.embed if decoder_fields(model) else None  # one microbatch's hidden states, one shard
    useful = 2 * t.m * (t.p * t.v - 1) / t.p  # messages that carry data, per device
    over_stage = [c for c in facts.step_collectives if c.axes == ("stage",)]
    sent = sum(elements(c) for c in over_stage if c.kind == "collective-permute")
    reduced = sum(elements(c) for c in over_stage if c.kind == "all-reduce")
    other = (facts.psi - facts.psi_layers) / (mesh["tensor"] * mesh["fsdp"])  # replicated over stage, stored over tensor and fsdp
    return {
        "pipeline_traffic": row("elements over stage (activations, gradients)", sent,
                                2 * program.ticks * message if message else None),
        "pipeline_traffic_formula": (f"2 per tick x {program.ticks} ticks x microbatch hidden states {rows} x {seq} x "
                                     f"{model.embed}; {useful / (2 * program.ticks):.0%} of them carry data, the rest "
                                     "are idle ticks' zeros") if message else NO_FORMULA,
        "pipeline_gradient_traffic": row("gradient elements over stage (all-reduce)", reduced, 2 * other * (t.p - 1) / t.p),
    }


def pipeline_traffic_lines(doc: dict[str, Any]) -> list[str]:
    if "pipeline_traffic" not in doc:
        return []
    return [line(doc["pipeline_traffic"], count), f"  formula: {doc['pipeline_traffic_formula']}",
            line(doc["pipeline_gradient_traffic"], count),
            "  formula: 2Ψ'(p-1)/p, Ψ' = the weights outside the layer stack (replicated over stage) / (tensor x fsdp)"]


def pipeline_schedule_rows(facts: Facts) -> dict[str, Any]:
    """The schedule as the papers draw it, its bubble, the executor's ticks and slots, and
    the matmul FLOPs of each stage."""
    program = facts.pipeline
    if program is None:
        return {}
    t, name = program.timeline, facts.layout.pipeline.schedule
    timeline = build_schedule(name, t.p, t.m, t.v)
    return {
        "pipeline": {
            "schedule": name, "p": t.p, "m": t.m, "v": t.v,
            "picture": draw(timeline),
            "bubble": bubble_fraction(timeline),
            "published_bubble": published_bubble(name, t.p, t.m, t.v),
            "in_flight": peak_in_flight(timeline),
            "ticks": program.ticks,
            "activation_slots": program.act_slots,
            "gradient_slots": program.grad_slots,
            "stage_flops": list(facts.report.stage_flops),
            **stage_layers(facts),
        },
    }


def stage_layers(facts: Facts) -> dict[str, Any]:
    """Where stages differ in size: the layers of each virtual stage as parallel.pipeline.layers
    writes them (whole-model layers), the widest, and the zero rows each device stores."""
    split = facts.stage_split
    if split is None:
        return {}
    rows = split.padding().reshape(split.p, split.v * split.widest)  # pipeline order: device s's rows together
    return {"layers": compact(split.whole_model(leading_layers(facts.config.model))), "widest": split.widest,
            "padding_rows": [int(r.sum()) for r in rows]}


def pipeline_schedule_lines(doc: dict[str, Any]) -> list[str]:
    if "pipeline" not in doc:
        return []
    pp = doc["pipeline"]
    lines = ["", (f"pipeline: {pp['schedule']}, {pp['p']} stages x {pp['v']} chunk{'s' if pp['v'] > 1 else ''}, "
                  f"{pp['m']} microbatches (forward 1 step, backward 2; digits forward, letters backward, capitals "
                  "weight gradients)")]
    lines += ["  " + r for r in pp["picture"].splitlines()]
    lines.append(f"  bubble {pp['bubble']:.3f} (published {pp['published_bubble']:.3f}); {pp['in_flight']} microbatch "
                 f"chunks in flight on stage 0; executor: {pp['ticks']} lockstep ticks, "
                 f"{pp['activation_slots']} activation and {pp['gradient_slots']} gradient slots per device")
    if "layers" in pp:
        lines.append(f"  layers per virtual stage {pp['layers']}: each padded to the widest, {pp['widest']} rows; "
                     "zero rows per stage " + " ".join(map(str, pp["padding_rows"])))
    mean = sum(pp["stage_flops"]) / len(pp["stage_flops"])
    lines.append("  matmul FLOPs per stage / mean: " + " ".join(f"{f / mean:.2f}" for f in pp["stage_flops"])
                 + " (the last stage runs the head and loss, and leaves its forward to its backward)")
    return lines
