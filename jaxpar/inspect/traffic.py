"""Explain's table of compute and traffic per device per step: matmul FLOPs, the gradient's
reduction over the data-parallel axes (ZeRO, FSDP), attention over context, the expert
all-to-alls and compressed gradients, each measured beside its formula.

Byte counts of collectives are compared in elements, because the CPU backend runs bf16
collectives in f32 (a GPU sends the bf16).
"""

from __future__ import annotations

import math
from typing import Any

from jaxpar.inspect import formulas
from jaxpar.kernels.experts.exchange import two_hops
from jaxpar.kernels.experts.slots import expert_capacity
from jaxpar.inspect.facts import Facts, elements, itemsize, line, row, table_header
from jaxpar.inspect.optimizer import muon_formula
from jaxpar.inspect.pipelined import (
    expert_passes,
    head_params,
    one_hot_lookup_flops,
    pipeline_gradient_traffic,
    pipeline_recompute,
)
from jaxpar.model import declared, has, layer_windows
from jaxpar.nn import RECOMPUTES_ATTENTION
from jaxpar.sharding.rules import kv_heads_repeat
from jaxpar.step.compression import SCOPE as COMPRESSION_SCOPE
from jaxpar.units import byte_size, count

DP_AXES = ("data", "fsdp")  # the axes parameters and gradients are reduced over
GRAD_KINDS = ("all-reduce", "all-gather", "reduce-scatter")


def flops_rows(facts: Facts) -> dict[str, Any]:
    """Matmul FLOPs per device beside 6 x params x tokens + attention; under a pipeline the
    executor's recomputed forwards and the one-hot embedding lookup counted."""
    config, train = facts.config, facts.config.train
    tokens = train.global_batch * train.seq_len
    flops_per_token = config.model.flops_per_token(train.seq_len)
    recompute = pipeline_recompute(facts.pipeline) if facts.pipeline is not None else None
    if recompute:  # recomputed forwards: the layers' and the head's differ
        layers_factor, head_factor = recompute
        head = 6 * head_params(config.model)
        flops_per_token = (flops_per_token - head) * layers_factor + head * head_factor
        flops_per_token += one_hot_lookup_flops(config.model, facts.layout)
    orthogonalize = muon_formula(facts)[1]
    return {
        "flops": row("matmul FLOPs per device per step", facts.report.flops,
                     flops_per_token * tokens / facts.report.num_devices + orthogonalize),
        "flops_formula": "6 x matmul params x tokens + attention, over devices (PaLM appendix B)"
        + (", the pipeline's recomputed forwards counted (layers x {:.3f}, head x {:.3f})".format(*recompute)
           if recompute else "") + (" + Muon's Newton-Schulz (below)" if orthogonalize else ""),
        "matmul_types": facts.report.matmul_types,
    }


def flops_lines(doc: dict[str, Any]) -> list[str]:
    return ["", table_header("compute and traffic per device per step"), line(doc["flops"], count),
            *fp8_lines(doc.get("matmul_types") or {})]


def fp8_lines(types: dict[str, int]) -> list[str]:
    """Where the compiled step multiplies in FP8: how many of its GEMMs read 8-bit operands,
    by operand types (jaxpar.inspect.hlo.dot_types); nothing when none does."""
    eight = {t: n for t, n in types.items() if "f8" in t}
    if not eight:
        return []
    parts = ", ".join(f"{n} {t}" for t, n in eight.items())
    return [f"  FP8 GEMMs: {sum(eight.values())} of {sum(types.values())} matrix multiplies ({parts})"]


def gradient_rows(facts: Facts) -> dict[str, Any]:
    """Traffic over the data-parallel axes: ZeRO-3 over fsdp (and over data at stage 3),
    2 x (N-1)/N over data otherwise; Ψ here is the share one tensor-parallel rank holds.
    Without experts, mesh.expert is a data axis: the other parameters' gradients reduce
    over it too. A pipeline has its own formula; a compressor takes the reduction over data
    (its own row, compression_rows)."""
    mesh, stage = facts.mesh, facts.zero_stage
    data, fsdp, tensor, expert = mesh["data"], mesh["fsdp"], mesh["tensor"], mesh["expert"]
    psi_dt, psi_et = facts.psi_stage / tensor, facts.psi_experts / tensor / expert
    formula = (
        formulas.gradient_traffic_elements(psi_dt, fsdp, 3)
        + formulas.gradient_traffic_elements(psi_dt / fsdp, data * expert, stage)
        + formulas.gradient_traffic_elements(psi_et, fsdp, 3)
        + formulas.gradient_traffic_elements(psi_et / fsdp, data, stage)
    )
    text = f"3Ψ'(f-1)/f over fsdp + {3 if stage >= 3 else 2}(Ψ'/f)(d-1)/d over data, Ψ' = Ψ/tensor"
    if facts.pipeline is not None:
        formula, text = pipeline_gradient_traffic(facts)
    compressed = facts.compressor is not None or facts.layout.diloco.inner_steps > 0
    if compressed:  # the reduction over data is the compressor's, in its own row; DiLoCo has none
        formula -= formulas.gradient_traffic_elements(psi_dt / fsdp, data * expert, stage)
        text = "3Ψ'(f-1)/f over fsdp, Ψ' = Ψ/tensor; over data: " + (
            "compressed, below" if facts.compressor is not None else "none (DiLoCo's groups: the outer exchange, below)")
    measured = sum(
        elements(c)
        for c in facts.step_collectives
        if c.axes and set(c.axes) <= set(DP_AXES) | {"expert"} and c.kind in GRAD_KINDS
        and not (compressed and "data" in c.axes)
    )
    return {
        "gradient_traffic": row("elements over data, fsdp" + (", expert" if expert > 1 else ""), measured, formula),
        "gradient_traffic_formula": text
        + ("; expert weights Ψ'/e, others with d x e (expert as a data axis)" if expert > 1 else ""),
    }


def gradient_lines(doc: dict[str, Any]) -> list[str]:
    return [line(doc["gradient_traffic"], count), f"  formula: {doc['gradient_traffic_formula']}"]


def context_rows(facts: Facts) -> dict[str, Any]:
    """Elements the attention kernels send over the context axis per step, beside
    formulas.context_traffic_elements x layers x microbatches (plus the forward again under a
    remat policy that recomputes attention); and the gradient all-reduce over context (the
    parameters are replicated over it), beside 2Ψ'(c-1)/c."""
    config, mesh, model = facts.config, facts.mesh, facts.config.model
    n = mesh.get("context", 1)
    if n == 1 or not has(model, "num_kv_heads"):
        return {}
    impl, t, micro = facts.layout.context.impl, mesh["tensor"], facts.layout.microbatches
    b = config.train.global_batch // (mesh["data"] * mesh["fsdp"] * mesh["expert"]) // micro
    remat = declared(model, "remat")
    kv_heads = model.num_kv_heads * kv_heads_repeat(model.num_kv_heads, t, n if impl == "ulysses" else 1)  # as sent
    formula, kinds = 0.0, set()
    for window in layer_windows(model):  # Gemma 3's local and global layers send differently
        per_layer = formulas.context_traffic_elements(
            impl, config.train.seq_len, b, model.num_heads // t * model.head_dim, kv_heads // t * model.head_dim,
            n, window=window, layout=facts.layout.context.layout,
        )
        forward, backward = sum(per_layer["forward"].values()), sum(per_layer["backward"].values())
        again = forward if remat in RECOMPUTES_ATTENTION else 0.0  # the forward run again in the backward pass
        formula += micro * (forward + again + backward)
        kinds |= set(per_layer["forward"]) | set(per_layer["backward"])
    over_context = [c for c in facts.step_collectives if c.axes == ("context",)]
    measured = sum(elements(c) for c in over_context if c.kind in kinds)
    grads = sum(elements(c) for c in over_context if c.kind == "all-reduce")
    return {
        "context_traffic": row(f"elements over context ({impl} attention)", measured, formula),
        "context_traffic_formula": f"{impl} per layer (docs/context_parallel.md) x {_layers_by_window(model)} x {micro} "
        f"microbatch{'es' if micro > 1 else ''}" + (f", with the forward again (remat {remat})" if again else ""),
        "context_gradient_traffic": row("gradient elements over context (all-reduce)", grads, 2 * (facts.psi / t) * (n - 1) / n),
    }


def context_lines(doc: dict[str, Any]) -> list[str]:
    if "context_traffic" not in doc:
        return []
    return [line(doc["context_traffic"], count), f"  formula: {doc['context_traffic_formula']}",
            line(doc["context_gradient_traffic"], count),
            "  formula: 2Ψ'(c-1)/c: parameters are replicated over context, Ψ' = Ψ/tensor"]


def _layers_by_window(model) -> str:
    """"4 layers", or where their windows differ "3 layers of window 16 and 1 of every key"."""
    windows = layer_windows(model)
    if len(set(windows)) == 1:
        return f"{len(windows)} layers"
    parts = [f"{windows.count(w)} of {f'window {w}' if w else 'every key'}" for w in sorted(set(windows), reverse=True)]
    return parts[0].replace(" of", " layers of", 1) + "".join(f" and {p}" for p in parts[1:])


def expert_rows(facts: Facts) -> dict[str, Any]:
    """Elements the expert all-to-alls move per device per step, beside
    formulas.expert_traffic_elements x 4 (dispatch and combine, forward and backward; 6
    when the remat policy runs the layer again) x layers x microbatches. A ragged
    all-to-all is counted by its receive buffer: the worst case, not what routing sends.
    Under stages a device runs its layers (1/stage of them) with the executor's passes
    (pipelined.expert_passes): 2 all-to-alls per forward or backward of a chunk, averaged
    over the chunks."""
    config, mesh, model, program = facts.config, facts.mesh, facts.config.model, facts.pipeline
    n = mesh.get("expert", 1)
    if n == 1 or not declared(model, "num_experts"):
        return {}
    micro, c = config.train.microbatches, mesh.get("context", 1)
    tokens = config.train.global_batch // (mesh["data"] * mesh["fsdp"] * n) // micro * config.train.seq_len // c
    factor = model.capacity_factor if model.routing == "capacity" else 1.0
    passes = 6 if declared(model, "remat") in RECOMPUTES_ATTENTION else 4  # full and offload rerun the layer
    layers = model.num_layers
    if program is not None:
        passes, layers = expert_passes(program), layers / program.timeline.p
    if declared(model, "group_capacity") and two_hops(("expert",), config.mesh.hosts.expert, declared(model, "expert_groups")):
        return _two_hop_rows(facts, passes, layers, micro)
    formula = passes * layers * micro * formulas.expert_traffic_elements(tokens, model.top_k, model.embed, factor)
    measured = sum(
        c.buffer_bytes * c.trip_count / itemsize(c)
        for c in facts.step_collectives
        if c.kind in ("all-to-all", "ragged-all-to-all") and c.axes == ("expert",) and c.dtype in ("f32", "bf16", "f16")
    )
    dropless = model.routing == "dropless"
    padded = dropless and facts.layout.expert_exchange == "padded"
    return {
        "expert_traffic": row(f"elements over expert (all-to-all, {model.routing})", measured, formula),
        "expert_traffic_formula": f"tokens x k x hidden x {'1 (dropless)' if dropless else 'capacity factor'} per all-to-all, "
        f"{passes:g} per layer x {layers:g} layers x {micro} microbatch{'es' if micro > 1 else ''}"
        + (" (a stage's layers; the executor's passes averaged over the chunks)" if program is not None else "")
        + (f"; the padded exchange sends {n}x: every pair to one device fits" if padded else "")
        + (f"; ragged: counted as its {n}x receive buffer, what is sent depends on routing" if dropless and not padded else ""),
    }


def _two_hop_rows(facts: Facts, passes: float, layers: float, micro: int) -> dict[str, Any]:
    """Group capacity over hosts (jaxpar.kernels.experts.two_hop): the elements crossing
    hosts, beside the hop-1 buffer's rows (a sequence's groups x their capacity, about
    capacity factor x tokens x top_groups) x (hidden + k / 2: a row's gate, sent forward and
    its gradient back) per all-to-all. Each choice's expert and slot (int32) are not counted."""
    config, mesh, model = facts.config, facts.mesh, facts.config.model
    sequences = config.train.global_batch // (mesh["data"] * mesh["fsdp"] * mesh["expert"]) // micro
    rows = sequences * model.expert_groups * expert_capacity(model.capacity_factor, config.train.seq_len,
                                                             model.top_groups, model.expert_groups)
    formula = passes * layers * micro * rows * (model.embed + model.top_k / 2)
    measured = sum(c.buffer_bytes * c.trip_count / itemsize(c) for c in facts.step_collectives
                   if c.kind == "all-to-all" and c.crosses_hosts and c.dtype != "s32")
    return {
        "expert_traffic": row("elements across hosts over expert (two hops)", measured, formula),
        "expert_traffic_formula": f"sequences x groups x group capacity (~ capacity factor x tokens x top_groups="
        f"{model.top_groups}) x (hidden + k/2) per all-to-all, {passes:g} per layer x {layers:g} layers x {micro} "
        f"microbatch{'es' if micro > 1 else ''}; one hop would send k={model.top_k} where two send top_groups",
    }


def expert_lines(doc: dict[str, Any]) -> list[str]:
    if "expert_traffic" not in doc:
        return []
    return [line(doc["expert_traffic"], count), f"  formula: {doc['expert_traffic_formula']}"]


def compression_rows(facts: Facts) -> dict[str, Any]:
    """The compressor's bytes over data (across hosts; its collectives are the ones traced
    in its name scope) beside its formula and the uncompressed step's reduction of the same
    float32 gradients at this ZeRO stage; how many of them run asynchronously; and the
    parameter gathers over data, which stay uncompressed, in their own row."""
    compressor, stage = facts.compressor, facts.zero_stage
    if compressor is None:
        return {}
    formula = compressor.cross_host_bytes(stage)
    over_data = [c for c in facts.step_collectives if "data" in c.axes]
    mine = [c for c in over_data if COMPRESSION_SCOPE in c.op_name]
    how = ("two all-reduces of r(a+b) floats per matrix, each device its share; vectors whole"
           if compressor.method == "powersgd" else "all-gather of n x k (float32 value, int32 index) pairs per device block")
    baseline = "all-reduce, 2(n-1)/n" if stage == 0 else "reduce-scatter, (n-1)/n"
    where = (f"{len(compressor.per_layer)} of {len(compressor.blocks)} parameters layer by layer inside the backward pass"
             if compressor.per_layer else "after the backward pass")
    gathers = [c for c in over_data if c not in mine and c.kind == "all-gather"]
    return {
        "compressed_traffic": row(f"gradient bytes over data, {compressor.method} {compressor.knob}"
                                  + ("" if compressor.error_feedback else ", no error feedback"),
                                  sum(c.bytes_per_step for c in mine), formula["compressed"]),
        "compressed_traffic_formula": f"{how}; uncompressed at ZeRO-{stage}: {byte_size(formula['uncompressed'])} "
        f"({baseline} x 4 bytes x Ψ/(fsdp x tensor)), {formula['uncompressed'] / formula['compressed']:.1f}x more",
        "compressed_schedule": {
            "where": where, "collectives": len(mine),
            "async_share": _share(mine, lambda c: c.is_async), "overlapped_share": _share(mine, lambda c: c.overlapped),
        },
        "parameter_gathers": row("parameter all-gathers over data, uncompressed", sum(c.bytes_per_step for c in gathers),
                                 _parameter_gather_bytes(facts)),
    }


def diloco_rows(facts: Facts) -> dict[str, Any]:
    """DiLoCo's outer exchange over data (jaxpar.step.diloco): the bytes a device sends per
    step on average (the compiled collectives over data, all in the fragments' branches,
    weighted by how often each runs: branch_shares) beside outer_bytes; per
    synchronisation; how much of it runs asynchronously and overlapped with compute."""
    from jaxpar.step.diloco import outer_bytes

    spec, groups = facts.layout.diloco, facts.mesh["data"]
    if not spec.inner_steps:
        return {}
    mesh = facts.mesh
    local = sum(a.size / math.prod(mesh[axis] for axis in a.axes) for a in facts.params)
    mine = [c for c in facts.step_collectives if "data" in c.axes]
    per_step = sum(c.bytes_per_step for c in mine)
    per_round = per_step * spec.inner_steps
    return {
        "outer_traffic": row(f"DiLoCo outer exchange, bytes per step ({spec.compression})",
                             per_step, outer_bytes(spec, local, groups)),
        "outer_traffic_formula": (f"8 bytes x {spec.topk_fraction:g} Ψ/(fsdp x tensor) x (G-1)"
                                  if spec.compression == "topk" else
                                  f"2 x {'4' if spec.compression == 'none' else f'(1 + 4/{spec.quantization_block})'} "
                                  "bytes x Ψ/(fsdp x tensor) x (G-1)/G")
        + f", G = {groups} groups, once every inner_steps = {spec.inner_steps}; "
        f"{spec.fragments} fragment{'s' if spec.fragments > 1 else ''} of {byte_size(per_round / spec.fragments)} "
        f"each, one every {spec.inner_steps // spec.fragments} steps"
        + (", each beside an inner step (delay 1)" if spec.delay else ""),
        "outer_schedule": {"collectives": len(mine), "async_share": _share(mine, lambda c: c.is_async),
                           "overlapped_share": _share(mine, lambda c: c.overlapped),
                           "covered": (facts.report.predicted or {}).get("outer_cover")},
    }


def diloco_lines(doc: dict[str, Any]) -> list[str]:
    if "outer_traffic" not in doc:
        return []
    sched, covered = doc["outer_schedule"], doc["outer_schedule"].get("covered")
    return [line(doc["outer_traffic"], byte_size), f"  formula: {doc['outer_traffic_formula']}",
            (f"  {sched['collectives']} collectives over data; async {_percent(sched['async_share'])}, overlapped "
             f"with compute {_percent(sched['overlapped_share'])} of their bytes")
            + (f"; their transfer time covered by compute on this GPU: {_percent(covered['share'])} "
               f"({covered['covered_s'] * 1e3:.2f} of {covered['transfer_s'] * 1e3:.2f} ms a step)" if covered else "")]


def compression_lines(doc: dict[str, Any]) -> list[str]:
    if "compressed_traffic" not in doc:
        return []
    sched = doc["compressed_schedule"]
    return [line(doc["compressed_traffic"], byte_size), f"  formula: {doc['compressed_traffic_formula']}",
            (f"  {sched['where']}; async {_percent(sched['async_share'])}, overlapped with compute "
             f"{_percent(sched['overlapped_share'])} of its bytes"),
            line(doc["parameter_gathers"], byte_size)]


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def _share(collectives: list, which) -> float | None:
    """The share of `collectives`' bytes per step for which `which` holds."""
    total = sum(c.bytes_per_step for c in collectives)
    return sum(c.bytes_per_step for c in collectives if which(c)) / total if total else None


def _parameter_gather_bytes(facts: Facts) -> float | None:
    """Bytes a device receives from parameter all-gathers over data per step, ZeRO 1-2:
    the updated parameters, Ψ/(fsdp x tensor) in the compute dtype, gathered once
    ((n-1)/n of them). ZeRO-3 gathers them over data and fsdp at once, as often as its
    remat policy needs them: no formula here (the gradient traffic row's 3Ψ counts them)."""
    stage, mesh = facts.zero_stage, facts.mesh
    if stage == 0:
        return 0.0
    if stage >= 3:
        return None
    data = mesh["data"]
    return facts.psi / mesh["tensor"] / mesh["fsdp"] * (data - 1) / data * facts.compute_bytes
