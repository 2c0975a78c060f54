"""The strategies' specs: `parallel`'s sections of the run config, one per strategy, each
the very object the step's layout carries (jaxpar.step.layout.layout_for puts them in
`jaxpar.sharding.Layout`), so the step, explain, the planner and checkpoints read the fields
a user sets, under the names the user set them by. Kept apart from jaxpar.config, low in the
house, because the sharding layer reads them too."""

from __future__ import annotations

import dataclasses

from jaxpar.choices import (Attention, AttentionKernel, CollectiveMatmul, ContextImpl, DispatchDtype, ExpertExchange,
                            GradientCompression, OnReplicated, OuterCompression, PipelineBalance, PipelineSchedule,
                            SequenceLayout, ZeroStage)


@dataclasses.dataclass(frozen=True)
class TensorConfig:
    """parallel.tensor: what rides on Megatron's tensor parallelism over mesh.tensor."""

    # Megatron sequence parallelism: activations outside the matmuls sharded by sequence
    # over mesh.tensor (all-gather before, reduce-scatter after each tensor-parallel block).
    sequence_parallel: bool = False
    # Under sequence parallelism, run each column projection's all-gather and each row
    # projection's reduce-scatter as a collective matmul whose ppermute ring steps overlap
    # partial matmuls (jaxpar.sharding.projections): none | ring | bidirectional.
    collective_matmul: CollectiveMatmul = "none"


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """parallel.zero: how the training state rests over mesh.data (ZeRO, ZeRO++, offload)."""

    # What the data axis shards besides the batch: 0 nothing, 1 optimizer state,
    # 2 + gradients, 3 + parameters (jaxpar.step.zero; gathered at use).
    stage: ZeroStage = 0
    # fp32 master weights and optimizer state rest in pinned host memory between steps and
    # are brought to the device for the update (ZeRO-Offload).
    offload_optimizer: bool = False
    # The parameters (and their fp32 master copy) rest in pinned host memory too; each use
    # brings its layer's weights to the device (`compute_value`: inside the layer scan, one
    # layer at a time), and the update fetches the master (ZeRO-Infinity's parameter offload).
    offload_params: bool = False
    # ZeRO++ (arXiv 2306.10209). hpz: at stage 3, keep a secondary parameter shard inside
    # the host (mesh.fsdp) so the backward gather never crosses hosts (mesh.data).
    hpz: bool = False
    # qwZ: the parameter all-gathers in int8, one float32 scale per quantization_block elements.
    quantized_weights: bool = False
    # qgZ: the gradient reduction over mesh.data as an int8 all-to-all, one float32 scale per
    # quantization_block elements (as parallel.compression.method=int8).
    quantized_gradients: bool = False
    quantization_block: int = 256  # elements that share one float32 scale under qwZ and qgZ


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """parallel.compression: the gradient reduction over mesh.data across hosts, compressed
    (jaxpar.step.compression; needs mesh.hosts.data = mesh.data > 1, the in-host part of
    data parallelism on mesh.fsdp)."""

    # none | int8 (ZeRO++ qgZ, as parallel.zero.quantized_gradients) | powersgd (factors of
    # each gradient matrix at rank powersgd_rank, warm-started) | topk (the topk_fraction
    # largest entries of each device's block); both of these with error_feedback.
    method: GradientCompression = "none"
    powersgd_rank: int = 4  # powersgd: the rank of the two factors each gradient matrix is sent as
    topk_fraction: float = 0.01  # topk: the share of each device's gradient block sent (its largest entries)
    # powersgd, topk: what compression leaves out is carried into the next step's gradient
    # (error feedback); false drops it (PyTorch PowerSGD's use_error_feedback=False), so
    # nothing left out is ever sent.
    error_feedback: bool = True


@dataclasses.dataclass(frozen=True)
class ContextConfig:
    """parallel.context: attention over a sequence sharded on mesh.context, and the
    blockwise kernels' tiles (jaxpar.kernels.attention; parallel.attention=flash runs the
    same kernel on a whole sequence)."""

    # ring (key/value blocks passed round the devices), ulysses (all-to-alls from sequence to
    # head shards and back) or allgather (keys and values gathered whole, queries kept sharded).
    impl: ContextImpl = "ring"
    # How a sequence lies over mesh.context: zigzag (2n chunks, device r holds r and 2n-1-r:
    # the same causal work on every device) or contiguous.
    layout: SequenceLayout = "zigzag"
    block: int = 512  # the longest query/key tile of the blockwise kernels (tiles divide the layout's chunks)
    # The blockwise kernels' block forward: pure JAX (jax), one fused Pallas kernel (pallas:
    # Triton, GPUs) or that kernel in the Pallas interpreter (pallas_interpret: for checking).
    kernel: AttentionKernel = "jax"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """parallel.pipeline: the layer stack over mesh.stage (jaxpar.pipeline), run over
    train.microbatches microbatches."""

    schedule: PipelineSchedule = "1f1b"  # the order of microbatches' forward and backward passes (jaxpar.pipeline.schedule)
    chunks: int = 1  # model chunks (virtual stages) each device holds; more than 1 only for interleaved
    # Layers per virtual stage, in whole-model layers (DeepSeek's leading dense ones count on
    # the first), listed by virtual stage (device s's chunk c is entry c x mesh.stage + s):
    # '3,4*14,2' (N*K: K stages of N). '' : from `balance`.
    layers: str = ""
    # Without `layers`: even (equal chunks, refused where they do not divide) or balanced (the
    # busiest virtual stage as light as it can be, the head and loss counted on the last).
    balance: PipelineBalance = "even"


@dataclasses.dataclass(frozen=True)
class RulesConfig:
    """parallel.rules: overrides of where logical names lie, 'logical=axis+axis,...' on top
    of the defaults (jaxpar.sharding.rules)."""

    storage: str = ""  # where parameters, gradients and optimizer state rest, e.g. 'embed=fsdp'
    compute: str = ""  # where activations and parameters at their point of use lie, e.g. 'mlp=tensor'
    # A parameter whose logical names match no rule while a mesh axis that shards
    # parameters is > 1 rests whole on every device: warn (name it and the rule that would
    # shard it), error (refuse the layout), or allow (say nothing).
    on_replicated: OnReplicated = "warn"


@dataclasses.dataclass(frozen=True)
class DilocoConfig:
    """parallel.diloco: DiLoCo and streaming DiLoCo over mesh.data (jaxpar.step.diloco):
    each data replica is a group that trains on its own rows with its own inner optimizer,
    every other mesh axis inside it as without; the groups meet only in the outer step."""

    # H: the inner steps between two synchronisations of the same weights; 0: off (data
    # parallelism). With fragments, one fragment synchronises every inner_steps / fragments.
    inner_steps: int = 0
    outer_lr: float = 0.7  # the outer SGD's learning rate, on the groups' mean parameter change
    outer_momentum: float = 0.9  # the outer SGD's momentum
    nesterov: bool = True  # Nesterov's form of the outer momentum (DiLoCo's)
    # Streaming DiLoCo: the weights in this many fragments (the layer stack strided, the
    # other parameters each whole in the lightest fragment), synchronised in turn.
    fragments: int = 1
    # 1: a fragment's exchange starts from the weights before a step and runs beside that
    # step's compute, its outer step applied after it; 0: after the step, nothing beside it.
    delay: int = 0
    # After a fragment's outer step its weights become (1 - mix) x the new global ones + mix x
    # the group's own (streaming DiLoCo's alpha; 0: the global ones).
    mix: float = 0.0
    # What the outer exchange moves: none (float32) | int8 (a float32 scale per
    # quantization_block elements, both halves of the all-reduce) | topk (each device's
    # topk_fraction largest entries of its block, as (value, index) pairs).
    compression: OuterCompression = "none"
    quantization_block: int = 256  # int8: the elements that share one float32 scale
    topk_fraction: float = 0.01  # topk: the share of each device's block sent
    error_feedback: bool = True  # int8, topk: what a group's share left out is sent with its next one


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the step runs on the mesh: one section per strategy, each the very spec the
    layout carries (jaxpar.step.layout.layout_for), so everything downstream reads the
    section as written here."""

    tensor: TensorConfig = TensorConfig()
    zero: ZeroConfig = ZeroConfig()
    compression: CompressionConfig = CompressionConfig()
    context: ContextConfig = ContextConfig()
    pipeline: PipelineConfig = PipelineConfig()
    rules: RulesConfig = RulesConfig()
    diloco: DilocoConfig = DilocoConfig()
    # Attention over an unsharded sequence (mesh.context=1): reference (scores materialized,
    # softmax in float32), flash (jaxpar's blockwise kernel, parallel.context.block tiles,
    # its block forward), cudnn (cuDNN's fused flash attention: CUDA GPUs of compute
    # capability 8.0 or more, no packed documents, bf16/fp16), or auto (cudnn where it
    # applies, else flash on GPUs and reference elsewhere).
    attention: Attention = "auto"
    # How dropless MoE routing sends each expert device its rows: ragged
    # (jax.lax.ragged_all_to_all, GPUs), padded (a worst-case buffer per peer, any backend),
    # or auto (ragged on GPUs, padded elsewhere).
    expert_exchange: ExpertExchange = "auto"
    # What the experts' dispatch all-to-all moves: the tokens in the compute dtype, or fp8
    # (e4m3 in 1 x 128 tiles, a float32 power-of-two scale each, DeepSeek-V3's): 0.52x a
    # bf16 dispatch's bytes. The combine and the backward's exchanges stay in the compute
    # dtype; the gradient passes the quantization straight through.
    expert_dispatch_dtype: DispatchDtype = "compute"
    # Each layer runs on two halves of the batch's rows, one's collectives (the experts'
    # dispatch and combine, a tensor-parallel reduction) free to run while the other computes:
    # XLA's scheduler overlaps what the program gives it independent work to hide behind.
    two_batch_overlap: bool = False

    @property
    def int8_gradients(self) -> bool:
        return int8_gradients(self.zero, self.compression)


def int8_gradients(zero: ZeroConfig, compression: CompressionConfig) -> bool:
    """ZeRO++ qgZ, by either of its names: zero.quantized_gradients or compression.method=int8."""
    return zero.quantized_gradients or compression.method == "int8"


# The flat keys ParallelConfig had before its sections (issue 54), kept working: `--set`,
# --config files and checkpoints written before read them as their section's key.
RENAMED_KEYS = {
    "parallel.sequence_parallel": "parallel.tensor.sequence_parallel",
    "parallel.collective_matmul": "parallel.tensor.collective_matmul",
    "parallel.zero_stage": "parallel.zero.stage",
    "parallel.offload_optimizer": "parallel.zero.offload_optimizer",
    "parallel.hpz": "parallel.zero.hpz",
    "parallel.quantized_weights": "parallel.zero.quantized_weights",
    "parallel.quantized_gradients": "parallel.zero.quantized_gradients",
    "parallel.quantization_block": "parallel.zero.quantization_block",
    "parallel.gradient_compression": "parallel.compression.method",
    "parallel.powersgd_rank": "parallel.compression.powersgd_rank",
    "parallel.topk_fraction": "parallel.compression.topk_fraction",
    "parallel.context_impl": "parallel.context.impl",
    "parallel.context_layout": "parallel.context.layout",
    "parallel.attention_block": "parallel.context.block",
    "parallel.attention_kernel": "parallel.context.kernel",
    "parallel.pipeline_schedule": "parallel.pipeline.schedule",
    "parallel.pipeline_chunks": "parallel.pipeline.chunks",
    "parallel.storage_rules": "parallel.rules.storage",
    "parallel.compute_rules": "parallel.rules.compute",
    "parallel.on_replicated": "parallel.rules.on_replicated",
}
