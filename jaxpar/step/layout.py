"""A checked config -> the Layout its step runs under: the mesh (from the axis sizes the
checks resolved), the rules (defaults, the model's own names, the config's overrides), and
one spec for each strategy: how parameters are gathered, which attention and
expert-exchange kernels run, how the state rests (ZeRO, offload), the pipeline, gradient
compression, microbatches. This is the one place that reads `config.parallel`: everything
downstream (the step, explain, the planner, checkpoints, sampling) reads the layout."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax

from jaxpar.checks.backend import cudnn_attention_problem
from jaxpar.mesh import make_mesh
from jaxpar.model import ATTENTION, axis_names, declared, supports
from jaxpar.sharding.annotate import Layout, ParamGather, Projections
from jaxpar.sharding.rules import Rules, default_rules, kv_heads_repeat, parse_table


def layout_for(config: Any, devices: Sequence[jax.Device], sizes: Mapping[str, int]) -> Layout:
    """The step's layout on `devices`, the mesh axes of `sizes` (jaxpar.checks.validate)."""
    parallel, device = config.parallel, devices[0]
    mesh = make_mesh(config.mesh, devices, sizes)
    zero_axes = ("data",) if parallel.zero.stage >= 3 and mesh.shape["data"] > 1 else ()
    repeats = kv_repeats(config, mesh.shape)
    return Layout(
        mesh,
        rules_for(config, mesh.shape, rest_whole=tuple(name for name, _ in repeats)),
        ParamGather(
            zero_axes=zero_axes,
            hpz=parallel.zero.hpz,
            quantize_block=parallel.zero.quantization_block if parallel.zero.quantized_weights else 0,
            repeats=repeats,
            from_host=parallel.zero.offload_params,
        ),
        parallel.context,
        expert_exchange=expert_exchange(config, device.platform),
        expert_dispatch_dtype=parallel.expert_dispatch_dtype,
        hosts=config.mesh.hosts,
        projections=Projections(parallel.tensor.collective_matmul, config.train.matmul_dtype,
                                config.train.fp8_expert_block),
        attention=attention(config, device, mesh.shape["context"]),
        tensor=parallel.tensor,
        zero=parallel.zero,
        pipeline=parallel.pipeline,
        compression=parallel.compression,
        diloco=parallel.diloco,
        microbatches=config.train.microbatches,
        two_batch_overlap=parallel.two_batch_overlap,
        report_logits=config.optim.qk_clip > 0,
    )


def rules_for(config: Any, mesh_shape: Mapping[str, int], rest_whole: Sequence[str] = ()) -> Rules:
    """The default rules for the mesh, the model's own names mapped onto jaxpar's, the
    names in `rest_whole` stored unsplit (repeated at use: `kv_repeats`), then the config's
    overrides (which win)."""
    parallel = config.parallel
    rules = default_rules(mesh_shape, parallel.tensor.sequence_parallel).with_aliases(axis_names(config.model))
    rules = rules.with_overrides(storage={name: () for name in rest_whole})
    return rules.with_overrides(
        storage=parse_table(parallel.rules.storage, "parallel.rules.storage"),
        compute=parse_table(parallel.rules.compute, "parallel.rules.compute"),
    )


def kv_repeats(config: Any, mesh_shape: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """ParamGather.repeats: the key/value heads of a model that declares `num_kv_heads` and
    attends through jaxpar's `attend` (whose query heads read them in contiguous groups),
    repeated at use where mesh.tensor (x the Ulysses degree) does not divide them; under
    jaxpar's name and the model's own names for it. () where nothing repeats."""
    model, parallel = config.model, config.parallel
    kv = declared(model, "num_kv_heads")
    if not kv or not supports(model, ATTENTION):
        return ()
    ulysses = mesh_shape["context"] if parallel.context.impl == "ulysses" else 1
    times = kv_heads_repeat(kv, mesh_shape["tensor"], ulysses)
    if times == 1:
        return ()
    names = ["kv_heads", *(own for own, ours in axis_names(model).items() if ours == "kv_heads")]
    return tuple((name, times) for name in names)


def expert_exchange(config: Any, platform: str) -> str:
    """parallel.expert_exchange with auto resolved: ragged on GPUs, padded elsewhere."""
    exchange = config.parallel.expert_exchange
    return ("ragged" if platform == "gpu" else "padded") if exchange == "auto" else exchange


def attention(config: Any, device: jax.Device, context: int = 1) -> str:
    """parallel.attention with auto resolved: cuDNN's fused attention where it applies (a
    sharded sequence runs the context-parallel kernels instead, and needs no choice; inside
    pipeline stages too, as jaxpar.sharding.attend calls it on each device's own heads).
    Elsewhere on GPUs jaxpar's blockwise kernel (flash), which never holds a sequence's
    [S, S] scores (packed documents, float32, wide heads: benchmarks/gpu_compile.py's hf:
    fine-tunes held 2.5x the memory with them); the reference on other devices."""
    choice = config.parallel.attention
    if context > 1:
        return "reference"  # unused: the context kernels run (the checks refuse other choices there)
    if choice != "auto":
        return choice
    if cudnn_attention_problem(config, device.platform, device) is None:
        return "cudnn"
    return "flash" if device.platform == "gpu" else "reference"
