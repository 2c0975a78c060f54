"""Explain's rows for the optimizer's own work: Muon's orthogonalisation (jaxpar.step.muon),
its collectives and its Newton-Schulz FLOPs per device per step, each beside its formula.

For a share group of matrix parameters (jaxpar.step.muon.share_groups: their optimizer
states rest as `spec`, their matrices cut alike), on each device
(jaxpar.kernels.newton_schulz.orthogonalize_together): s, their local stacks joined and padded
to a multiple of w, the devices that share it (the mesh axes splitting a matrix, sizes n_a,
times its replicas, R); a, the local elements of one matrix piece. Then per step:

- each all-to-all sends V (n_a - 1) / n_a elements, V = s a / R, once there and once back;
- the all-gather over the replicas receives s a (R - 1) / R;
- each device runs s / w whole matrices (m <= k: the shorter side first) through `steps`
  iterations of 4 m^2 k + 2 m^3 FLOPs (X X^T, its square, and the product with X).
"""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import NamedSharding

from jaxpar.inspect.facts import Facts, elements, line, row
from jaxpar.kernels.newton_schulz import MatrixAxes, flops, idle_axes, sharers, splitting_axes
from jaxpar.step.muon import share_groups
from jaxpar.units import count


def orthogonalize_formula(matrices: list, shapes: list[tuple[int, ...]], steps: int) -> tuple[float, float]:
    """(elements sent, Newton-Schulz FLOPs) per device per step for one share group of
    parameters (global `shapes`), orthogonalised as one stack (the module docstring)."""
    first, shape = matrices[0], shapes[0]
    mesh, spec, axes = first.mesh, first.spec, first.axes
    local = [NamedSharding(mesh, m.spec).shard_shape(s) if mesh else s for m, s in zip(matrices, shapes)]
    split = splitting_axes(spec, axes, mesh, len(shape)) if mesh else []
    replicas = math.prod(mesh.shape[a] for a in idle_axes(spec, mesh, first.held)) if mesh else 1
    ways = sharers(spec, axes, mesh, len(shape), first.held) if mesh else 1
    stack = -(-sum(m.axes.count(s) for m, s in zip(matrices, local)) // ways) * ways
    piece = math.prod(local[0][d] for d in axes.rows + axes.cols)
    sent = sum(2 * stack * piece / replicas * (mesh.shape[a] - 1) / mesh.shape[a] for a, _ in split)
    sent += stack * piece * (replicas - 1) / replicas
    one = flops(shape, MatrixAxes((), axes.rows, axes.cols), steps)  # a single matrix of the stack
    return sent, stack / ways * one


def muon_formula(facts: Facts) -> tuple[float, float]:
    """(elements sent, Newton-Schulz FLOPs) per device per step of every matrix; (0, 0)
    under another optimizer."""
    if not facts.matrices:
        return 0.0, 0.0
    shapes = _matrix_shapes(facts)
    each = [orthogonalize_formula([facts.matrices[p] for p in g], [shapes[p] for p in g], facts.config.optim.ns_steps)
            for g in _stacks(facts.matrices, shapes)]
    return sum(e[0] for e in each), sum(e[1] for e in each)


def _matrix_shapes(facts: Facts) -> dict[str, tuple[int, ...]]:
    return {p.path: p.shape for p in facts.params if p.path in facts.matrices}


def _stacks(matrices, shapes: dict[str, tuple[int, ...]]) -> list[list[str]]:
    """The stacks the matrices are orthogonalised as: each share group, or a parameter alone
    on one device."""
    grouped = share_groups(matrices, shapes)
    alone = {p for g in grouped for p in g}
    return grouped + [[p] for p in shapes if p not in alone]


def muon_rows(facts: Facts) -> dict[str, Any]:
    if facts.matrices is None:
        return {}
    steps = facts.config.optim.ns_steps
    sent, flops = muon_formula(facts)
    colls = facts.optimizer_collectives
    stacks = len(_stacks(facts.matrices, _matrix_shapes(facts)))
    return {
        "muon_traffic": row("Muon: elements to make matrices whole and back", sum(map(elements, colls)), sent),
        "muon_flops": row("Muon: Newton-Schulz FLOPs per device", facts.report.orthogonalize_flops, flops),
        "muon_matrices": len(facts.matrices),
        "muon_formula": f"{len(facts.matrices)} matrix parameters in {stacks} stacks; all-to-alls 2 V (n-1)/n per "
                        f"axis splitting a matrix, the replicas' all-gather s a (R-1)/R; {steps} x (4 m^2 k + 2 m^3) "
                        "per matrix a device runs (jaxpar.inspect.optimizer)",
        "muon_cover": (facts.report.predicted or {}).get("muon_cover"),
    }


def muon_lines(doc: dict[str, Any]) -> list[str]:
    if "muon_traffic" not in doc:
        return []
    lines = [line(doc["muon_traffic"], count), line(doc["muon_flops"], count), f"  formula: {doc['muon_formula']}"]
    cover = doc.get("muon_cover")
    if cover and cover.get("share") is not None:
        lines.append(f"  Muon's collectives covered by compute: {cover['share']:.0%} ({cover['covered_s'] * 1e3:.2f} "
                     f"of {cover['transfer_s'] * 1e3:.2f} ms a step)")
    return lines
