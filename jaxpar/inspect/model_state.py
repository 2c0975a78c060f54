"""Explain's memory table: the model state per device beside jaxpar.inspect.formulas'
model_state under the step's ZeRO stage and splits (fsdp x tensor, the ZeRO part over data,
layers over stage, experts over expert), LoRA's frozen weights, and the loss's logits."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxpar.inspect import formulas
from jaxpar.inspect.facts import Facts, line, row, table_header
from jaxpar.model import declared
from jaxpar.units import byte_size, count


def memory_rows(facts: Facts) -> dict[str, Any]:
    """The memory table's rows, the loss's logits, why parameters exceed their formula, and
    the formula's text."""
    m, expected = facts.report.memory, expected_state(facts)
    rows = [
        *([("frozen weights (LoRA)", m.frozen, expected.frozen)] if facts.frozen else []),
        ("parameters", m.params, expected.params),
        ("gradients", m.gradients, expected.grads),
        ("fp32 master weights", m.master, expected.master),
        ("optimizer state", m.optimizer, expected.optimizer),
        *([("DiLoCo outer state", m.outer, expected.outer)] if m.outer else []),
        ("model state", m.model_state, expected.total),
        *([("  of which in pinned host memory between steps", m.host_state, None)] if m.host_state else []),
        ("arguments (compiler)", m.arguments, None),
        ("temporaries (compiler)", m.temporaries, None),
        ("total: arguments + outputs + temporaries - donated", m.total, None),
    ]
    if m.host_temporaries:
        rows.append(("pinned host temporaries", m.host_temporaries, None))
    allocator = facts.report.allocator
    if allocator:  # a GPU's (or a deviceless target's share): what the total must fit in
        rows.append(("JAX's allocator (XLA_PYTHON_CLIENT_MEM_FRACTION)", allocator, None))
    return {
        "memory": [row(n, a, b) for n, a, b in rows],
        "fits": None if not allocator else m.total <= allocator,
        "logits": loss_logits(facts.config, facts.mesh, facts.report.num_devices),
        "split_fewer_ways": split_fewer_ways(facts),
        "memory_formula": memory_formula(facts),
    }


def memory_lines(doc: dict[str, Any]) -> list[str]:
    lines = [table_header("memory per device"), *(line(r, byte_size) for r in doc["memory"])]
    if doc.get("fits") is False:
        lines.append("  does not fit: the total is above what JAX's allocator holds; `jaxpar train` refuses it (raise "
                     "XLA_PYTHON_CLIENT_MEM_FRACTION, or model.remat, train.microbatches, mesh.fsdp: docs/zero_and_explain.md)")
    lines.append(f"  formula: {doc['memory_formula']}")
    if doc.get("split_fewer_ways"):
        lines.append(f"  ratio: {doc['split_fewer_ways']}")
    if doc.get("logits"):
        lines.append(f"  the loss: {doc['logits']}")
    return lines


def formula_ways(facts: Facts) -> int:
    """How many ways the formula splits every parameter (besides stage and expert)."""
    mesh = facts.mesh
    return mesh["fsdp"] * mesh["tensor"] * (mesh["data"] if facts.zero_stage >= 3 else 1)


def expected_state(facts: Facts) -> formulas.ModelState:
    """The model state's formula: the dense parameters and the expert weights (split over
    expert besides) one stage holds as stored (padding rows included), a float32
    accumulator under microbatches, LoRA's adapters as their weights' sides rest and its
    frozen weights."""
    mesh, stage, compute_bytes = facts.mesh, facts.zero_stage, facts.compute_bytes
    data, fsdp, tensor, expert = mesh["data"], mesh["fsdp"], mesh["tensor"], mesh["expert"]
    moments = round(4 * facts.moments)
    dense = formulas.model_state(facts.psi_stage, stage, data, fsdp * tensor, compute_bytes, moments)
    routed = formulas.model_state(facts.psi_experts_stage, stage, data, fsdp * tensor * expert, compute_bytes, moments)
    expected = formulas.ModelState(*(getattr(dense, f) + getattr(routed, f) for f in ("params", "grads", "master", "optimizer")))
    if facts.config.train.microbatches > 1:  # the accumulator is float32
        expected = formulas.ModelState(expected.params, expected.grads * 4 / compute_bytes, expected.master, expected.optimizer)
    frozen = 0.0
    if facts.frozen:  # LoRA: Ψ above is the adapters', which rest as their weights' sides do
        sides = split_ratio(facts, formula_ways(facts))[0]
        expected = formulas.ModelState(*(getattr(expected, f) * sides for f in ("params", "grads", "master", "optimizer")))
        frozen = formulas.frozen_state(facts.frozen_bytes, stage, data, fsdp * tensor)
    return dataclasses.replace(expected, frozen=frozen, outer=outer_state(facts, expected.params / compute_bytes))


def outer_state(facts: Facts, elements: float) -> float:
    """DiLoCo's outer state per device (jaxpar.step.diloco): the anchor and the outer momentum
    of the `elements` a device holds of its group's weights, in float32, and int8's error
    feedback residual."""
    spec = facts.layout.diloco
    if not spec.inner_steps:
        return 0.0
    return (8 + 4 * (spec.compression != "none" and spec.error_feedback)) * elements


def memory_formula(facts: Facts) -> str:
    """The formula's text: the ZeRO stage's splits, then each note that applies."""
    mesh, stage = facts.mesh, facts.zero_stage
    text = (f"ZeRO stage {stage}: parameters, gradients, master and optimizer state over fsdp x tensor = "
            f"{mesh['fsdp'] * mesh['tensor']}" + (f", and the ZeRO part over data = {mesh['data']}" if stage else ""))
    return text + "".join(note(facts) for note in (_stages_note, _experts_note, _repeated_heads_note, _lora_note,
                                                   _diloco_note))


def _diloco_note(facts: Facts) -> str:
    spec = facts.layout.diloco
    if not spec.inner_steps:
        return ""
    extra = " and int8's residual (4)" if spec.compression != "none" and spec.error_feedback else ""
    return (f"; DiLoCo: each device holds its group's copy (the {facts.mesh['data']} groups stacked over data), and "
            f"the outer state: anchor and momentum in float32 (8 bytes a parameter){extra}")


def _stages_note(facts: Facts) -> str:
    p, split = facts.stages, facts.stage_split
    if p == 1:
        return ""
    text = f"; layers ({facts.psi_layers / facts.psi:.0%}) also over stage = {p}"
    if split is None:
        return text
    return (text + f", every chunk padded to the widest ({split.widest} layers): {split.rows - split.layers} zero rows, "
            f"{1 - split.layers / split.rows:.0%} of the stack as stored")


def _experts_note(facts: Facts) -> str:
    psi_e, expert = facts.psi_experts, facts.mesh["expert"]
    return f"; expert weights ({psi_e / facts.psi:.0%}) also over expert = {expert}" if psi_e and expert > 1 else ""


def _repeated_heads_note(facts: Facts) -> str:
    """Key/value heads the tensor split does not divide."""
    repeats = facts.layout.params.repeats
    if not repeats:
        return ""
    return (f"; key/value heads rest whole over tensor and are repeated {repeats[0][1]} times at use (each device "
            "computes with its copies; their gradients are summed over tensor)")


def _lora_note(facts: Facts) -> str:
    if not facts.frozen:
        return ""
    return ("; LoRA: the parameters are the adapters (16 bytes each in mixed precision, A split as its weight's "
            f"input side, B as its output side), the frozen weights {facts.compute_bytes} bytes each"
            + (" (the adapted ones 1, in FP8, and a scale a row)" if facts.config.lora.base_dtype == "fp8" else "")
            + ", no gradient, master or optimizer state")


def split_fewer_ways(facts: Facts) -> str | None:
    """Why measured parameters can exceed the formula, which splits every parameter `ways`
    ways (besides stage and expert, which it counts apart): the arrays the layout splits
    fewer ways (names no rule shards, such as norms and biases, or sizes the axis does not
    divide), and the ratio of measured to formula they make."""
    ways = formula_ways(facts)
    ratio, arrays = split_ratio(facts, ways)
    if not arrays:
        return None
    shown = ", ".join(arrays[:3]) + (f" and {len(arrays) - 3} more" if len(arrays) > 3 else "")
    why = ("LoRA's A rests as its weight's input side, B as its output side" if facts.frozen
           else "the layout keeps them (partly) whole")
    return (f"{len(arrays)} parameter arrays are split fewer ways than {ways} ({shown}): {why}, so the parameters "
            f"are {ratio:.3f} of the formula (their gradients' traffic is above its formula too)")


def split_ratio(facts: Facts, ways: int) -> tuple[float, list[str]]:
    """(the parameters' bytes as the layout splits them over those of the formula, which
    splits each `ways` ways; the arrays split fewer ways)."""
    mesh = facts.mesh
    formula, measured, arrays = 0.0, 0.0, []
    for p in facts.params:
        apart = math.prod(mesh.get(a, 1) for a in p.axes if a in ("stage", "expert"))
        split = math.prod(mesh.get(a, 1) for a in p.axes if a not in ("stage", "expert"))
        size = p.size / apart
        formula, measured = formula + size / ways, measured + size / min(split, ways)
        if split < ways:
            arrays.append(p.path)
    return (measured / formula if formula else 1.0), arrays


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
