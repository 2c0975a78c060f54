"""A checked config -> the Layout its step runs under: the mesh (from the axis sizes the
checks resolved), the rules (defaults, the model's own names, the config's overrides), how
parameters are gathered, and which attention and expert-exchange kernels run."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax

from jaxpar.checks.backend import cudnn_attention_problem
from jaxpar.mesh import make_mesh
from jaxpar.model import axis_names
from jaxpar.sharding.annotate import ContextAttention, Layout, ParamGather, Projections
from jaxpar.sharding.rules import Rules, default_rules, parse_table


def layout_for(config: Any, devices: Sequence[jax.Device], sizes: Mapping[str, int]) -> Layout:
    """The step's layout on `devices`, the mesh axes of `sizes` (jaxpar.checks.validate)."""
    parallel, device = config.parallel, devices[0]
    mesh = make_mesh(config.mesh, devices, sizes)
    zero_axes = ("data",) if parallel.zero_stage >= 3 and mesh.shape["data"] > 1 else ()
    return Layout(
        mesh,
        rules_for(config, mesh.shape),
        ParamGather(
            zero_axes=zero_axes,
            hpz=parallel.hpz,
            quantize_block=parallel.quantization_block if parallel.quantized_weights else 0,
        ),
        ContextAttention(parallel.context_impl, parallel.context_layout, parallel.attention_block, parallel.attention_kernel),
        expert_exchange=expert_exchange(config, device.platform),
        projections=Projections(parallel.collective_matmul, config.train.matmul_dtype),
        attention=attention(config, device, mesh.shape["context"], mesh.shape["stage"]),
    )


def rules_for(config: Any, mesh_shape: Mapping[str, int]) -> Rules:
    """The default rules for the mesh, the model's own names mapped onto jaxpar's, then the
    config's overrides (which win)."""
    parallel = config.parallel
    rules = default_rules(mesh_shape, parallel.sequence_parallel).with_aliases(axis_names(config.model))
    return rules.with_overrides(
        storage=parse_table(parallel.storage_rules, "parallel.storage_rules"),
        compute=parse_table(parallel.compute_rules, "parallel.compute_rules"),
    )


def expert_exchange(config: Any, platform: str) -> str:
    """parallel.expert_exchange with auto resolved: ragged on GPUs, padded elsewhere."""
    exchange = config.parallel.expert_exchange
    return ("ragged" if platform == "gpu" else "padded") if exchange == "auto" else exchange


def attention(config: Any, device: jax.Device, context: int = 1, stage: int = 1) -> str:
    """parallel.attention with auto resolved: cuDNN's fused attention where it applies (a
    sharded sequence runs the context-parallel kernels instead, and needs no choice). Not
    inside pipeline stages: cuDNN attention's custom partitioning fails in their shard_map
    (jaxlib 0.12, compiled for H100s)."""
    choice = config.parallel.attention
    if context > 1:
        return "reference"  # unused: the context kernels run (the checks refuse other choices there)
    if choice != "auto":
        return choice
    usable = stage == 1 and cudnn_attention_problem(config, device.platform, device) is None
    return "cudnn" if usable else "reference"
