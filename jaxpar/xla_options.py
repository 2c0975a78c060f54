"""XLA compiler options for the train step. On GPUs the `overlap` preset asks XLA to hide
communication behind computation: the latency-hiding scheduler, collectives pipelined out of
the layer loop, the loop double-buffered, collectives combined up to about one layer, matmuls
with a collective operand decomposed into windowed (collective) einsums, and pipelined
point-to-point sends. The options go to `jax.jit(..., compiler_options=...)`, so they hold
for the step alone and no process-wide XLA_FLAGS are touched.

An unknown flag in XLA_FLAGS aborts the process; an unknown compiler option fails the
compile. Every option is therefore compiled once, alone, into a trivial function first
(`unsupported`), and a preset option the installed jaxlib lacks falls back to its older
spelling or is left out, while an option the user named is refused with the reason.
"""

from __future__ import annotations

import functools
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.model import declared, has

ON = "COLLECTIVE_PIPELINING_MODE_ON"  # `--xla_gpu_pipeline_all_gather=on` as a compiler option

# Older jaxlibs spell the collective pipeliner as booleans.
OLDER_SPELLING = {
    f"xla_gpu_pipeline_{op}": (f"xla_gpu_enable_pipelined_{op}", True) for op in ("all_gather", "reduce_scatter", "all_reduce")
}


def overlap_preset(layer_params: int, compute_bytes: int) -> dict[str, Any]:
    """The GPU overlap flags, with combine thresholds of one layer: its parameters in the
    compute dtype for the gathers, its float32 gradients for the reductions. Combining more
    would hold a gather back until later layers' weights are ready; less sends many small
    messages."""
    gather, reduce = layer_params * compute_bytes, layer_params * 4
    return {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_pipeline_all_gather": ON,
        "xla_gpu_pipeline_reduce_scatter": ON,
        "xla_gpu_pipeline_all_reduce": ON,
        "xla_gpu_enable_while_loop_double_buffering": True,
        "xla_gpu_all_gather_combine_threshold_bytes": gather,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": reduce,
        "xla_gpu_all_reduce_combine_threshold_bytes": reduce,
        "xla_gpu_multi_streamed_windowed_einsum": True,
        "xla_gpu_threshold_for_windowed_einsum_mib": 0,
        "xla_gpu_enable_pipelined_p2p": True,
    }


def parse_options(text: str, field: str = "compiler.options") -> dict[str, Any]:
    """'name=value,name=value' -> {name: value}; true/false become booleans, integers ints."""
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ConfigError(
                f"{field}={text!r}: {item!r} is not name=value; e.g. "
                f"{field}=xla_gpu_enable_latency_hiding_scheduler=false"
            )
        options[name.strip()] = _value(value.strip())
    return options


def _value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def layer_params(model) -> int:
    """Parameters of one layer of the stack: the model's `layer_param_count()` if it says,
    else an even share of all (the whole model when it has no stack)."""
    if has(model, "layer_param_count"):
        return model.layer_param_count()
    layers = declared(model, "num_layers", 0)
    return model.param_count() // layers if layers else model.param_count()


def step_options(config, platform: str) -> dict[str, Any]:
    """The options the train step compiles with: the preset (checked, with fallbacks), then
    `compiler.options` on top (checked, refused if unsupported)."""
    preset = config.compiler.preset
    if preset == "auto":
        preset = "overlap" if platform == "gpu" else "none"
    options: dict[str, Any] = {}
    if preset == "overlap":
        compute_bytes = 2 if config.train.compute_dtype == "bfloat16" else 4
        for name, value in overlap_preset(layer_params(config.model), compute_bytes).items():
            if name == "xla_gpu_multi_streamed_windowed_einsum" and crashes_windowed_einsum(config):
                value = False  # off, not left out: XLA's own default has it on
            if unsupported(name, value) and name in OLDER_SPELLING:
                name, value = OLDER_SPELLING[name]
            if not unsupported(name, value):
                options[name] = value
    explicit = parse_options(config.compiler.options)
    refused = {name: why for name, value in explicit.items() if (why := unsupported(name, value))}
    if refused:
        import jax

        raise ConfigError(
            "compiler.options: the installed jaxlib " + jax.__version__ + " refuses "
            + "; ".join(f"{name} ({why})" for name, why in refused.items())
            + "; remove them or check the spelling (compiler options take enum names, e.g. "
            f"xla_gpu_pipeline_all_gather={ON})"
        )
    return {**options, **explicit}


def crashes_windowed_einsum(config) -> bool:
    """Whether the preset's multi-streamed windowed einsum would crash the GPU compiler on
    this config: jaxlib 0.12.0.1's WindowedEinsumHandler segfaults on FP8 projections behind
    sequence parallelism's gathers inside pipeline stages (benchmarks/gpu_compile.py found it
    compiling the llama_pp recipe with train.matmul_dtype=fp8; each of the three alone, or
    any two, compiles). Such a step compiles with it off (left out, XLA's default turns it
    on): the windowed steps then run on one stream."""
    return (config.train.matmul_dtype == "fp8" and config.parallel.tensor.sequence_parallel
            and config.mesh.stage not in (0, 1))


@functools.cache
def unsupported(name: str, value: Any) -> str | None:
    """Why the installed jaxlib refuses the option (None: it compiles). Options of every
    backend are fields of one DebugOptions, so a GPU option is checked on any backend."""
    import jax
    import numpy as np

    try:
        jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(np.zeros((), np.float32)).compile()
    except Exception as e:  # XLA reports unknown names and bad values as runtime errors
        return str(e).split("\n")[0].removeprefix("INVALID_ARGUMENT: ")
    return None
