"""What a compiled train step holds and sends, per device, without running it.

`inspect_step(trainer)` lowers the step on abstract inputs (nothing is allocated), compiles
it, and reads back:
  memory       the model state by role, from the shardings the step was compiled with,
               and the compiler's own totals (arguments, outputs, temporaries, peak)
  flops        matmul FLOPs of the per-device program, loops counted by trip count
  collectives  every collective with its mesh axes and bytes per step (jaxpar.inspect.hlo)
  findings     the partitioner's warnings (involuntary full rematerialisation), and every
               temporary buffer larger than one layer's parameters (jaxpar.inspect.findings)
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Iterable

import jax
import jax.numpy as jnp

from jaxpar.inspect.buffers import temporaries
from jaxpar.inspect.cost import (GpuCost, collective_covers, covered_share, exposed_collective_seconds, latency_profile,
                                 step_cost)
from jaxpar.inspect.findings import Finding, compiler_warnings, oversized_temporaries, parse_findings
from jaxpar.inspect.hlo import Collective, collectives, dot_types, matmul_flops_each, summarize
from jaxpar.device_memory import allocator_bytes, step_bytes
from jaxpar.mesh import host_of_positions
from jaxpar.model import layer_windows
from jaxpar.nn import KIND_SCOPE, window_kinds
from jaxpar.pipeline.split import StageSplit
from jaxpar.step.diloco import SCOPE as DILOCO_SCOPE
from jaxpar.step.diloco import branch_shares
from jaxpar.step.muon import SCOPE as MUON_SCOPE
from jaxpar.xla_options import layer_params


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes. The first five come from the compiled step's shardings; the rest
    are the compiler's buffer assignment."""

    params: int
    master: int
    optimizer: int
    gradients: int  # the reduced gradient buffer the optimizer reads (or the accumulator)
    batch: int
    arguments: int
    outputs: int
    temporaries: int
    aliased: int  # donated inputs reused for outputs
    peak: int
    host_temporaries: int  # pinned-host buffers (offload); 0 on backends without host memory
    host_state: int  # of the model state, bytes resting in pinned host memory between steps
    frozen: int = 0  # LoRA's frozen weights (jaxpar.step.lora), compute dtype
    host_arguments: int = 0  # of `arguments`, what the compiler placed in host memory
    outer: int = 0  # DiLoCo's outer state (jaxpar.step.diloco.Outer): anchor, momentum, residuals

    @property
    def model_state(self) -> int:
        return self.params + self.master + self.optimizer + self.gradients + self.frozen + self.outer

    @property
    def total(self) -> int:
        """What the step holds on the device at once, by the compiler's count: arguments +
        outputs + temporaries - donated."""
        return self.arguments + self.outputs + self.temporaries - self.aliased

    @property
    def on_device(self) -> int:
        """`total` less the state resting in host memory where the compiler counted it on the
        device: the CPU backend and a deviceless compile have no host memory to put it in."""
        return self.total - (self.host_state if not self.host_arguments else 0)


@dataclasses.dataclass(frozen=True)
class StepReport:
    mesh: dict[str, int]
    num_hosts: int
    memory: Memory
    flops: float  # per device per step: matmuls, with loop trip counts
    xla_flops: float  # XLA's cost analysis (counts each loop body once)
    collectives: list[Collective]
    findings: list[Finding]
    compile_seconds: float
    platform: str
    stage_flops: tuple[float, ...] = ()  # pipelines: matmul FLOPs per step on each stage's devices
    # Compiled for a GPU (one there, or deviceless): the step's time by jaxpar.inspect.cost,
    # and those costs as XLA's latency profile (jaxpar.inspect.cost.latency_profile)
    predicted: dict | None = None
    latency_profile: str | None = dataclasses.field(default=None, repr=False)
    # The compiled step's matrix multiplies by operand types, {"f8e4m3fn x f8e4m3fn": 12, ...}
    # (jaxpar.inspect.hlo.dot_types): whether FP8 reached the GEMMs
    matmul_types: dict[str, int] = dataclasses.field(default_factory=dict)
    # Muon's Newton-Schulz matmul FLOPs per device per step (jaxpar.step.muon.SCOPE); 0 without
    orthogonalize_flops: float = 0.0
    # Bytes JAX's allocator holds on a device (jaxpar.device_memory.allocator_bytes), what `total` must
    # fit in: a GPU's, or a deviceless target's share; None on CPUs
    allocator: int | None = None

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh.values())

    def bytes_over(
        self,
        axes: Iterable[str] | None = None,
        kinds: Iterable[str] | None = None,
        dtypes: Iterable[str] | None = None,
    ) -> int:
        """Bytes per step per device of collectives whose groups span only `axes` (and at
        least one of them; None: any axes), of `kinds` and element `dtypes` (None: any)."""
        axes, kinds, dtypes = (None if v is None else set(v) for v in (axes, kinds, dtypes))
        return sum(
            c.bytes_per_step
            for c in self.collectives
            if c.axes
            and (axes is None or set(c.axes) <= axes)
            and (kinds is None or c.kind in kinds)
            and (dtypes is None or c.dtype in dtypes)
        )

    def cross_host_bytes(self) -> int:
        return sum(c.bytes_per_step for c in self.collectives if c.crosses_hosts)

    def to_json(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh,
            "num_devices": self.num_devices,
            "num_hosts": self.num_hosts,
            "platform": self.platform,
            "memory": {**dataclasses.asdict(self.memory), "model_state": self.memory.model_state},
            "flops": self.flops,
            "xla_flops": self.xla_flops,
            "collectives": summarize(self.collectives),
            "cross_host_bytes": self.cross_host_bytes(),
            "findings": [str(f) for f in self.findings],
            "compile_seconds": self.compile_seconds,
            "predicted": self.predicted,
        }


def inspect_step(trainer, with_latency_profile: bool = False) -> StepReport:
    """Compile `trainer.step` ahead of time and account for it; `with_latency_profile`: also
    write its costs as XLA's latency profile (a program compiled for a GPU it knows)."""
    state, batch = trainer.abstract_state(), trainer.abstract_batch()
    t0 = time.perf_counter()
    with compiler_warnings() as log:  # a real compile: its warnings, its time
        compiled = trainer.step.lower(state, batch).compile()
    seconds = time.perf_counter() - t0
    mesh = trainer.mesh
    num_hosts = trainer.config.mesh.hosts.num_hosts
    stats = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}  # None from a deviceless GPU compile
    grad_dtype = jnp.float32 if trainer.config.train.microbatches > 1 else jnp.dtype(trainer.config.train.compute_dtype)
    one = state.params if state.outer is None else state.outer.anchor  # DiLoCo: one group's shapes
    grads = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, grad_dtype, sharding=s), one, trainer.shardings.grads)
    memory = Memory(
        params=shard_bytes(state.params),
        master=shard_bytes(state.master),
        optimizer=shard_bytes(state.opt_state),
        gradients=shard_bytes(grads),
        batch=shard_bytes(batch),
        arguments=stats.argument_size_in_bytes,
        outputs=stats.output_size_in_bytes,
        temporaries=stats.temp_size_in_bytes,
        aliased=stats.alias_size_in_bytes,
        peak=getattr(stats, "peak_memory_in_bytes", 0) or step_bytes(stats),
        host_temporaries=stats.host_temp_size_in_bytes,
        host_state=shard_bytes(state, memory_kind="pinned_host"),
        frozen=shard_bytes(state.frozen),
        host_arguments=stats.host_argument_size_in_bytes,
        outer=shard_bytes(state.outer),
    )
    text = compiled.as_text()
    findings = parse_findings(log) + temporary_findings(trainer, text, state)
    # Under a pipeline the executor's switch branches are weighted by how often the average
    # device (and each stage) runs them.
    program = trainer.pipeline
    each = [None] if program is None else [program.branch_shares()] + [program.branch_shares(s) for s in range(program.timeline.p)]
    stages = [None] if program is None else [None, *range(program.timeline.p)]
    groups = branch_shares(trainer.layout.diloco) if trainer.layout.diloco.inner_steps else {}  # DiLoCo's switch
    each = [{**(shares or {}), **kind_shares(trainer.config.model, program, s), **groups} or None
            for shares, s in zip(each, stages)]
    shares = each[0]
    (flops, _), *stage_flops = matmul_flops_each(text, each)
    host_of = host_of_positions(mesh, num_hosts)
    colls = collectives(text, mesh, host_of, shares)
    gpu = gpu_cost(mesh.devices.flat[0])
    return StepReport(
        mesh=dict(mesh.shape),
        num_hosts=num_hosts,
        memory=memory,
        flops=flops,
        xla_flops=float(cost.get("flops", 0.0)),
        collectives=colls,
        findings=findings,
        compile_seconds=seconds,
        platform=mesh.devices.flat[0].platform,
        stage_flops=tuple(f for f, _ in stage_flops),
        predicted=predicted_step(text, colls, mesh.devices.flat[0], host_of,
                                 shares if program is not None else (groups or None)),
        latency_profile=latency_profile(text, colls, gpu, host_of) if with_latency_profile and gpu else None,
        matmul_types=dot_types(text),
        orthogonalize_flops=optimizer_flops(trainer) if trainer.config.optim.name == "muon" else 0.0,
        allocator=allocator_bytes(mesh.devices.flat[0]),
    )


def optimizer_flops(trainer) -> float:
    """Matmul FLOPs per device of the optimizer's update alone (Muon's Newton-Schulz: AdamW
    has none), compiled on its own: the CPU backend drops the names of the dots it fuses, so
    the step's program cannot tell them from the model's."""
    state = trainer.abstract_state()
    on_device = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding.with_memory_kind("device"))  # noqa: E731
    # the float32 master as the update works on it (wherever it rests)
    master = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=s), state.params,
                          trainer.shardings.optimizer)
    text = jax.jit(trainer.tx.update).lower(master, jax.tree.map(on_device, state.opt_state), master).compile().as_text()
    return matmul_flops_each(text, [None])[0][0]


def gpu_cost(device) -> GpuCost | None:
    """The cost model's constants for a GPU it knows, None for any other device."""
    return GpuCost.of(getattr(device, "device_kind", "")) if device.platform in ("gpu", "cuda") else None


def predicted_step(hlo_text: str, colls: list[Collective], device, host_of: list[int] | None = None,
                   pipeline_shares=None) -> dict | None:
    """The step's time by jaxpar.inspect.cost, for a program compiled for a GPU it knows:
    its kernels, plus what of each collective no compute in its window covers; and the
    expert all-to-alls' cover, collective by collective. Under a pipeline
    (`pipeline_shares`: how often the average device runs each op of the executor's
    switch) the average device's kernels: the lockstep ticks' waits come on top
    (jaxpar.plan.step_time.pipeline_bubble; before, every op counted every tick). Under
    DiLoCo the shares of its switch's branches (jaxpar.step.diloco.branch_shares)."""
    gpu = gpu_cost(device)
    if gpu is None:
        return None
    covers = collective_covers(hlo_text, colls, gpu, host_of)
    muon = [c for c in covers if MUON_SCOPE in c.collective.op_name]
    outer = [c for c in covers if DILOCO_SCOPE in c.collective.op_name and "data" in c.collective.axes]
    exchange = [c for c in covers if c.collective.kind in ("all-to-all", "ragged-all-to-all") and c not in muon]
    return {"gpu": gpu.describe(), "bf16_tflops": gpu.bf16_tflops,
            **step_cost(hlo_text, gpu, exposed_collective_seconds(covers), pipeline_shares).to_json(),
            # Muon's all-to-alls and gathers against the compute scheduled beside them
            "muon_cover": covered_share(muon, kinds=("all-to-all", "all-gather")) if muon else None,
            # DiLoCo's outer exchange (over data, in its switch's branches) against the inner step beside it
            "outer_cover": covered_share(outer, kinds=None) if outer else None,
            "all_to_all_cover": {**covered_share(exchange), "each": [
                {"name": c.collective.name, "kind": c.collective.kind, "axes": list(c.collective.axes),
                 "crosses_hosts": c.collective.crosses_hosts, "runs": c.collective.trip_count,
                 "bytes": c.collective.link_bytes, "transfer_s": c.transfer_s, "covered_s": c.covered_s}
                for c in exchange]}}


def temporary_findings(trainer, hlo_text: str, state=None) -> list[Finding]:
    """The parameter-shaped temporaries larger than a layer in `trainer`'s compiled step
    (its optimised HLO text): jaxpar.inspect.findings.oversized_temporaries. `state`: the
    trainer's abstract state, if the caller has it already."""
    compute = trainer.config.train.compute_dtype
    mesh = trainer.mesh
    params = (state or trainer.abstract_state()).params
    return oversized_temporaries(temporaries(hlo_text), layer_params(trainer.config.model), jnp.dtype(compute).itemsize,
                                 compute, [x.shape for x in jax.tree.leaves(params)],
                                 mesh.devices.size, mesh.devices.flat[0].platform)


def shard_bytes(tree: Any, memory_kind: str | None = None) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (device 0's share;
    every layout jaxpar builds is even), optionally only those in `memory_kind`."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
        if memory_kind is None or x.sharding.memory_kind == memory_kind
    )


def kind_shares(model, program=None, stage: int | None = None) -> dict[str, tuple[float, ...]]:
    """{jaxpar.nn.KIND_SCOPE: the share of each kind among the layers of the model (stage None)
    or of a pipeline stage (its virtual stages stage, stage + p, ...)}, for a model whose
    layers differ (jaxpar.model's layer_windows), else {}."""
    distinct, kinds = window_kinds(layer_windows(model))
    if len(distinct) < 2:
        return {}
    if stage is not None:  # device `stage` holds row `stage` of the layers in pipeline order, padding aside
        p, v = program.timeline.p, program.timeline.v
        split = program.layers or StageSplit(p, v, (len(kinds) // (p * v),) * (p * v))
        rows = split.pipeline_rows.reshape(p, -1)[stage]
        kinds = tuple(kinds[i] for i in rows if i >= 0)
    return {KIND_SCOPE: tuple(kinds.count(k) / len(kinds) for k in range(len(distinct)))}
