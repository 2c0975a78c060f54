"""The parts of `jaxpar explain`'s document, in the order it prints them: `PROVIDERS`.

Each part is a `Provider`: `rows(facts)` gives its entries of the document from the step's
facts (jaxpar.inspect.facts), nothing when its strategy is off; `lines(doc)` prints them,
nothing when they are absent. A new strategy's rows are one provider in this list: explain
and render only walk it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxpar.inspect.facts import Facts
from jaxpar.inspect.hlo import summarize
from jaxpar.inspect.model_state import memory_lines, memory_rows
from jaxpar.inspect.optimizer import muon_lines, muon_rows
from jaxpar.inspect.pipelined import (
    pipeline_schedule_lines,
    pipeline_schedule_rows,
    pipeline_traffic_lines,
    pipeline_traffic_rows,
)
from jaxpar.inspect.traffic import (
    compression_lines,
    compression_rows,
    diloco_lines,
    diloco_rows,
    context_lines,
    context_rows,
    expert_lines,
    expert_rows,
    flops_lines,
    flops_rows,
    gradient_lines,
    gradient_rows,
)
from jaxpar.model import declared
from jaxpar.units import byte_size


@dataclasses.dataclass(frozen=True)
class Provider:
    """One part of the document: its entries and their lines in the printed table."""

    name: str
    rows: Callable[[Facts], dict[str, Any]]
    lines: Callable[[dict[str, Any]], list[str]]


def title_rows(facts: Facts) -> dict[str, Any]:
    """The model, its parameters, the mesh and the settings the figures depend on."""
    config, report, psi, psi_frozen = facts.config, facts.report, facts.psi, facts.psi_frozen
    train = config.train
    return {
        "title": f"{type(config.model).__name__} {(psi + psi_frozen) / 1e6:.2f}M params"
        + (f" ({psi / 1e6:.2f}M trained: lora rank {config.lora.rank})" if psi_frozen else "")
        + f" | mesh {describe_shape(facts.mesh)} "
        f"({report.num_devices} {report.platform} devices, {report.num_hosts} host{'s' if report.num_hosts > 1 else ''}) | "
        f"zero stage {facts.zero_stage} | {train.compute_dtype} | batch {train.global_batch} x seq {train.seq_len}"
        f" | {train.microbatches} microbatch{'es' if train.microbatches > 1 else ''} | remat {declared(config.model, 'remat')}",
        "params": psi,
    }


def describe_shape(mesh: dict[str, int]) -> str:
    return " ".join(f"{a}={s}" for a, s in mesh.items() if s > 1) or "single device"


def collective_rows(facts: Facts) -> dict[str, Any]:
    """Every collective by kind, axes and dtype; the ones this backend lowers differently;
    how many run asynchronously; the bytes crossing hosts."""
    report = facts.report
    return {
        "collectives": [{**r, "axes": list(r["axes"])} for r in summarize(report.collectives)],
        "lowered_differently": sorted({f"{c.kind} as {c.lowered_as}" for c in report.collectives if c.lowered_as}),
        # XLA:CPU widens bf16 collectives to f32: the bytes shown are twice a GPU's (docs/zero_and_explain.md)
        "widened": facts.config.train.compute_dtype if report.platform == "cpu" and facts.compute_bytes < 4 else None,
        "async": {
            "collectives": sum(1 for c in report.collectives if c.is_async),
            "overlapped": sum(1 for c in report.collectives if c.overlapped),
        },
        "cross_host_bytes": report.cross_host_bytes() if report.num_hosts > 1 else None,
    }


def collective_lines(doc: dict[str, Any]) -> list[str]:
    lines = ["", f"{'collectives':<22}{'axes':<22}{'dtype':<7}{'ops':>5}{'runs/step':>11}{'bytes/step':>12}"]
    for r in doc["collectives"]:
        hosts = "  crosses hosts" if r["crosses_hosts"] else ""
        lines.append(f"  {r['kind']:<20}{'+'.join(r['axes']) or '-':<22}{r['dtype']:<7}{r['count']:>5}"
                     f"{r['executions']:>11.0f}{byte_size(r['bytes_per_step']):>12}{hosts}")
    if not doc["collectives"]:
        lines.append("  none")
    lines += [f"  note: {note} on this backend; counted as the GPU compiler emits it" for note in doc["lowered_differently"]]
    if doc.get("widened"):
        lines.append(f"  note: this backend moves {doc['widened']} collectives as f32, so their bytes here are twice a "
                     "GPU's (the traffic table compares elements)")
    if doc["async"]["collectives"]:
        lines.append(f"  async: {doc['async']['overlapped']} of {doc['async']['collectives']} have compute scheduled "
                     "between start and done")
    if doc["cross_host_bytes"] is not None:
        lines.append(f"  crossing hosts: {byte_size(doc['cross_host_bytes'])} per device per step")
    return lines


def finding_rows(facts: Facts) -> dict[str, Any]:
    """The findings, the compile's seconds, and the predicted step on a GPU compiled for."""
    report = facts.report
    return {"findings": [str(f) for f in report.findings], "compile_seconds": report.compile_seconds,
            "predicted": report.predicted}


def finding_lines(doc: dict[str, Any]) -> list[str]:
    lines = ["", "findings:" if doc["findings"] else
             "findings: none (no involuntary rematerialisation, no parameter-shaped temporary larger than a layer)"]
    lines += [f"  {f}" for f in doc["findings"]]
    if doc.get("predicted"):
        lines += ["", *predicted_lines(doc["predicted"])]
    lines.append(f"compiled in {doc['compile_seconds']:.1f} s")
    return lines


def predicted_lines(predicted: dict[str, Any]) -> list[str]:
    """The step's time on the GPU it was compiled for (jaxpar.inspect.cost)."""
    total = predicted["seconds"]
    kinds = ", ".join(f"{k} {v * 1e3:.1f} ms ({v / total:.0%})" for k, v in predicted["by_kind"].items())
    lines = [f"predicted step on this GPU: {total * 1e3:.1f} ms ({kinds}; {predicted['kernels']:.0f} kernels)",
             f"  model: {predicted['gpu']} (jaxpar.inspect.cost); the costliest kernels:"]
    for k in predicted["top"][:5]:
        lines.append(f"  {k['name']:<40} {k['kind']:<10} {k['runs']:>5g} x {k['seconds'] * 1e6:8.0f} us"
                     f"  {k['flops'] / 1e9:9.1f} GFLOP  {k['bytes'] / 2**20:9.1f} MiB")
    return lines + cover_lines(predicted.get("all_to_all_cover"))


def cover_lines(cover: dict[str, Any] | None) -> list[str]:
    """The expert all-to-alls' transfer time against the compute XLA scheduled beside them."""
    if not cover or not cover["each"]:
        return []
    lines = [f"  all-to-all time covered by compute: {cover['share']:.0%} ({cover['covered_s'] * 1e3:.2f} of "
             f"{cover['transfer_s'] * 1e3:.2f} ms a step; the rest is exposed)",
             f"  {'all-to-all':<34}{'axes':<12}{'runs':>6}{'bytes':>12}{'transfer':>11}{'covered':>9}"]
    for c in sorted(cover["each"], key=lambda c: -c["transfer_s"] * c["runs"])[:12]:
        share = c["covered_s"] / c["transfer_s"] if c["transfer_s"] else 1.0
        lines.append(f"  {c['name'][:33]:<34}{'+'.join(c['axes']) or '-':<12}{c['runs']:>6g}{byte_size(c['bytes']):>12}"
                     f"{c['transfer_s'] * 1e6:>8.1f} us{share:>9.0%}")
    return lines


PROVIDERS = (
    Provider("title", title_rows, lambda doc: [doc["title"], ""]),
    Provider("model state memory", memory_rows, memory_lines),
    Provider("matmul FLOPs", flops_rows, flops_lines),
    Provider("gradient reduction over data and fsdp (ZeRO)", gradient_rows, gradient_lines),
    Provider("context parallel attention", context_rows, context_lines),
    Provider("expert all-to-alls", expert_rows, expert_lines),
    Provider("gradient compression", compression_rows, compression_lines),
    Provider("DiLoCo's outer exchange", diloco_rows, diloco_lines),
    Provider("Muon's orthogonalisation", muon_rows, muon_lines),
    Provider("pipeline traffic", pipeline_traffic_rows, pipeline_traffic_lines),
    Provider("collectives", collective_rows, collective_lines),
    Provider("pipeline schedule", pipeline_schedule_rows, pipeline_schedule_lines),
    Provider("findings", finding_rows, finding_lines),
)
