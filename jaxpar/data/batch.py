"""What a batch holds for each task, and how host-local rows become one global array."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxpar.errors import ConfigError

# field -> (logical names, dtype); the leading dimension is always the global batch.
FIELDS = {
    "lm": {
        "inputs": (("batch", None), np.int32),
        "targets": (("batch", None), np.int32),
        "weights": (("batch", None), np.float32),
    },
    "classify": {
        "inputs": (("batch", None), np.float32),
        "targets": (("batch",), np.int32),
        "weights": (("batch",), np.float32),
    },
}


# Packed documents add, per token, its document within the row and its place in it.
FIELDS["lm_packed"] = {
    **FIELDS["lm"],
    "segment_ids": (("batch", None), np.int32),
    "positions": (("batch", None), np.int32),
}


def batch_kind(task: str, eos_id: int) -> str:
    """The FIELDS key of a config's batches."""
    return "lm_packed" if task == "lm" and eos_id >= 0 else task


def batch_shapes(task: str, global_batch: int, seq_len: int, in_features: int = 0) -> dict[str, tuple[int, ...]]:
    second = in_features if task == "classify" else seq_len
    return {name: (global_batch, second)[: len(names)] for name, (names, _) in FIELDS[task].items()}


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous range of global rows this process's devices hold: with several
    processes, each reads and builds only these rows."""
    index_map = sharding.addressable_devices_indices_map(global_shape)
    bounds = sorted({(idx[0].start or 0, global_shape[0] if idx[0].stop is None else idx[0].stop)
                     for idx in index_map.values()})
    if any(start > stop for (_, stop), (start, _) in zip(bounds, bounds[1:])):  # a gap between them
        raise ConfigError(
            f"this process's devices hold rows {bounds} of the batch, not one contiguous range; lay the mesh out so "
            "each process's devices are together along the batch axes (mesh.data, mesh.fsdp), e.g. with "
            "mesh.hosts.data or mesh.hosts.fsdp equal to the number of processes"
        )
    lo, hi = bounds[0][0], max(stop for _, stop in bounds)
    return slice(lo, hi)


def to_global(local: dict[str, np.ndarray], shardings: dict[str, NamedSharding], shapes: dict) -> dict[str, jax.Array]:
    """Assemble a global batch from this process's rows (every process calls this)."""
    return {
        k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v), shapes[k]) for k, v in local.items()
    }
