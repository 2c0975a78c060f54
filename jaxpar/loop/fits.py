"""Whether the compiled step fits the memory JAX's allocator holds on a device: checked
after the compile and before the starting state is made, so a step that cannot fit is
refused with the figures and what would work, not by an out-of-memory error partway
through allocating it."""

from __future__ import annotations

import os
from typing import Any

from jaxpar.device_memory import DEVICE_MEMORY_SHARE, MEMORY_FRACTION_VARIABLE, allocator_bytes, step_bytes
from jaxpar.errors import ConfigError
from jaxpar.units import byte_size

# What needs less memory, for the refusal's message.
LESS = ("model.remat=dots or full; fewer tokens a step per device (train.global_batch, or the same batch in more "
        "train.microbatches); parameters and optimizer state split over mesh.fsdp; or optim.offload. `jaxpar "
        "explain RECIPE --set ...` prints where the bytes go")


def fit_problem(stats: Any, limit: int, device: str) -> str | None:
    """Why a step whose memory_analysis is `stats` cannot run on `device`, whose allocator
    holds `limit` bytes, or None when it fits."""
    need = step_bytes(stats)
    if need <= limit:
        return None
    share = os.environ.get(MEMORY_FRACTION_VARIABLE)
    held = f"{MEMORY_FRACTION_VARIABLE}={share}" if share else f"JAX's default {MEMORY_FRACTION_VARIABLE}=0.75"
    state = stats.argument_size_in_bytes
    return (f"the compiled step needs {byte_size(need)} on each device ({byte_size(state)} of arguments: the model "
            f"state and the batch; {byte_size(stats.temp_size_in_bytes)} of temporaries), but JAX's allocator on "
            f"{device} holds {byte_size(limit)} ({held}); raise {MEMORY_FRACTION_VARIABLE} (jaxpar's commands set "
            f"{DEVICE_MEMORY_SHARE} unless it is set; up to about 0.95) or need less: {LESS}")


def check_fits(compiled: Any, device: Any) -> None:
    """Raise ConfigError where the compiled step cannot fit on `device` (one this process
    runs on); nothing where the device reports no allocator limit (CPUs) or the compiler
    no memory analysis."""
    stats = compiled.memory_analysis()
    limit = allocator_bytes(device)
    if stats is None or not limit:
        return
    problem = fit_problem(stats, limit, str(device))
    if problem:
        raise ConfigError(problem)
