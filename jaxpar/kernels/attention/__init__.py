"""Attention kernels: blockwise (one device) and context parallel (ring, Ulysses, all-gather)."""

from jaxpar.kernels.attention.tiles import Masking
from jaxpar.kernels.attention.context import ContextSpec, context_attention, executed_tiles
from jaxpar.kernels.attention.flash import flash_attention
from jaxpar.kernels.attention.order import local_index, sequence_order, unpermute
from jaxpar.kernels.attention.padding import same_head_dim
from jaxpar.kernels.attention.reference import reference_attention

__all__ = [
    "ContextSpec",
    "Masking",
    "context_attention",
    "executed_tiles",
    "flash_attention",
    "local_index",
    "reference_attention",
    "same_head_dim",
    "sequence_order",
    "unpermute",
]
