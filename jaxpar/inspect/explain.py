"""`jaxpar explain`: a compiled step's memory, FLOPs and traffic beside the published
formulas (jaxpar.inspect.formulas), as a table or as JSON.

Ratios are measured / formula. Byte counts of collectives are compared in elements, because
the CPU backend runs bf16 collectives in f32 (a GPU sends the bf16).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.inspect import formulas
from jaxpar.inspect.hlo import summarize
from jaxpar.inspect.report import StepReport
from jaxpar.kernels.quantized import entries
from jaxpar.model import declared, has, layer_windows
from jaxpar.nn import RECOMPUTES_ATTENTION
from jaxpar.sharding.embedding import rows_sharded
from jaxpar.sharding.rules import kv_heads_repeat
from jaxpar.step.compression import SCOPE as COMPRESSION_SCOPE
from jaxpar.units import byte_size, count

DP_AXES = ("data", "fsdp")  # the axes parameters and gradients are reduced over
GRAD_KINDS = ("all-reduce", "all-gather", "reduce-scatter")


def explain(trainer, report: StepReport) -> dict[str, Any]:
    """Measured figures, their formulas and ratios; plain data for --json and the table."""
    config, mesh = trainer.config, report.mesh
    state = trainer.abstract_state()
    psi = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    psi_frozen = sum(math.prod(x.shape) for x in jax.tree.leaves(state.frozen))  # LoRA's frozen weights
    compute_bytes = jnp.dtype(config.train.compute_dtype).itemsize
    moments = sum(math.prod(x.shape) for x in jax.tree.leaves(state.opt_state) if x.ndim) / psi
    stage = config.parallel.zero_stage
    data, fsdp, tensor, expert = mesh["data"], mesh["fsdp"], mesh["tensor"], mesh["expert"]
    # Expert weights are split over mesh.expert besides; every other parameter is replicated over it.
    psi_e = _expert_params(trainer, state)
    # A pipeline stage holds 1/stage of the layer stack and all of the rest (embedding, head).
    p = mesh.get("stage", 1)
    # Expert weights live in the layer stack, so a stage holds 1/stage of them too.
    psi_layers = _params_named(trainer, state, "layers") if p > 1 else 0
    psi_d = psi - psi_e - (psi_layers - (psi_e if p > 1 else 0)) * (1 - 1 / p)  # the rest, on one stage
    dense = formulas.model_state(psi_d, stage, data, fsdp * tensor, compute_bytes, round(4 * moments))
    routed = formulas.model_state(psi_e / p, stage, data, fsdp * tensor * expert, compute_bytes, round(4 * moments))
    expected = formulas.ModelState(*(getattr(dense, f) + getattr(routed, f) for f in ("params", "grads", "master", "optimizer")))
    m = report.memory
    if config.train.microbatches > 1:  # the accumulator is float32
        expected = formulas.ModelState(expected.params, expected.grads * 4 / compute_bytes, expected.master, expected.optimizer)
    frozen = 0.0
    if state.frozen is not None:  # LoRA: Ψ above is the adapters', which rest as their weights' sides do
        sides = _split_ratio(trainer, state, mesh, fsdp * tensor * (data if stage >= 3 else 1))[0]
        expected = formulas.ModelState(*(getattr(expected, f) * sides for f in ("params", "grads", "master", "optimizer")))
        frozen = formulas.frozen_state(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state.frozen)),
                                       stage, data, fsdp * tensor)
    expected = dataclasses.replace(expected, frozen=frozen)
    memory_rows = [
        *([("frozen weights (LoRA)", m.frozen, expected.frozen)] if state.frozen is not None else []),
        ("parameters", m.params, expected.params),
        ("gradients", m.gradients, expected.grads),
        ("fp32 master weights", m.master, expected.master),
        ("optimizer state", m.optimizer, expected.optimizer),
        ("model state", m.model_state, expected.total),
        *([("  of which in pinned host memory between steps", m.host_state, None)] if m.host_state else []),
        ("arguments (compiler)", m.arguments, None),
        ("temporaries (compiler)", m.temporaries, None),
        ("total: arguments + outputs + temporaries - donated", m.total, None),
    ]
    if m.host_temporaries:
        memory_rows.append(("pinned host temporaries", m.host_temporaries, None))

    tokens = config.train.global_batch * config.train.seq_len
    flops_per_token = config.model.flops_per_token(config.train.seq_len)
    recompute = pipeline_recompute(trainer.pipeline) if trainer.pipeline is not None else None
    if recompute:  # recomputed forwards: the layers' and the head's differ
        layers_factor, head_factor = recompute
        head = 6 * head_params(config.model)
        flops_per_token = (flops_per_token - head) * layers_factor + head * head_factor
        flops_per_token += one_hot_lookup_flops(config.model, trainer.layout)
    flops_formula = flops_per_token * tokens / report.num_devices

    # Traffic over the data-parallel axes: ZeRO-3 over fsdp (and over data at stage 3),
    # 2 x (N-1)/N over data otherwise; Ψ here is the share one tensor-parallel rank holds.
    # Without experts, mesh.expert is a data axis: the other parameters' gradients reduce over it too.
    psi_t, psi_dt, psi_et = psi / tensor, psi_d / tensor, psi_e / tensor / expert
    grad_formula = (
        formulas.gradient_traffic_elements(psi_dt, fsdp, 3)
        + formulas.gradient_traffic_elements(psi_dt / fsdp, data * expert, stage)
        + formulas.gradient_traffic_elements(psi_et, fsdp, 3)
        + formulas.gradient_traffic_elements(psi_et / fsdp, data, stage)
    )
    grad_formula_text = f"3Ψ'(f-1)/f over fsdp + {3 if stage >= 3 else 2}(Ψ'/f)(d-1)/d over data, Ψ' = Ψ/tensor"
    if trainer.pipeline is not None:
        grad_formula, grad_formula_text = _pipeline_gradient_traffic(trainer, state, mesh, psi_layers, psi_d, psi_e)
    itemsize = lambda c: jnp.dtype(_HLO_DTYPES.get(c.dtype, "float32")).itemsize  # noqa: E731
    compression = _compressed_traffic(trainer, report, psi_t) if trainer.compressor is not None else {}
    if compression:  # the reduction over data is the compressor's, in its own row
        grad_formula -= formulas.gradient_traffic_elements(psi_dt / fsdp, data * expert, stage)
        grad_formula_text = "3Ψ'(f-1)/f over fsdp, Ψ' = Ψ/tensor; over data: compressed, below"
    grad_measured = sum(
        c.bytes_per_step / itemsize(c)
        for c in report.collectives
        if c.axes and set(c.axes) <= set(DP_AXES) | {"expert"} and c.kind in GRAD_KINDS
        and not (compression and "data" in c.axes)
    )
    context = _context_traffic(config, mesh, report, itemsize, psi_t)
    pipeline = _pipeline(trainer, mesh, report, itemsize, psi - psi_layers) if trainer.pipeline is not None else {}
    experts = _expert_traffic(config, mesh, report, itemsize, trainer.layout.expert_exchange, trainer.pipeline)
    return {
        "title": f"{type(config.model).__name__} {(psi + psi_frozen) / 1e6:.2f}M params"
        + (f" ({psi / 1e6:.2f}M trained: lora rank {config.lora.rank})" if psi_frozen else "")
        + f" | mesh {describe_shape(mesh)} "
        f"({report.num_devices} {report.platform} devices, {report.num_hosts} host{'s' if report.num_hosts > 1 else ''}) | "
        f"zero_stage {stage} | {config.train.compute_dtype} | batch {config.train.global_batch} x seq {config.train.seq_len}"
        f" | {config.train.microbatches} microbatch{'es' if config.train.microbatches > 1 else ''} | remat {declared(config.model, 'remat')}",
        "params": psi,
        "memory": [_row(n, a, b) for n, a, b in memory_rows],
        "logits": loss_logits(config, mesh, report.num_devices),
        "split_fewer_ways": _split_fewer_ways(trainer, state, mesh, fsdp * tensor * (data if stage >= 3 else 1)),
        "memory_formula": f"ZeRO stage {stage}: parameters, gradients, master and optimizer state over "
        f"fsdp x tensor = {fsdp * tensor}" + (f", and the ZeRO part over data = {data}" if stage else "")
        + (f"; layers ({psi_layers / psi:.0%}) also over stage = {p}" if p > 1 else "")
        + (f"; expert weights ({psi_e / psi:.0%}) also over expert = {expert}" if psi_e and expert > 1 else "")
        + _repeated_heads(trainer.layout)
        + ("; LoRA: the parameters are the adapters (16 bytes each in mixed precision, A split as its weight's "
           f"input side, B as its output side), the frozen weights {compute_bytes} bytes each"
           + (" (the adapted ones 1, in FP8, and a scale a row)" if config.lora.base_dtype == "fp8" else "")
           + ", no gradient, master or optimizer state" if state.frozen is not None else ""),
        "flops": _row("matmul FLOPs per device per step", report.flops, flops_formula),
        "flops_formula": "6 x matmul params x tokens + attention, over devices (PaLM appendix B)"
        + (", the pipeline's recomputed forwards counted (layers x {:.3f}, head x {:.3f})".format(*recompute)
           if recompute else ""),
        "gradient_traffic": _row("elements over data, fsdp" + (", expert" if expert > 1 else ""), grad_measured, grad_formula),
        "gradient_traffic_formula": grad_formula_text
        + ("; expert weights Ψ'/e, others with d x e (expert as a data axis)" if expert > 1 else ""),
        **context,
        **experts,
        **pipeline,
        **compression,
        "collectives": [
            {**row, "axes": list(row["axes"])} for row in summarize(report.collectives)
        ],
        "lowered_differently": sorted({f"{c.kind} as {c.lowered_as}" for c in report.collectives if c.lowered_as}),
        "async": {
            "collectives": sum(1 for c in report.collectives if c.is_async),
            "overlapped": sum(1 for c in report.collectives if c.overlapped),
        },
        "cross_host_bytes": report.cross_host_bytes() if report.num_hosts > 1 else None,
        "findings": [str(f) for f in report.findings],
        "compile_seconds": report.compile_seconds,
        "predicted": report.predicted,
    }


def _repeated_heads(layout) -> str:
    """The memory formula's note on key/value heads the tensor split does not divide."""
    if not layout.params.repeats:
        return ""
    times = layout.params.repeats[0][1]
    return (f"; key/value heads rest whole over tensor and are repeated {times} times at use (each device computes "
            "with its copies; their gradients are summed over tensor)")


def _expert_params(trainer, state) -> int:
    """Parameters whose logical names include "experts" (MoE expert weights)."""
    return _params_named(trainer, state, "experts")


def _split_fewer_ways(trainer, state, mesh: dict[str, int], ways: int) -> str | None:
    """Why measured parameters can exceed the formula, which splits every parameter `ways`
    ways (besides stage and expert, which it counts apart): the arrays the layout splits
    fewer ways (names no rule shards, such as norms and biases, or sizes the axis does not
    divide), and the ratio of measured to formula they make."""
    ratio, arrays = _split_ratio(trainer, state, mesh, ways)
    if not arrays:
        return None
    shown = ", ".join(arrays[:3]) + (f" and {len(arrays) - 3} more" if len(arrays) > 3 else "")
    why = ("LoRA's A rests as its weight's input side, B as its output side" if state.frozen is not None
           else "the layout keeps them (partly) whole")
    return (f"{len(arrays)} parameter arrays are split fewer ways than {ways} ({shown}): {why}, so the parameters "
            f"are {ratio:.3f} of the formula (their gradients' traffic is above its formula too)")


def _split_ratio(trainer, state, mesh: dict[str, int], ways: int) -> tuple[float, list[str]]:
    """(the parameters' bytes as the layout splits them over those of the formula, which
    splits each `ways` ways; the arrays split fewer ways)."""
    formula, measured, arrays = 0.0, 0.0, []
    params = jax.tree_util.tree_flatten_with_path(state.params)[0]
    for (path, x), sharding in zip(params, jax.tree.leaves(trainer.state_shardings.params)):
        axes = [a for entry in entries(sharding.spec, x.ndim) for a in entry]
        apart = math.prod(mesh.get(a, 1) for a in axes if a in ("stage", "expert"))
        split = math.prod(mesh.get(a, 1) for a in axes if a not in ("stage", "expert"))
        size = math.prod(x.shape) / apart
        formula, measured = formula + size / ways, measured + size / min(split, ways)
        if split < ways:
            arrays.append(jax.tree_util.keystr(path, simple=True, separator="."))
    return (measured / formula if formula else 1.0), arrays


def _params_named(trainer, state, name: str) -> int:
    names = jax.tree.leaves(trainer.param_names, is_leaf=lambda x: hasattr(x, "names"))
    return sum(math.prod(x.shape) for n, x in zip(names, jax.tree.leaves(state.params)) if name in n.names)


def pipeline_recompute(program) -> tuple[float, float]:
    """Matmul work of a pipelined step over that of a plain one: (for the layers, for the
    head). In units of one chunk's forward, a plain step does 3 per chunk and microbatch
    (forward, input and weight gradients). The executor's backward runs the forward again
    (4), except that the last chunk's forward is left to its backward (3). Split, the input
    gradient is forward + input gradients (2; none on the first chunk), and the weight
    gradient forward + input gradients + weight gradients (3): inside a chunk a layer's
    weight gradient needs the gradient flowing back from the layers above it. The head runs
    only in the last chunk's backward: 3 fused, 2 + 3 split."""
    n = program.timeline.p * program.timeline.v
    if program.split:
        return ((n - 1) * 1 + (n - 1) * 2 + n * 3) / (3 * n), 5 / 3
    return ((n - 1) * 1 + n * 3) / (3 * n), 1.0


def _pipeline_gradient_traffic(trainer, state, mesh: dict[str, int], psi_layers: float, psi_stage: float,
                               psi_experts: float) -> tuple[float, str]:
    """Elements over data and fsdp per device per step under a pipeline, and the formula's
    text. Over data: one reduction of what a stage holds, 2(Ψ_s/f)(d-1)/d. Over fsdp:
    every use of a weight gathers it, and every weight gradient reduce-scatters, per
    microbatch: per chunk a forward gathers once (not the last chunk), a fused backward
    twice (recompute, and again for the backward: gathered weights are never kept) and
    reduce-scatters once; split, the input gradient gathers twice (not the first chunk) and
    the weight gradient twice plus its reduce-scatter. The embedding is used by the first
    chunk (3 passes: a lookup's gradient needs no gathered table), the final norm and head
    by the last (3, split 5), on 1 stage in p. Expert weights (Ψ_E of the layers; `psi_stage`
    holds none of them) are split e ways besides and reduce over data only; the rest reduce
    over data x expert. Measured within 3% on CPU; the rest is gathers the compiler shares
    between a recompute and its backward."""
    program, config = trainer.pipeline, trainer.config
    if not _decoder_fields(config.model):
        return None, NO_FORMULA
    p, v, m = program.timeline.p, program.timeline.v, program.timeline.m
    n = p * v
    d, f, t, e = mesh["data"], mesh["fsdp"], mesh["tensor"], mesh["expert"]
    layer_passes = ((n - 1) * 3 + n * 3) / n if program.split else ((n - 1) * 1 + n * 3) / n
    head_passes = 5 if program.split else 3
    psi_embedding = _params_named(trainer, state, "vocab") - (0 if config.model.tie_embeddings else config.model.vocab_size * config.model.embed)
    psi_head = psi_stage - (psi_layers - psi_experts) / p - psi_embedding  # final norm and head
    if config.model.tie_embeddings:
        psi_head += psi_embedding  # the one table serves the head too
    layers_here = (psi_layers - psi_experts + psi_experts / e) / p
    uses = layers_here * layer_passes + (psi_embedding * 3 + psi_head * head_passes) / p
    fsdp_part = uses / t * m * (f - 1) / f
    data_part = 2 * psi_stage / (t * f) * (d * e - 1) / (d * e) + 2 * psi_experts / (p * e * t * f) * (d - 1) / d
    return fsdp_part + data_part, (
        f"over fsdp, per microbatch, {layer_passes:.2f} gathers or reduce-scatters of a stage's layers (Ψ_L/p, "
        f"experts /e), 3 of the embedding and {head_passes} of the head on 1 stage in p: x m (f-1)/f / tensor; "
        "over data (x expert), 2(Ψ_s/f)(de-1)/de of what a stage holds but experts, Ψ_s = Ψ_L/p + the rest, / tensor"
        + ("; experts 2(Ψ_E/pef)(d-1)/d" if e > 1 else "")
    )


def _pipeline(trainer, mesh: dict[str, int], report: StepReport, itemsize, psi_other: float) -> dict[str, Any]:
    """The schedule as the papers draw it, its bubble, and the traffic over `stage`: the
    executor sends a microbatch's activation forward and a gradient back at every tick (in
    lockstep, idle ticks send zeros), and sums the replicated weights' gradients once."""
    from jaxpar.pipeline import bubble_fraction, build_schedule, peak_in_flight
    from jaxpar.pipeline import render as draw
    from jaxpar.pipeline.schedule import published_bubble

    config, program = trainer.config, trainer.pipeline
    t = program.timeline
    name = config.parallel.pipeline_schedule
    timeline = build_schedule(name, t.p, t.m, t.v)
    model, train = config.model, config.train
    rows = train.global_batch // (mesh["data"] * mesh["fsdp"]) // train.microbatches
    seq = train.seq_len // (mesh["tensor"] if config.parallel.sequence_parallel else 1)
    message = rows * seq * model.embed if _decoder_fields(model) else None  # one microbatch's hidden states, one shard
    useful = 2 * t.m * (t.p * t.v - 1) / t.p  # messages that carry data, per device
    over_stage = [c for c in report.collectives if c.axes == ("stage",)]
    sent = sum(c.bytes_per_step / itemsize(c) for c in over_stage if c.kind == "collective-permute")
    reduced = sum(c.bytes_per_step / itemsize(c) for c in over_stage if c.kind == "all-reduce")
    other = psi_other / (mesh["tensor"] * mesh["fsdp"])  # stored over tensor and fsdp
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
            "stage_flops": list(report.stage_flops),
        },
        "pipeline_traffic": _row("elements over stage (activations, gradients)", sent,
                                 2 * program.ticks * message if message else None),
        "pipeline_traffic_formula": (f"2 per tick x {program.ticks} ticks x microbatch hidden states {rows} x {seq} x "
                                     f"{model.embed}; {useful / (2 * program.ticks):.0%} of them carry data, the rest "
                                     "are idle ticks' zeros") if message else NO_FORMULA,
        "pipeline_gradient_traffic": _row("gradient elements over stage (all-reduce)", reduced, 2 * other * (t.p - 1) / t.p),
    }


def _context_traffic(config, mesh: dict[str, int], report: StepReport, itemsize, psi_t: float) -> dict[str, Any]:
    """Elements the attention kernels send over the context axis per step, beside
    formulas.context_traffic_elements x layers x microbatches (plus the forward again under a
    remat policy that recomputes attention); and the gradient all-reduce over context (the
    parameters are replicated over it), beside 2Ψ'(c-1)/c."""
    n = mesh.get("context", 1)
    model = config.model
    if n == 1 or not has(model, "num_kv_heads"):
        return {}
    impl, t, micro = config.parallel.context_impl, mesh["tensor"], config.train.microbatches
    b = config.train.global_batch // (mesh["data"] * mesh["fsdp"] * mesh["expert"]) // micro
    remat = declared(model, "remat")
    kv_heads = model.num_kv_heads * kv_heads_repeat(model.num_kv_heads, t, n if impl == "ulysses" else 1)  # as sent
    formula, kinds = 0.0, set()
    for window in layer_windows(model):  # Gemma 3's local and global layers send differently
        per_layer = formulas.context_traffic_elements(
            impl, config.train.seq_len, b, model.num_heads // t * model.head_dim, kv_heads // t * model.head_dim,
            n, window=window, layout=config.parallel.context_layout,
        )
        forward, backward = sum(per_layer["forward"].values()), sum(per_layer["backward"].values())
        again = forward if remat in RECOMPUTES_ATTENTION else 0.0  # the forward run again in the backward pass
        formula += micro * (forward + again + backward)
        kinds |= set(per_layer["forward"]) | set(per_layer["backward"])
    over_context = [c for c in report.collectives if c.axes == ("context",)]
    measured = sum(c.bytes_per_step / itemsize(c) for c in over_context if c.kind in kinds)
    grads = sum(c.bytes_per_step / itemsize(c) for c in over_context if c.kind == "all-reduce")
    return {
        "context_traffic": _row(f"elements over context ({impl} attention)", measured, formula),
        "context_traffic_formula": f"{impl} per layer (docs/context_parallel.md) x {_layers_by_window(model)} x {micro} "
        f"microbatch{'es' if micro > 1 else ''}" + (f", with the forward again (remat {remat})" if again else ""),
        "context_gradient_traffic": _row("gradient elements over context (all-reduce)", grads, 2 * psi_t * (n - 1) / n),
    }


def _layers_by_window(model) -> str:
    """"4 layers", or where their windows differ "3 layers of window 16 and 1 of every key"."""
    windows = layer_windows(model)
    if len(set(windows)) == 1:
        return f"{len(windows)} layers"
    parts = [f"{windows.count(w)} of {f'window {w}' if w else 'every key'}" for w in sorted(set(windows), reverse=True)]
    return parts[0].replace(" of", " layers of", 1) + "".join(f" and {p}" for p in parts[1:])


def _pipeline_expert_passes(program) -> float:
    """All-to-alls per layer and microbatch under the executor, averaged over its n chunks.
    Fused: a forward (not on the last chunk), the backward's recompute and the backward:
    2 + 2 + 2, the last chunk 4. Split: a forward (not last), the input-gradient op's
    forward and backward (not first), the weight-gradient op's forward and backward."""
    n = program.timeline.p * program.timeline.v
    if program.split:
        return (2 * (n - 1) + 4 * (n - 1) + 4 * n) / n
    return (6 * (n - 1) + 4) / n


def _expert_traffic(config, mesh: dict[str, int], report: StepReport, itemsize, exchange: str,
                    program=None) -> dict[str, Any]:
    """Elements the expert all-to-alls move per device per step, beside
    formulas.expert_traffic_elements x 4 (dispatch and combine, forward and backward; 6
    when the remat policy runs the layer again) x layers x microbatches. A ragged
    all-to-all is counted by its receive buffer: the worst case, not what routing sends.
    Under stages a device runs its layers (1/stage of them) with the executor's passes
    (pipeline_recompute's): 2 all-to-alls per forward or backward of a chunk, averaged
    over the chunks."""
    n, model = mesh.get("expert", 1), config.model
    if n == 1 or not declared(model, "num_experts"):
        return {}
    micro, c = config.train.microbatches, mesh.get("context", 1)
    tokens = config.train.global_batch // (mesh["data"] * mesh["fsdp"] * n) // micro * config.train.seq_len // c
    factor = model.capacity_factor if model.routing == "capacity" else 1.0
    passes = 6 if declared(model, "remat") in RECOMPUTES_ATTENTION else 4  # full and offload rerun the layer
    layers = model.num_layers
    if program is not None:
        passes, layers = _pipeline_expert_passes(program), layers / program.timeline.p
    formula = passes * layers * micro * formulas.expert_traffic_elements(tokens, model.top_k, model.embed, factor)
    measured = sum(
        c.buffer_bytes * c.trip_count / itemsize(c)
        for c in report.collectives
        if c.kind in ("all-to-all", "ragged-all-to-all") and c.axes == ("expert",) and c.dtype in ("f32", "bf16", "f16")
    )
    dropless = model.routing == "dropless"
    padded = dropless and exchange == "padded"
    return {
        "expert_traffic": _row(f"elements over expert (all-to-all, {model.routing})", measured, formula),
        "expert_traffic_formula": f"tokens x k x hidden x {'1 (dropless)' if dropless else 'capacity factor'} per all-to-all, "
        f"{passes:g} per layer x {layers:g} layers x {micro} microbatch{'es' if micro > 1 else ''}"
        + (" (a stage's layers; the executor's passes averaged over the chunks)" if program is not None else "")
        + (f"; the padded exchange sends {n}x: every pair to one device fits" if padded else "")
        + (f"; ragged: counted as its {n}x receive buffer, what is sent depends on routing" if dropless and not padded else ""),
    }


_HLO_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "s8": "int8", "u8": "uint8",
               "s32": "int32", "u32": "uint32", "f64": "float64", "pred": "bool", "s16": "int16"}


def _compressed_traffic(trainer, report: StepReport, psi_t: float) -> dict[str, Any]:
    """The compressor's bytes over data (across hosts; its collectives are the ones traced
    in its name scope) beside its formula and the uncompressed step's reduction of the same
    float32 gradients at this ZeRO stage; how many of them run asynchronously; and the
    parameter gathers over data, which stay uncompressed, in their own row."""
    compressor, stage = trainer.compressor, trainer.config.parallel.zero_stage
    formula = compressor.cross_host_bytes(stage)
    over_data = [c for c in report.collectives if "data" in c.axes]
    mine = [c for c in over_data if COMPRESSION_SCOPE in c.op_name]
    measured = sum(c.bytes_per_step for c in mine)
    how = ("two all-reduces of r(a+b) floats per matrix, each device its share; vectors whole"
           if compressor.method == "powersgd" else "all-gather of n x k (float32 value, int32 index) pairs per device block")
    baseline = "all-reduce, 2(n-1)/n" if stage == 0 else "reduce-scatter, (n-1)/n"
    where = (f"{len(compressor.per_layer)} of {len(compressor.blocks)} parameters layer by layer inside the backward pass"
             if compressor.per_layer else "after the backward pass")
    gathers = [c for c in over_data if c not in mine and c.kind == "all-gather"]
    data = report.mesh["data"]
    return {
        "compressed_traffic": _row(f"gradient bytes over data, {compressor.method} {compressor.knob}", measured, formula["compressed"]),
        "compressed_traffic_formula": f"{how}; uncompressed at ZeRO-{stage}: {byte_size(formula['uncompressed'])} "
        f"({baseline} x 4 bytes x Ψ/(fsdp x tensor)), {formula['uncompressed'] / formula['compressed']:.1f}x more",
        "compressed_schedule": {
            "where": where, "collectives": len(mine),
            "async_share": _share(mine, lambda c: c.is_async), "overlapped_share": _share(mine, lambda c: c.overlapped),
        },
        "parameter_gathers": _row("parameter all-gathers over data, uncompressed", sum(c.bytes_per_step for c in gathers),
                                  _parameter_gather_bytes(trainer, psi_t, data)),
    }


def _share(collectives: list, which) -> float | None:
    """The share of `collectives`' bytes per step for which `which` holds."""
    total = sum(c.bytes_per_step for c in collectives)
    return sum(c.bytes_per_step for c in collectives if which(c)) / total if total else None


def _parameter_gather_bytes(trainer, psi_t: float, data: int) -> float | None:
    """Bytes a device receives from parameter all-gathers over data per step, ZeRO 1-2:
    the updated parameters, Ψ/(fsdp x tensor) in the compute dtype, gathered once
    ((n-1)/n of them). ZeRO-3 gathers them over data and fsdp at once, as often as its
    remat policy needs them: no formula here (the gradient traffic row's 3Ψ counts them)."""
    stage = trainer.config.parallel.zero_stage
    if stage == 0:
        return 0.0
    if stage >= 3:
        return None
    itemsize = jnp.dtype(trainer.config.train.compute_dtype).itemsize
    return psi_t / trainer.mesh.shape["fsdp"] * (data - 1) / data * itemsize


def describe_shape(mesh: dict[str, int]) -> str:
    return " ".join(f"{a}={s}" for a, s in mesh.items() if s > 1) or "single device"


def _row(name: str, measured: float, formula: float | None) -> dict[str, Any]:
    ratio = measured / formula if formula else None
    return {"name": name, "measured": measured, "formula": formula, "ratio": ratio}


def render(doc: dict[str, Any]) -> str:
    """The table `jaxpar explain` prints."""
    lines = [doc["title"], ""]
    lines.append(f"{'memory per device':<52}{'measured':>12}{'formula':>12}{'ratio':>8}")
    for row in doc["memory"]:
        lines.append(_line(row, _bytes))
    lines.append(f"  formula: {doc['memory_formula']}")
    if doc.get("split_fewer_ways"):
        lines.append(f"  ratio: {doc['split_fewer_ways']}")
    if doc.get("logits"):
        lines.append(f"  the loss: {doc['logits']}")
    lines += ["", f"{'compute and traffic per device per step':<52}{'measured':>12}{'formula':>12}{'ratio':>8}"]
    lines.append(_line(doc["flops"], _count))
    lines.append(_line(doc["gradient_traffic"], _count))
    lines.append(f"  formula: {doc['gradient_traffic_formula']}")
    if "context_traffic" in doc:
        lines.append(_line(doc["context_traffic"], _count))
        lines.append(f"  formula: {doc['context_traffic_formula']}")
        lines.append(_line(doc["context_gradient_traffic"], _count))
        lines.append("  formula: 2Ψ'(c-1)/c: parameters are replicated over context, Ψ' = Ψ/tensor")
    if "expert_traffic" in doc:
        lines.append(_line(doc["expert_traffic"], _count))
        lines.append(f"  formula: {doc['expert_traffic_formula']}")
    if "compressed_traffic" in doc:
        lines.append(_line(doc["compressed_traffic"], _bytes))
        lines.append(f"  formula: {doc['compressed_traffic_formula']}")
        sched = doc["compressed_schedule"]
        pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
        lines.append(f"  {sched['where']}; async {pct(sched['async_share'])}, overlapped with compute "
                     f"{pct(sched['overlapped_share'])} of its bytes")
        lines.append(_line(doc["parameter_gathers"], _bytes))
    if "pipeline_traffic" in doc:
        lines.append(_line(doc["pipeline_traffic"], _count))
        lines.append(f"  formula: {doc['pipeline_traffic_formula']}")
        lines.append(_line(doc["pipeline_gradient_traffic"], _count))
        lines.append("  formula: 2Ψ'(p-1)/p, Ψ' = the weights outside the layer stack (replicated over stage) / (tensor x fsdp)")
    lines += ["", f"{'collectives':<22}{'axes':<22}{'dtype':<7}{'ops':>5}{'runs/step':>11}{'bytes/step':>12}"]
    for row in doc["collectives"]:
        hosts = "  crosses hosts" if row["crosses_hosts"] else ""
        lines.append(
            f"  {row['kind']:<20}{'+'.join(row['axes']) or '-':<22}{row['dtype']:<7}{row['count']:>5}"
            f"{row['executions']:>11.0f}{_bytes(row['bytes_per_step']):>12}{hosts}"
        )
    if not doc["collectives"]:
        lines.append("  none")
    for note in doc["lowered_differently"]:
        lines.append(f"  note: {note} on this backend; counted as the GPU compiler emits it")
    if doc["async"]["collectives"]:
        lines.append(f"  async: {doc['async']['overlapped']} of {doc['async']['collectives']} have compute scheduled between start and done")
    if doc["cross_host_bytes"] is not None:
        lines.append(f"  crossing hosts: {_bytes(doc['cross_host_bytes'])} per device per step")
    if "pipeline" in doc:
        pp = doc["pipeline"]
        lines += ["", f"pipeline: {pp['schedule']}, {pp['p']} stages x {pp['v']} chunk{'s' if pp['v'] > 1 else ''}, "
                  f"{pp['m']} microbatches (forward 1 step, backward 2; digits forward, letters backward, capitals weight gradients)"]
        lines += ["  " + row for row in pp["picture"].splitlines()]
        lines.append(f"  bubble {pp['bubble']:.3f} (published {pp['published_bubble']:.3f}); {pp['in_flight']} microbatch "
                     f"chunks in flight on stage 0; executor: {pp['ticks']} lockstep ticks, "
                     f"{pp['activation_slots']} activation and {pp['gradient_slots']} gradient slots per device")
        mean = sum(pp["stage_flops"]) / len(pp["stage_flops"])
        lines.append("  matmul FLOPs per stage / mean: " + " ".join(f"{f / mean:.2f}" for f in pp["stage_flops"])
                     + " (the last stage runs the head and loss, and leaves its forward to its backward)")
    lines += ["", "findings:" if doc["findings"] else
              "findings: none (no involuntary rematerialisation, no parameter-shaped temporary larger than a layer)"]
    lines += [f"  {f}" for f in doc["findings"]]
    if doc.get("predicted"):
        lines += ["", *_predicted_lines(doc["predicted"])]
    lines.append(f"compiled in {doc['compile_seconds']:.1f} s")
    return "\n".join(lines)


def _predicted_lines(predicted: dict[str, Any]) -> list[str]:
    """The step's time on the GPU it was compiled for (jaxpar.inspect.cost)."""
    total = predicted["seconds"]
    kinds = ", ".join(f"{k} {v * 1e3:.1f} ms ({v / total:.0%})" for k, v in predicted["by_kind"].items())
    lines = [f"predicted step on this GPU: {total * 1e3:.1f} ms ({kinds}; {predicted['kernels']:.0f} kernels)",
             f"  model: {predicted['gpu']} (jaxpar.inspect.cost); the costliest kernels:"]
    for k in predicted["top"][:5]:
        lines.append(f"  {k['name']:<40} {k['kind']:<10} {k['runs']:>5g} x {k['seconds'] * 1e6:8.0f} us"
                     f"  {k['flops'] / 1e9:9.1f} GFLOP  {k['bytes'] / 2**20:9.1f} MiB")
    return lines


def _line(row: dict[str, Any], fmt) -> str:
    formula = fmt(row["formula"]) if row["formula"] is not None else ""
    ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else ""
    return f"  {row['name']:<50}{fmt(row['measured']):>12}{formula:>12}{ratio:>8}"


_bytes, _count = byte_size, count  # jaxpar.units


def loss_logits(config, mesh: dict[str, int], num_devices: int) -> str | None:
    """A language model's float32 logits alive at once in the built-in loss, per device: the
    tokens one device scores (a microbatch over the devices outside tensor and stage) by
    its share of the vocabulary (vocab-parallel over tensor), over train.loss_chunks."""
    vocab, chunks = declared(config.model, "vocab_size", None), config.train.loss_chunks
    if config.model.task != "lm" or not vocab:
        return None
    tensor, stage = mesh["tensor"], mesh.get("stage", 1)
    tokens = config.train.global_batch * config.train.seq_len / config.train.microbatches / (num_devices / (tensor * stage))
    whole = tokens * vocab / tensor * 4
    if chunks == 1:
        return (f"whole float32 logits, {byte_size(whole)} ({count(tokens)} tokens x {count(vocab / tensor)} of the "
                f"vocabulary); train.loss_chunks=N holds 1/N of them at a time")
    return f"float32 logits in {chunks} chunks of tokens, {byte_size(whole / chunks)} a chunk ({byte_size(whole)} whole)"


def head_params(model) -> int:
    """The weights of the output matmul the last pipeline stage runs (a tied head: the
    embedding table): the model's `head_param_count()` (jaxpar.model), else a decoder's
    vocab_size x embed, else 0 (its recompute share then goes with the layers')."""
    if has(model, "head_param_count"):
        return model.head_param_count()
    return declared(model, "vocab_size", 0) * declared(model, "embed", 0)


NO_FORMULA = ("no formula: it reads a decoder's embed, vocab_size and tie_embeddings, which the model config "
              "does not have (measured only)")


def _decoder_fields(model) -> bool:
    """Whether the pipeline traffic formulas can read the model (our decoders' fields)."""
    return all(has(model, f) for f in ("embed", "vocab_size", "tie_embeddings"))


def one_hot_lookup_flops(model, layout) -> float:
    """Per token: inside pipeline stages a vocab-sharded embedding lookup is a one-hot matmul
    (jaxpar.sharding.embedding), 2 x vocab x embed flops for its forward, again for the
    first stage's recomputed forward, and again for the table's gradient. Read from a
    decoder's vocab_size and embed (0 for other models)."""
    if not rows_sharded(layout):
        return 0.0
    return 3 * 2 * declared(model, "vocab_size", 0) * declared(model, "embed", 0)
