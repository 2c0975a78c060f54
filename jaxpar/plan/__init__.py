"""`jaxpar plan`: pick a layout for a cluster we do not have.

Every layout the framework can run is enumerated (jaxpar.plan.layouts), estimated from
formulas, and the fastest of those that look as if they fit are compiled for the real
device count on virtual CPU devices. Each compiled step gives its own per-device memory,
FLOPs and collectives (jaxpar.inspect), from which a roofline predicts the step time on the
target hardware (jaxpar.plan.presets.Hardware); the ranking is of compiled, fitting layouts.
Each layout compiles in a child process (jaxpar.plan.compile_one): one that XLA aborts, or
that runs out of memory or time, is reported failed and the others go on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.device_memory import DEVICE_MEMORY_SHARE
from jaxpar.model import has
from jaxpar.plan.layouts import Layout, candidates, diloco_variants, estimate
from jaxpar.plan.presets import MODELS, Hardware
from jaxpar.units import byte_size, duration

RUNTIME_SHARE = DEVICE_MEMORY_SHARE  # of HBM, for the step: what jaxpar's commands let JAX's allocator hold


@dataclasses.dataclass
class Planned:
    layout: Layout
    estimate: dict[str, float]
    overrides: list[str]
    memory: float = 0.0  # compiled bytes per device: arguments + outputs + temporaries - donated
    prediction: dict[str, float] = dataclasses.field(default_factory=dict)
    refused: str = ""  # why the framework refused to compile it
    failed: str = ""  # why its compile died (an XLA abort, a signal) or was stopped (the timeout)

    @property
    def compiled(self) -> bool:
        return not self.refused and not self.failed and self.memory > 0


def resolve_model(name: str):
    """(model, its recipe's Config or None): a preset name (MODELS) first, else a recipe
    as `jaxpar train` takes it (a shipped name, a .py path, or package.module[:function])."""
    if name in MODELS:
        return MODELS[name], None
    from jaxpar import recipes

    try:
        config = recipes.load(name)
    except recipes.UnknownRecipe:
        raise ConfigError(f"--model={name!r}; use one of {', '.join(MODELS)}, a recipe ({', '.join(recipes.names())}), "
                          f"or {recipes.FORMS}") from None
    missing = [f for f in PLANNED_FIELDS if not has(config.model, f)]
    if missing:
        raise ConfigError(f"--model={name!r}: the planner's cost model is a decoder's (it reads model "
                          f"{', '.join(PLANNED_FIELDS)}), and {type(config.model).__name__} has no {', '.join(missing)}; "
                          "compile and account for one layout with `jaxpar explain` instead")
    return config.model, config


PLANNED_FIELDS = ("vocab_size", "embed", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp")


def plan(model, devices: list, hbm_gb: float, hosts: int, seq_len: int, global_batch: int, compile_top: int = 4,
         hw: Hardware = Hardware(), progress: bool = True, compile_timeout_s: float = 600.0, optimizer: str = "adamw",
         groups: int = 1, diloco: int = 0) -> tuple[list[Planned], dict[str, Any]]:
    """(the compiled candidates, best first; facts about the search). Each compiles in a
    child process given `compile_timeout_s`; a child that dies or overruns marks its
    candidate failed, and the search goes on. `optimizer`: adamw, or muon (its state, FLOPs
    and exchange priced: jaxpar.plan.layouts.muon_cost; the compiles train with it).
    `groups` > 1: the cluster is that many groups of hosts (clusters, datacenters) joined by
    `hw.group_link_gb_per_s`; mesh.data spans them, a replica each, every other axis inside
    one. `diloco` > 0: each such layout DiLoCo can run is also considered with the groups
    synchronised every `diloco` steps (jaxpar.plan.layouts.diloco_variants). Both are priced
    per step: DiLoCo's steps to a loss are not data parallelism's (docs/diloco.md)."""
    from tqdm import tqdm

    n = len(devices)
    if n % hosts:
        raise ConfigError(f"--hosts={hosts} does not divide --devices={n}; use a divisor of {n}")
    hw = dataclasses.replace(hw, devices_per_host=n // hosts)
    budget = hbm_gb * 2**30 * RUNTIME_SHARE
    if hosts % groups:
        raise ConfigError(f"--groups={groups} does not divide --hosts={hosts}; each group holds whole hosts")
    laid = [lay for lay in candidates(model, n, hw.devices_per_host, global_batch, seq_len)
            if groups == 1 or (lay.data == groups and lay.stage == 1)]  # one data replica per group
    everything = [dataclasses.replace(lay, optimizer=optimizer) for lay in diloco_variants(laid, diloco)]
    if not everything:
        raise ConfigError(
            f"no layout of {type(model).__name__} runs {global_batch} sequences on {n} devices; use a global batch "
            f"that is a multiple of the device count, e.g. --global-batch {n}"
        )
    scored = [Planned(lay, estimate(lay, model, global_batch, seq_len, hw), lay.overrides(hw.devices_per_host, hosts))
              for lay in everything]
    hopeful, firsts = _compile_order(scored, budget)
    fallback = not hopeful
    if fallback:  # nothing seems to fit: compile the smallest, to say by how much
        hopeful = sorted(scored, key=lambda p: p.estimate["memory"])
    # The formulas miss what the compiler adds (workspace, copies, widened buffers). Once a
    # compiled layout fits, the estimates are scaled by the largest compiled / estimated
    # ratio among those that fit, and layouts that would then not fit are skipped (each
    # policy's first never is: its scale may not be another's). Until one fits, compiling
    # goes on past compile_top, up to 3 x compile_top layouts.
    chosen: list[Planned] = []
    scale, attempts = None, 0
    bar = tqdm(total=compile_top, desc="compiling", unit="layout", disable=not progress)
    for planned in hopeful:
        if (len(chosen) >= compile_top and scale is not None) or attempts == 3 * compile_top:
            break
        first = any(planned is f for f in firsts)
        if scale is not None and not fallback and not first and planned.estimate["memory"] * scale > budget:
            continue
        _compile(planned, model, devices, seq_len, global_batch, hw, compile_timeout_s)
        attempts += 1
        chosen.append(planned)
        bar.update(1)
        if planned.compiled and planned.memory <= budget:
            scale = max(scale or 0.0, planned.memory / planned.estimate["memory"])
    bar.close()
    chosen.sort(key=lambda p: (not (p.compiled and p.memory <= budget), p.prediction.get("step_s", math.inf), p.memory))
    facts = {"candidates": len(everything), "estimated_to_fit": sum(p.estimate["memory"] <= budget for p in scored),
             "compiled": len(chosen), "failed": sum(bool(p.failed) for p in chosen), "budget_bytes": budget,
             "fallback": fallback,
             "hardware": hw}
    return chosen, facts


def _compile_order(scored: list[Planned], budget: float) -> tuple[list[Planned], list[Planned]]:
    """(those estimated to fit, in the order they compile; the first of each remat policy).
    The estimates rank layouts of one remat policy better than they rank policies against
    each other (what the compiler keeps and recomputes is the compile's to say), so the
    fastest estimate of each policy goes first, then the rest by estimate; equal estimates
    (dots and none compute alike) smaller first."""
    hopeful = sorted((p for p in scored if p.estimate["memory"] <= budget),
                     key=lambda p: (p.estimate["step_s"], p.estimate["memory"]))
    firsts: dict[str, Planned] = {}
    for p in hopeful:
        firsts.setdefault(p.layout.remat, p)
    heads = list(firsts.values())
    return heads + [p for p in hopeful if all(p is not f for f in heads)], heads


def _compile(planned: Planned, model, devices, seq_len: int, global_batch: int, hw: Hardware, timeout_s: float) -> None:
    from jaxpar.plan.compile_one import compile_in_child

    # GPUs run cuDNN's fused attention (parallel.attention=auto), which the CPU compiler lacks;
    # jaxpar's blockwise kernel stands in, with memory of the same order (no S x S scores).
    # Compiled for GPUs (--target), the step is the one they would run.
    on_cpu = devices[0].platform == "cpu"
    stand_in = ["parallel.attention=flash", "compiler.preset=none"] if on_cpu else []
    stand_in = stand_in if planned.layout.context == 1 or not on_cpu else stand_in[1:]
    result = compile_in_child(model, planned.overrides + stand_in, devices, seq_len,
                              global_batch, hw, planned.estimate["hbm_bytes"], timeout_s, planned.estimate["host_s"])
    planned.refused, planned.failed = result.get("refused", ""), result.get("failed", "")
    planned.memory, planned.prediction = result.get("memory", 0.0), result.get("prediction", {})


def render(planned: list[Planned], facts: dict[str, Any], hbm_gb: float, command: str = "") -> str:
    """The ranking table, the best layout's overrides (after `command`, the `jaxpar train`
    that runs them: ready to paste) and the assumptions."""
    failed = f" ({facts['failed']} failed)" if facts.get("failed") else ""
    order = "the smallest estimates" if facts.get("fallback") else "the fastest estimate of each remat policy first"
    lines = [f"{facts['candidates']} layouts; {facts['estimated_to_fit']} estimated to fit {hbm_gb:g} GB "
             f"(x{RUNTIME_SHARE} for the step); {facts['compiled']} compiled, {order}{failed}:", "",
             f"{'#':>2s}  {'layout':58s} {'memory':>10s} {'fits':>4s} {'compute':>8s} {'comm*':>8s} {'bubble':>6s} "
             f"{'step':>8s} {'tok/s/dev':>9s} {'MFU':>6s}"]
    budget = facts["budget_bytes"]
    width = max([58, *(len(p.layout.describe()) for p in planned)])  # uneven stages add their layers=
    lines[-1] = lines[-1].replace(f"{'layout':58s}", f"{'layout':{width}s}")
    for i, p in enumerate(planned, 1):
        if p.refused or p.failed:
            why = f"refused: {p.refused}" if p.refused else f"failed: {p.failed}"
            lines.append(f"{i:2d}  {p.layout.describe():{width}s} {why}")
            continue
        r = p.prediction
        lines.append(
            f"{i:2d}  {p.layout.describe():{width}s} {byte_size(p.memory):>10s} {'yes' if p.memory <= budget else 'no':>4s} "
            f"{duration(r['compute_s']):>8s} {duration(r['exposed_comm_s']):>8s} {r['bubble']:6.1%} {duration(r['step_s']):>8s} "
            f"{r['tokens_per_s_per_device']:9,.0f} {r['mfu']:6.1%}"
        )
    how = next((p.prediction["how"] for p in planned if "how" in p.prediction), None)
    if how:  # --target: compiled for the GPUs themselves
        lines += ["", "memory: compiled per device for the GPU (arguments + outputs + temporaries - donated); step: "
                  "each kernel of the compiled program at max(FLOPs / rate, bytes / bandwidth), loops by their trips, "
                  "+ comm* (what of each collective no compute between its start and done covers), jaxpar.inspect.cost; compute: its GEMMs and attention"]
    else:
        lines += ["", "memory: compiled per device (arguments + outputs + temporaries - donated, on the CPU backend); "
                  "comm*: collective time not hidden by overlap; step: max(compute, HBM) / (1 - bubble) + comm*"]
    best = next((p for p in planned if p.compiled and p.memory <= budget), None)
    if best is None:
        lines.append("no compiled layout fits: add devices, shorten the sequence, or shrink the batch")
    else:
        lines += ["", f"best: predicted {best.prediction['mfu']:.1%} MFU, {duration(best.prediction['step_s'])} a step",
                  "  " + " ".join(([command] if command else []) + [f"--set {o}" for o in best.overrides])]
    lines += ["", "assumptions: " + (how.split(": ", 1)[1] if how else facts["hardware"].describe())]
    return "\n".join(lines)


__all__ = ["MODELS", "Hardware", "Layout", "Planned", "plan", "render", "resolve_model", "roofline"]
