"""What `build` checked itself before the catalogue: the devices' backend (run only when
validate is told the platform), then the rule-table overrides."""

from __future__ import annotations

import math

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError
from jaxpar.data.batch import packs_documents
from jaxpar.sharding.rules import parse_table
from jaxpar.model import ATTENTION, declared, supports

RULES: list[Rule] = []
rule = collector(RULES)


@rule(
    "pallas-needs-gpu",
    fields=["parallel.context.kernel"],
    summary="parallel.context.kernel=pallas lowers through Triton, so it needs GPUs (pallas_interpret runs anywhere).",
    example=["mesh.context=2", "parallel.context.kernel=pallas", "model.head_dim=16", "train.seq_len=128"],
    needs="platform",
)
def pallas_needs_gpu(config, platform: str) -> None:
    if config.parallel.context.kernel == "pallas" and platform != "gpu":
        raise ConfigError(
            f"parallel.context.kernel=pallas lowers through Triton for GPUs, but the devices are {platform}; "
            "use pallas_interpret (the same kernel in the Pallas interpreter: slow, for checking) or jax"
        )


def cudnn_attention_problem(config, platform: str, device=None) -> str | None:
    """Why cuDNN's fused attention cannot run this config (on `device`, when given), or None
    if it can (auto picks it then)."""
    model, dtype = config.model, config.train.compute_dtype
    if platform != "gpu":
        return f"cuDNN attention runs on GPUs, but the devices are {platform}"
    if device is not None:
        capability = getattr(device, "compute_capability", None)
        rocm = "rocm" in str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
        if rocm or capability is None or float(capability) < 8.0:
            return f"cuDNN attention needs a CUDA GPU of compute capability 8.0 or more, not {device.device_kind}"
    if not supports(model, ATTENTION):
        return f"model {type(model).__name__} does not route attention through jaxpar's helper (capability 'attention')"
    if packs_documents(config.data):
        return (f"data.source={config.data.source} with data.eos_id={config.data.eos_id} packs documents, whose segment "
                "ids cuDNN attention does not take")
    if dtype not in ("bfloat16", "float16"):
        return f"train.compute_dtype={dtype}: cuDNN attention runs in bfloat16 or float16"
    # the heads it runs: queries' and values' padded to one size (jaxpar.sharding.attend.fused_attention)
    head = max(model.head_dim, declared(model, "v_head_dim"))
    # JAX allows 256 only when the GPU it asks is a Hopper: its default backend's, or the
    # target of a deviceless compile (jaxpar.deviceless points JAX's question there).
    capability = getattr(device, "compute_capability", None) if device is not None else _asked_capability()
    hopper = _runs_on_gpu() and float(capability or 0) >= 9.0
    largest = 256 if hopper else 128
    if head % 8 or head > largest:
        return (f"model.head_dim={model.head_dim}" + (f" (values {head})" if head != model.head_dim else "")
                + f": cuDNN attention takes head dims that are multiples of 8 up to {largest}"
                + ("" if hopper else " (256 on a Hopper GPU, which parallel.attention=auto uses it for)"))
    return None


def _asked_capability() -> str | None:
    """The compute capability of the GPU JAX's checks ask: a deviceless target's, or the
    default backend's first device's (None: no GPU)."""
    import jax

    from jaxpar.deviceless import target_capability

    target = target_capability()
    if target is not None:
        return target
    return jax.devices()[0].compute_capability if jax.default_backend() == "gpu" else None


def _runs_on_gpu() -> bool:
    """Whether JAX's cuDNN checks see a GPU: the default backend's, or a deviceless target."""
    import jax

    from jaxpar.deviceless import target_capability

    return jax.default_backend() == "gpu" or target_capability() is not None


@rule(
    "cudnn-attention-applies",
    fields=["parallel.attention", "train.compute_dtype", "data.eos_id", "data.source", "model.head_dim"],
    summary="attention=cudnn needs GPUs, a Llama-family model, no packed documents, bf16/fp16 and head dims that "
    "are multiples of 8 up to 128.",
    example=["parallel.attention=cudnn"],
    needs="platform",
)
def cudnn_attention_applies(config, platform: str) -> None:
    problem = cudnn_attention_problem(config, platform) if config.parallel.attention == "cudnn" else None
    if problem:
        raise ConfigError(f"parallel.attention=cudnn: {problem}; use parallel.attention=flash or reference (or auto)")


@rule(
    "ragged-exchange-needs-gpu",
    fields=["parallel.expert_exchange"],
    summary="expert_exchange=ragged needs jax.lax.ragged_all_to_all, which only GPUs have.",
    example=["parallel.expert_exchange=ragged"],
    needs="platform",
)
def ragged_exchange_needs_gpu(config, platform: str) -> None:
    if config.parallel.expert_exchange == "ragged" and platform != "gpu":
        raise ConfigError(
            f"parallel.expert_exchange=ragged needs jax.lax.ragged_all_to_all, which the {platform} backend "
            "lacks; use padded (or auto, which picks ragged on GPUs)"
        )


@rule(
    "fp8-float32-compute-on-gpu",
    fields=["train.matmul_dtype", "train.compute_dtype"],
    summary="On GPUs, FP8 projections (train.matmul_dtype=fp8) write the compute dtype, which must not be float32: XLA's "
    "GPU compiler cannot compile them writing float32 (the CPU backend runs them, as the tests do).",
    example=["train.matmul_dtype=fp8"],
    needs="platform",
    platform="gpu",
)
def fp8_float32_compute_on_gpu(config, platform: str) -> None:
    train = config.train
    if platform == "gpu" and train.matmul_dtype == "fp8" and train.compute_dtype == "float32":
        raise ConfigError("train.matmul_dtype=fp8 with train.compute_dtype=float32 does not compile for GPUs: the FP8 "
                          "matmuls would write float32, which XLA's GPU compiler leaves to a fused kernel that cannot "
                          "multiply 8-bit floats ('failed to legalize arith.mulf' on f8E4M3FN); set "
                          "train.compute_dtype=bfloat16 (the FP8 matmuls accumulate in float32 either way), or "
                          "train.matmul_dtype=compute")


@rule(
    "compiler-options-parse",
    fields=["compiler.options"],
    summary="Compiler options read 'name=value,...'.",
    example=["compiler.options=xla_gpu_enable_latency_hiding_scheduler"],
)
def compiler_options_parse(config, sizes) -> None:
    from jaxpar.xla_options import parse_options

    parse_options(config.compiler.options)


@rule(
    "compiler-options-known",
    fields=["compiler.options"],
    summary="Every compiler option is one the installed jaxlib accepts, with a valid value (an unknown one "
    "would fail the compile; the preset's own options are checked too and left out when unknown).",
    example=["compiler.options=xla_gpu_no_such_option=true"],
    also=[["compiler.options=xla_gpu_pipeline_all_gather=on"]],
    needs="platform",
)
def compiler_options_known(config, platform: str) -> None:
    from jaxpar.xla_options import step_options

    step_options(config, platform)


@rule(
    "uninitialised-stacks-one-device",
    fields=["compiler.uninitialised_stacks"],
    summary="Stacks allocated without a fill (compiler.uninitialised_stacks) run on one device: on more, XLA's SPMD "
    "partitioner does not split the allocation, so each device would hold every stack whole and copy its share out "
    "(the 8-device recipes' compiled temporaries grow 1.04x to 4.3x).",
    example=["compiler.uninitialised_stacks=true"],
)
def uninitialised_stacks_one_device(config, sizes) -> None:
    devices = math.prod(sizes.values())
    if config.compiler.uninitialised_stacks and devices > 1:
        raise ConfigError(f"compiler.uninitialised_stacks=true on {devices} devices: XLA's SPMD partitioner does not "
                          "split an uninitialised allocation, so every device would hold each stack whole; use it on "
                          "one device, or set it false")


# parse_table also reads the tables for build, so its two messages stay there and this
# rule wraps them; `also` breaks the other one.
@rule(
    "rule-overrides-parse",
    fields=["parallel.rules.storage", "parallel.rules.compute"],
    summary="Rule overrides read 'logical=axis+axis,...' and name only mesh axes.",
    example=["parallel.rules.storage=embed=gpu"],
    also=[["parallel.rules.compute=embed"]],
)
def rule_overrides_parse(config, sizes) -> None:
    for field in ("storage", "compute"):
        parse_table(getattr(config.parallel.rules, field), f"parallel.rules.{field}")
