"""ZeRO, ZeRO++ and gradient compression: what the data axes shard and how their reductions travel."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError

RULES: list[Rule] = []
rule = collector(RULES)


@rule(
    "hpz-needs-data-axis",
    fields=["parallel.zero.hpz", "mesh.data"],
    summary="Hierarchical ZeRO (hpZ) needs an across-host degree, mesh.data > 1.",
    example=["parallel.zero.hpz=true", "mesh.data=1", "mesh.fsdp=8"],
)
def hpz_needs_data_axis(config, sizes) -> None:
    if config.parallel.zero.hpz and sizes["data"] == 1:
        raise ConfigError(
            "parallel.zero.hpz=true is hierarchical ZeRO but mesh.data=1 leaves no across-host degree; "
            "set mesh.data to the number of hosts (e.g. mesh.data=2) and mesh.fsdp to the devices per host"
        )


@rule(
    "hpz-needs-fsdp-axis",
    fields=["parallel.zero.hpz", "mesh.fsdp"],
    summary="hpZ keeps its secondary parameter copy sharded inside the host, on mesh.fsdp > 1.",
    example=["parallel.zero.hpz=true"],
)
def hpz_needs_fsdp_axis(config, sizes) -> None:
    if config.parallel.zero.hpz and sizes["fsdp"] == 1:
        raise ConfigError(
            "parallel.zero.hpz=true needs an in-host shard for the secondary copy but mesh.fsdp=1; "
            "set mesh.fsdp to the devices per host (e.g. mesh.fsdp=4)"
        )


@rule(
    "hpz-needs-zero-3",
    fields=["parallel.zero.hpz", "parallel.zero.stage"],
    summary="hpZ only changes ZeRO-3, where parameters are sharded across hosts.",
    example=["parallel.zero.hpz=true", "mesh.data=2", "mesh.fsdp=4"],
)
def hpz_needs_zero_3(config, sizes) -> None:
    stage = config.parallel.zero.stage
    if config.parallel.zero.hpz and stage != 3:
        raise ConfigError(
            f"parallel.zero.hpz=true needs parallel.zero.stage=3 (parameters sharded across hosts), got {stage}; "
            "below stage 3 parameters already rest inside the host (hybrid sharding)"
        )


@rule(
    "quantized-weights-need-sharded-params",
    fields=["parallel.zero.quantized_weights", "mesh.fsdp", "parallel.zero.stage", "mesh.data"],
    summary="qwZ quantizes parameter all-gathers, so parameters must be sharded: mesh.fsdp > 1, or ZeRO-3 over "
    "mesh.data > 1.",
    example=["parallel.zero.quantized_weights=true"],
)
def quantized_weights_need_sharded_params(config, sizes) -> None:
    parallel, stage = config.parallel, config.parallel.zero.stage
    if parallel.zero.quantized_weights and sizes["fsdp"] == 1 and not (stage == 3 and sizes["data"] > 1):
        raise ConfigError(
            "parallel.zero.quantized_weights=true quantizes parameter all-gathers, but with mesh.fsdp=1 and "
            f"parallel.zero.stage={stage} parameters are not sharded; set mesh.fsdp>1 or parallel.zero.stage=3 with mesh.data>1"
        )


@rule(
    "quantized-gradients-need-data-sharding",
    fields=["parallel.zero.quantized_gradients", "parallel.compression.method", "mesh.data", "parallel.zero.stage"],
    summary="qgZ (parallel.zero.quantized_gradients, or parallel.compression.method=int8) quantizes the gradient reduce-scatter "
    "over mesh.data, so it needs mesh.data > 1 and ZeRO >= 1.",
    example=["parallel.zero.quantized_gradients=true"],
    also=[["parallel.compression.method=int8"]],
)
def quantized_gradients_need_data_sharding(config, sizes) -> None:
    stage = config.parallel.zero.stage
    if config.parallel.int8_gradients and (sizes["data"] == 1 or stage == 0):
        named = ("parallel.zero.quantized_gradients=true" if config.parallel.zero.quantized_gradients
                 else "parallel.compression.method=int8")
        raise ConfigError(
            f"{named} quantizes the gradient reduce-scatter over mesh.data, but "
            f"mesh.data={sizes['data']} and parallel.zero.stage={stage}; use mesh.data>1 and parallel.zero.stage>=1 "
            "(so the data axis shards the reduced gradient)"
        )


@rule(
    "gradient-compression",
    fields=["parallel.compression.method", "parallel.compression.powersgd_rank", "parallel.compression.topk_fraction",
            "parallel.compression.error_feedback", "parallel.zero.quantized_gradients", "mesh.hosts", "mesh.data"],
    summary="parallel.compression.method=powersgd or topk compresses the reduction over mesh.data across hosts, "
    "so it needs every data replica on its own host (mesh.hosts.data = mesh.data > 1), a rank >= 1, a fraction in "
    "(0, 1]; error feedback is theirs alone.",
    example=["parallel.compression.method=topk", "parallel.compression.topk_fraction=0", "mesh.data=2", "mesh.hosts.data=2",
             "mesh.fsdp=4"],
    also=[["parallel.compression.method=powersgd", "parallel.compression.powersgd_rank=0", "mesh.data=2", "mesh.hosts.data=2",
           "mesh.fsdp=4"],
          ["parallel.compression.method=powersgd", "mesh.data=2", "mesh.fsdp=4"],
          ["parallel.compression.method=topk", "mesh.data=4", "mesh.hosts.data=2", "mesh.fsdp=2"],
          ["parallel.compression.method=topk", "parallel.zero.quantized_gradients=true", "mesh.data=2",
           "mesh.hosts.data=2", "mesh.fsdp=4", "parallel.zero.stage=1"],
          ["parallel.compression.error_feedback=false"]],
)
def gradient_compression(config, sizes) -> None:
    parallel, method = config.parallel, config.parallel.compression.method
    if method in ("none", "int8"):
        if not parallel.compression.error_feedback:
            raise ConfigError(f"parallel.compression.error_feedback=false with parallel.compression.method={method}: "
                              "only powersgd and topk leave anything out to feed back; set "
                              "parallel.compression.method=powersgd or topk, or leave error_feedback=true")
        return
    if method == "topk" and not 0 < parallel.compression.topk_fraction <= 1:
        raise ConfigError(f"parallel.compression.topk_fraction={parallel.compression.topk_fraction}: the share of each gradient block "
                          "sent; use 0 < fraction <= 1 (e.g. 0.01)")
    if method == "powersgd" and parallel.compression.powersgd_rank < 1:
        raise ConfigError(f"parallel.compression.powersgd_rank={parallel.compression.powersgd_rank}; use a rank >= 1 (e.g. 4)")
    data, across = sizes["data"], config.mesh.hosts.data
    if across < 2:
        raise ConfigError(
            f"parallel.compression.method={method} compresses the reduction over mesh.data across hosts, but "
            f"mesh.hosts.data={across} puts no data replicas on other hosts; set mesh.data and mesh.hosts.data to the "
            "number of hosts (e.g. mesh.data=2 mesh.hosts.data=2) and mesh.fsdp to the devices per host"
        )
    if data != across:
        raise ConfigError(
            f"parallel.compression.method={method} with mesh.data={data} and mesh.hosts.data={across}: "
            f"{data // across} data replicas share each host, and compression would cover their in-host reduction "
            f"too; set mesh.data={across} and put the in-host degree on mesh.fsdp (x{data // across}), where it stays exact"
        )
    if parallel.zero.quantized_gradients:
        raise ConfigError(f"parallel.zero.quantized_gradients=true with parallel.compression.method={method}: one "
                          "compressor per reduction; set parallel.zero.quantized_gradients=false, or "
                          "parallel.compression.method=int8 (the same qgZ)")


@rule(
    "quantization-block-positive",
    fields=["parallel.zero.quantization_block"],
    summary="Each int8 scale covers a positive number of elements.",
    example=["parallel.zero.quantization_block=0"],
)
def quantization_block_positive(config, sizes) -> None:
    block = config.parallel.zero.quantization_block
    if block < 1:
        raise ConfigError(
            f"parallel.zero.quantization_block={block} must be a positive number of elements per scale; e.g. 256"
        )


@rule(
    "offload-params-support",
    fields=["parallel.zero.offload_params", "mesh.stage", "parallel.compression.method", "lora.rank"],
    summary="Parameters resting in host memory (parallel.zero.offload_params) are fetched where each layer uses "
    "them and their gradients brought back for the reduction: not yet inside the pipeline executor or the "
    "compressed reduction, and not for LoRA, whose adapters are small and whose base stays on the device.",
    example=["parallel.zero.offload_params=true", "mesh.stage=2", "mesh.data=4", "train.microbatches=2"],
    also=[["parallel.zero.offload_params=true", "lora.rank=4"]],
)
def offload_params_support(config, sizes) -> None:
    if not config.parallel.zero.offload_params:
        return
    unsupported = {"mesh.stage": sizes.get("stage", 1) > 1,
                   "parallel.compression.method": config.parallel.compression.method != "none",
                   "lora.rank": config.lora.rank > 0}
    for field, on in unsupported.items():
        if on:
            raise ConfigError(f"parallel.zero.offload_params=true with {field} set: that step does not fetch parameters "
                              "from host memory yet; set parallel.zero.offload_params=false (parallel.zero."
                              "offload_optimizer still rests the optimizer state there)")
