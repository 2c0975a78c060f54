"""A GPU's memory as jaxpar counts it: the share JAX's allocator is given (the planner's
budget too), what that allocator holds on a device, and what a compiled program needs of
it by the compiler's count. `jaxpar.loop.fits` refuses a step that cannot fit; `jaxpar
explain` prints the same figures."""

from __future__ import annotations

import os
from typing import Any

import jax


# The share of each GPU's memory the step may take: what `jaxpar plan` budgets, and what
# jaxpar's commands let JAX's allocator hold (`share_gpu_memory`); the rest is for the CUDA
# context, NCCL's buffers and fragmentation. JAX's own default is 0.75.
DEVICE_MEMORY_SHARE = 0.9
MEMORY_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def share_gpu_memory(share: float = DEVICE_MEMORY_SHARE) -> None:
    """Let JAX's GPU allocator hold `share` of each GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION,
    which JAX reads when its GPU backend starts), so a layout the planner fits into 90% runs
    where JAX's default 75% would run out; a user's own setting wins. No effect on CPUs."""
    os.environ.setdefault(MEMORY_FRACTION_VARIABLE, str(share))


def allocator_bytes(device: jax.Device) -> int | None:
    """Bytes JAX's allocator holds on `device` for programs: what a GPU reports (its
    bytes_limit); for a GPU compiled for without one (jaxpar.deviceless), the share
    XLA_PYTHON_CLIENT_MEM_FRACTION (or `share_gpu_memory`'s) of the target's memory; None
    where there is no limit to check against (CPUs)."""
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # a deviceless GPU has no allocator to ask
        limit = None
    if limit or device.platform != "gpu":
        return limit or None
    from jaxpar.deviceless import target_memory

    memory = target_memory()
    share = float(os.environ.get(MEMORY_FRACTION_VARIABLE, DEVICE_MEMORY_SHARE))
    return int(memory * share) if memory else None


def step_bytes(stats: Any) -> int:
    """Device bytes the compiled step holds at once, by the compiler's count (XLA's
    memory_analysis): its arguments, its outputs and its temporaries, less the donated
    arguments its outputs reuse. Host-memory buffers (offload) are counted apart by XLA."""
    held = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    return held - stats.alias_size_in_bytes
