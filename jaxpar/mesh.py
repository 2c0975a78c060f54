"""The device mesh: named axes, their sizes, and where devices sit on them.

Axes, outermost first: stage, data, fsdp, expert, context, tensor. Each axis may be split
into an across-host degree (slow network, outer) and a within-host degree (fast links,
inner), the hybrid layout multi-node clusters need: the inner part of every axis stays
inside one host, so the axes that talk most (tensor, context) never cross the network.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.errors import ConfigError

AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # the mesh axes a batch's rows split over


@dataclasses.dataclass(frozen=True)
class HostSplit:
    """Across-host degree of each mesh axis (1: the axis lives inside a host)."""

    # How many hosts each mesh axis spans (1: inside a host). Their product is the host
    # count; an axis's size divides by it. Simulated on CPU devices as on GPU hosts.
    stage: int = 1  # hosts mesh.stage spans (1: inside a host)
    data: int = 1  # hosts mesh.data spans (1: inside a host)
    fsdp: int = 1  # hosts mesh.fsdp spans (1: inside a host)
    expert: int = 1  # hosts mesh.expert spans (1: inside a host)
    context: int = 1  # hosts mesh.context spans (1: inside a host)
    tensor: int = 1  # hosts mesh.tensor spans (1: inside a host)

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    @property
    def num_hosts(self) -> int:
        return math.prod(self.sizes().values())


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Axis sizes; one axis may be -1 to take whatever the device count leaves."""

    stage: int = 1  # devices a pipeline splits the layers over (parallel.pipeline.schedule)
    data: int = -1  # replicas of the model, each on its share of the batch (-1: what the others leave)
    fsdp: int = 1  # devices the parameters, gradients and optimizer state are sharded over (ZeRO-3), batch split too
    expert: int = 1  # devices a MoE model's experts are split over; the batch too
    context: int = 1  # devices each sequence is split over (parallel.context.impl)
    tensor: int = 1  # devices each matmul is split over (Megatron; parallel.tensor.sequence_parallel)
    hosts: HostSplit = dataclasses.field(default_factory=HostSplit)

    def requested(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def resolve(self, num_devices: int) -> dict[str, int]:
        """Axis sizes with -1 filled in for `num_devices`; raises ConfigError if they can't fit."""
        sizes = self.requested()
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                raise ConfigError(f"mesh.{axis}={size} is not a valid axis size; use a positive integer or -1 to fill")
        fill = [a for a, s in sizes.items() if s == -1]
        if len(fill) > 1:
            raise ConfigError(
                f"mesh: only one axis may be -1, got {', '.join('mesh.' + a for a in fill)}; set all but one explicitly"
            )
        fixed = math.prod(s for s in sizes.values() if s != -1)
        if fill:
            if num_devices % fixed:
                raise ConfigError(_not_dividing(sizes, fill[0], num_devices))
            sizes[fill[0]] = num_devices // fixed
        elif fixed != num_devices:
            shown = " x ".join(f"mesh.{a}={s}" for a, s in sizes.items() if s != 1) or "mesh: all axes 1"
            raise ConfigError(
                f"{shown} multiplies to {fixed}, but there are {num_devices} devices; "
                f"make the axis sizes multiply to {num_devices}, or set one axis to -1 to fill"
            )
        for axis, across in self.hosts.sizes().items():
            if across < 1 or sizes[axis] % across:
                raise ConfigError(
                    f"mesh.hosts.{axis}={across} does not divide mesh.{axis}={sizes[axis]}; "
                    f"use one of {divisors(sizes[axis])}"
                )
        return sizes


def _not_dividing(sizes: dict[str, int], fill: str, num_devices: int) -> str:
    """The error for set axes whose product does not divide the devices `fill` (-1) would
    take the rest of: it names the axes set (what the user typed, not the fill axis) and
    the sizes of the largest of them that would fit beside the others."""
    set_axes = {a: s for a, s in sizes.items() if s not in (1, -1)}
    fixed = math.prod(set_axes.values())
    shown = " x ".join(f"mesh.{a}={s}" for a, s in set_axes.items()) + (f" = {fixed}" if len(set_axes) > 1 else "")
    largest = max(set_axes, key=set_axes.get)
    others = fixed // set_axes[largest]
    fits = f"use mesh.{largest} in {divisors(num_devices // others)}" if num_devices % others == 0 else \
        f"use axis sizes whose product divides {num_devices}"
    return (f"{shown} does not divide the {num_devices} devices (mesh.{fill}=-1 takes what the set axes leave); "
            f"{fits}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def force_cpu_devices(n: int) -> None:
    """Give the CPU backend `n` devices (a no-op for accelerators). Must come before JAX
    initialises its backends; afterwards it fails loudly rather than run on fewer.

    Also sizes the CPU runtime's thread pool (PJRT_NPROC, read when the client starts; a
    user's own setting wins) to at least 2 threads per device. XLA's CPU runtime runs a
    device's independent collectives concurrently, each blocking a pool thread until its
    peers arrive; with fewer threads than blocked collectives, two devices can wait in
    different all-gathers forever. With the default pool (one thread per core) FSDP x ring
    on 4 devices of a 2-core machine aborted in about half the runs ("Termination timeout
    for collective permute"), also with 4 threads; with 8, 0 aborts in 21 runs.

    And it turns off XLA's concurrency-optimised scheduler for the CPU (unless XLA_FLAGS
    sets it): it let devices reach their collectives in different orders, so top-k
    gradient compression over two hosts beside tensor parallelism (the matrix's `topk x
    tensor`) aborted in a rendezvous or segfaulted in 5 of 9 runs and finished with
    run-to-run different losses; without it, 0 of 4, the same losses each time."""
    if "PJRT_NPROC" not in os.environ and "NPROC" not in os.environ:
        os.environ["PJRT_NPROC"] = str(max(2 * n, os.cpu_count() or 1))
    if "xla_cpu_enable_concurrency_optimized_scheduler" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:
        have = len(jax.devices("cpu"))
        if have != n:
            raise RuntimeError(f"force_cpu_devices({n}) came after JAX started with {have} CPU devices") from e


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None,
              sizes: dict[str, int] | None = None) -> Mesh:
    """A Mesh over `devices` (default: all) with Auto axes, hosts outermost on every axis;
    `sizes`: the axis sizes already resolved for these devices (jaxpar.checks.validate).

    Devices are grouped into hosts by process when the number of processes equals the
    number of hosts the config asks for; in a single process (CPU tests, one GPU box) hosts
    are simulated by contiguous blocks of devices, so the layout is the one a cluster gets.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = config.resolve(len(devices)) if sizes is None else dict(sizes)
    across = config.hosts.sizes()
    within = {a: sizes[a] // across[a] for a in AXES}
    hosts = _host_groups(devices, config.hosts.num_hosts)
    # [host axes..., within axes...] -> interleave (across_i, within_i) and merge each pair.
    per_host = [_arrange_within_host(group, [within[a] for a in AXES]) for group in hosts]
    grid = np.array(per_host, dtype=object).reshape([across[a] for a in AXES] + [within[a] for a in AXES])
    n = len(AXES)
    grid = grid.transpose([i for pair in zip(range(n), range(n, 2 * n)) for i in pair])
    grid = grid.reshape([sizes[a] for a in AXES])
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * n)


def _host_groups(devices: list[jax.Device], num_hosts: int) -> list[list[jax.Device]]:
    processes = sorted({d.process_index for d in devices})
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    if len(processes) % num_hosts == 0:  # a host is one or more whole processes
        per = len(processes) // num_hosts
        return [[d for d in ordered if d.process_index in processes[i * per : (i + 1) * per]] for i in range(num_hosts)]
    if len(processes) == 1 and len(devices) % num_hosts == 0:
        per = len(devices) // num_hosts
        return [ordered[i * per : (i + 1) * per] for i in range(num_hosts)]
    raise ConfigError(
        f"mesh.hosts asks for {num_hosts} hosts, but the devices come from {len(processes)} processes; "
        f"make the product of mesh.hosts.* divide the number of processes ({len(processes)})"
    )


def _arrange_within_host(devices: list[jax.Device], shape: list[int]) -> np.ndarray:
    if devices[0].platform == "gpu" or devices[0].platform == "tpu":
        from jax.experimental import mesh_utils

        return mesh_utils.create_device_mesh(shape, devices=devices)
    return np.array(sorted(devices, key=lambda d: (d.process_index, d.id)), dtype=object).reshape(shape)


def describe(mesh: Mesh) -> str:
    """'data=2 fsdp=2 tensor=2' (axes of size 1 left out)."""
    parts = [f"{a}={s}" for a, s in mesh.shape.items() if s != 1]
    return " ".join(parts) or "single device"


def host_of_positions(mesh: Mesh, num_hosts: int) -> list[int]:
    """Host index of each device in `mesh.devices.flat` order (the partition ids of a
    program compiled for the mesh), grouped as `make_mesh` grouped them."""
    groups = _host_groups(list(mesh.devices.flat), num_hosts)
    host = {d.id: i for i, group in enumerate(groups) for d in group}
    return [host[d.id] for d in mesh.devices.flat]


def mesh_here(mesh: Mesh):
    """`mesh`, or inside a `shard_map` that is manual over some of its axes (the pipeline
    executor), the context's abstract mesh: a sharding constraint or a nested shard_map
    there may name only the axes left to the partitioner, and must say which are manual."""
    context = jax.sharding.get_abstract_mesh()
    return context if context.manual_axes else mesh


def manual_rows() -> tuple[str, ...]:
    """The batch axes the context is manual over (inside the pipeline executor: `data`, and
    `expert` where it is manual too): a device holds only its own rows there."""
    return tuple(a for a in BATCH_AXES if a in jax.sharding.get_abstract_mesh().manual_axes)
