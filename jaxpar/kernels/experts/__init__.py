"""Mixture-of-experts kernels: capacity slots, expert-parallel exchange, plain reference."""

from jaxpar.kernels.experts.exchange import EXCHANGES, ROUTINGS, ExpertSpec, emulated_ragged_all_to_all, expert_parallel, local_experts
from jaxpar.kernels.experts.grouped import grouped_matmul
from jaxpar.kernels.experts.reference import reference_experts
from jaxpar.kernels.experts.slots import DROPPED, capacity_slots, expert_capacity, group_slots

__all__ = ["DROPPED", "EXCHANGES", "ROUTINGS", "emulated_ragged_all_to_all", "ExpertSpec", "capacity_slots", "expert_capacity", "expert_parallel", "group_slots", "grouped_matmul", "local_experts", "reference_experts"]
