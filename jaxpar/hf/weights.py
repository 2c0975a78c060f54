"""How a model's parameters lie in a Hugging Face checkpoint, and reading one device's slice.

A model declares `hf_weights()`: {its parameter path ("layers.attn.wq"): Weight}. A Weight
names the Hugging Face tensor, with a `{layer}` (and `{expert}`) placeholder for each
stacked leading dimension of ours, in order; each such tensor, reshaped to `view` and its
axes put in `order`, is one slab of our array. Both are views, so slicing the result of a
memory-mapped tensor reads only the elements the slice holds.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np

from jaxpar.hf.safetensors import Entry, open_tensor


@dataclasses.dataclass(frozen=True)
class Weight:
    """One parameter in Hugging Face's format; `name` None: not in it (starts at zero, is
    not exported), e.g. a balancing bias that is no parameter of Hugging Face's model."""

    name: str | None
    view: tuple[int, ...] | None = None  # None: the tensor's own shape
    order: tuple[int, ...] | None = None  # None: its own axis order
    fused: tuple[int, ...] | None = None  # with `view`: the tensor's own shape, which it splits
    # The Hugging Face index of each of our slabs along `{layer}` (None: the same as ours), for a
    # stack among others: DeepSeek-V3's MoE layers after its dense ones, Qwen3-MoE's dense layers
    # among the MoE ones.
    layer_ids: tuple[int, ...] | None = None
    fresh: bool = False  # a checkpoint without this tensor leaves the parameter at the model's own initialisation
    # The dtype the export writes this tensor in whatever the export's (None: the export's):
    # DeepSeek-V3's routing bias stays float32, as published (rounded, it picks other experts).
    export_dtype: str | None = None
    # More names (with the same placeholders) the export writes the same tensor under, and an
    # import accepts without reading: DeepSeek-V3's prediction layer's copies of the embedding
    # and head, which vLLM's loader reads.
    copies: tuple[str, ...] = ()

    def __post_init__(self):
        if (self.view is None) != (self.fused is None):
            raise ValueError(f"Weight {self.name!r}: give view and fused together (the tensor's own shape, and the "
                             "shape it is viewed as)")

    @property
    def stacked(self) -> tuple[str, ...]:
        """The placeholders of `name`, one per leading stacked dimension of ours."""
        return tuple(re.findall(r"\{(\w+)\}", self.name or ""))

    def names(self, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], str]]:
        """(index into our stacked dimensions, Hugging Face name) for every slab."""
        k = len(self.stacked)
        return [(combo, self.hf_name(combo)) for combo in itertools.product(*(range(n) for n in shape[:k]))]

    def hf_name(self, combo: tuple[int, ...], template: str | None = None) -> str:
        """The Hugging Face name of our slab at `combo` (an index into the stacked dimensions):
        `name`'s, or `template`'s (one of `copies`)."""
        at = dict(zip(self.stacked, combo))
        if "layer" in at and self.layer_ids is not None:
            at["layer"] = self.layer_ids[at["layer"]]
        return (template or self.name).format(**at)

    def copy_names(self, combo: tuple[int, ...]) -> list[str]:
        """The names of the copies of our slab at `combo`."""
        return [self.hf_name(combo, c) for c in self.copies]

    def to_ours(self, hf: np.ndarray) -> np.ndarray:
        """A view of the Hugging Face tensor in our layout (one slab)."""
        view = hf if self.view is None else hf.reshape(self.view)
        return view if self.order is None else view.transpose(self.order)

    def to_hf(self, slab: np.ndarray, hf_shape: tuple[int, ...]) -> np.ndarray:
        """One slab of ours back in Hugging Face's layout."""
        back = slab if self.order is None else slab.transpose(np.argsort(self.order))
        return back.reshape(hf_shape)

    def hf_shape(self, slab_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face tensor's shape for our slab of `slab_shape`."""
        if self.view is not None:
            return self.fused
        return slab_shape if self.order is None else tuple(slab_shape[i] for i in np.argsort(self.order))


def read_slice(weight: Weight, entries: dict[str, Entry], shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """Our array's `index` (one device's shard), in float32, read from the memory-mapped
    tensors: each stacked slab in range, then only the slice of it."""
    if weight.name is None:
        return np.zeros([len(range(*s.indices(n))) for s, n in zip(index, shape)], np.float32)
    k = len(weight.stacked)
    ranges = [range(*s.indices(n)) for s, n in zip(index[:k], shape[:k])]
    rest = tuple(index[k:])
    slabs = []
    for combo in itertools.product(*ranges):
        tensor = open_tensor(entries[weight.hf_name(combo)])
        slabs.append(np.array(weight.to_ours(tensor)[rest], np.float32))
    if not k:
        return slabs[0]
    return np.stack(slabs).reshape(tuple(len(r) for r in ranges) + slabs[0].shape)
