"""What a batch holds for each task, how it is laid out over the devices (BatchLayout), and
how host-local rows become one global array."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxpar.errors import ConfigError
from jaxpar.model import declared, has

# field -> (its shape per example, dtype): "seq" is (train.seq_len,), "input" the model's
# input shape, () one value per example. The leading dimension is always the global batch.
FIELDS = {
    "lm": {"inputs": ("seq", np.int32), "targets": ("seq", np.int32), "weights": ("seq", np.float32)},
    "classify": {"inputs": ("input", np.float32), "targets": ((), np.int32), "weights": ((), np.float32)},
}


# Packed documents add, per token, its document within the row and its place in it.
FIELDS["lm_packed"] = {**FIELDS["lm"], "segment_ids": ("seq", np.int32), "positions": ("seq", np.int32)}
# Preference pairs: a row a pair (chosen, then rejected, as two segments) and the reference
# model's log-probabilities of the two answers (jaxpar.step.preference).
FIELDS["lm_preference"] = {**FIELDS["lm_packed"], "reference": ((2,), np.float32)}


def packs_documents(data: Any) -> bool:
    """Whether a data config's rows hold packed documents (segment ids and positions): text or
    tokens with an end-of-document id (data.eos_id), conversations (data.source=chat) and
    preference pairs (data.source=preference)."""
    if data.source == "mix":
        from jaxpar.data.mixing import parse_mix

        return data.eos_id >= 0 or any(e.kind == "chat" for e in parse_mix(data.mix))
    return data.eos_id >= 0 or data.source in ("chat", "preference")


def batch_kind(task: str, data: Any) -> str:
    """The FIELDS key of the batches of a task on a data config."""
    if task != "lm":
        return task
    if data.source == "preference":
        return "lm_preference"
    return "lm_packed" if packs_documents(data) else "lm"


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of a batch: its shape per example (after the global batch dimension), its
    dtype, and the logical names of all its dimensions (the first is "batch")."""

    shape: tuple[int, ...]
    dtype: Any
    names: tuple[str | None, ...]
    # Integer ids must lie in [0, ids_below): an lm's input tokens, which index the embedding
    # (one out of range reads NaN there); None: unchecked.
    ids_below: int | None = None


def batch_fields(model: Any, seq_len: int, data: Any) -> dict[str, Field]:
    """What a batch holds for `model`: its own `batch_fields(seq_len)` if it declares them
    (jaxpar.model), else its task's: lm token rows of seq_len (with packed documents'
    positions and segment ids where `data` packs documents, and the reference's
    log-probabilities for preference pairs: batch_kind), or classify inputs of the model's
    `input_shape` (default (in_features,)) with one target per example."""
    if has(model, "batch_fields"):
        return dict(model.batch_fields(seq_len))
    kind = batch_kind(model.task, data)
    if kind not in FIELDS:
        raise ConfigError(f"model.task={model.task!r}: jaxpar knows the batches of 'lm' and 'classify'; "
                          "give the model config batch_fields(seq_len) for others (jaxpar.model)")
    def per_example(shape) -> tuple[int, ...]:
        if shape == "seq":
            return (seq_len,)
        if shape == "input":
            return tuple(declared(model, "input_shape") or (model.in_features,))
        return shape

    fields = {}
    for name, (shape, dtype) in FIELDS[kind].items():
        shape = per_example(shape)
        ids_below = declared(model, "vocab_size") if kind.startswith("lm") and name == "inputs" else None
        fields[name] = Field(shape, dtype, ("batch", *([None] * len(shape))), ids_below)
    if data.source == "mix":  # each row's source (jaxpar.data.mixture), for each source's loss
        fields["source"] = Field((), np.int32, ("batch",))
    return fields


def batch_shapes(fields: dict[str, Field], global_batch: int) -> dict[str, tuple[int, ...]]:
    return {name: (global_batch, *f.shape) for name, f in fields.items()}


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """The global batch a step takes: its fields, its number of examples and each field's
    sharding. It is all a data source needs of the run (jaxpar.data.sources), so sources
    and held-out batches are built from it and the config, not from the Trainer."""

    fields: dict[str, Field]
    global_batch: int
    shardings: dict[str, NamedSharding]
    model_fields: bool = False  # the model declared these fields (batch_fields): jaxpar's sources make none of them

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return batch_shapes(self.fields, self.global_batch)

    @property
    def names(self) -> dict[str, tuple[str | None, ...]]:
        """Each field's logical names (microbatch and replica splits read them)."""
        return {k: f.names for k, f in self.fields.items()}

    @property
    def rows(self) -> slice:
        """The global rows this process builds (local_rows): every field's leading dimension
        is the batch, split alike."""
        return local_rows(self.shardings["inputs"], self.shapes["inputs"])

    def abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
        """ShapeDtypeStructs with shardings: for lowering the step before any data exists."""
        shapes = self.shapes
        return {k: jax.ShapeDtypeStruct(shapes[k], f.dtype, sharding=self.shardings[k]) for k, f in self.fields.items()}

    def to_global(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Assemble the global batch from this process's rows (every process calls this)."""
        shapes = self.shapes
        return {k: jax.make_array_from_process_local_data(self.shardings[k], np.asarray(v), shapes[k])
                for k, v in local.items()}


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
