"""Typed run configuration, dotted overrides, and the checks that run before compile."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

from jaxpar.errors import ConfigError
from jaxpar.mesh import MeshConfig, divisors
from models.llama import LlamaConfig
from models.mlp import MLPConfig
from models.moe import MoEConfig

ModelConfig = Union[LlamaConfig, MoEConfig, MLPConfig]
DTYPES = ("float32", "bfloat16")
EXPERT_EXCHANGES = ("auto", "padded", "ragged")
NONFINITE_POLICIES = ("stop", "skip")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    sequence_parallel: bool = False
    # What the data axis shards besides the batch: 0 nothing, 1 optimizer state,
    # 2 + gradients, 3 + parameters (jaxpar.train.zero).
    zero_stage: int = 0
    # ZeRO++ (arXiv 2306.10209). hpz: at zero_stage=3, keep a secondary parameter shard
    # inside the host (mesh.fsdp) so the backward gather never crosses hosts (mesh.data).
    hpz: bool = False
    # qwZ: parameter all-gathers in int8; qgZ: the gradient reduction over mesh.data as an
    # int8 all-to-all. One float32 scale per `quantization_block` elements.
    quantized_weights: bool = False
    quantized_gradients: bool = False
    quantization_block: int = 256
    # fp32 master weights and optimizer state rest in pinned host memory between steps and
    # are brought to the device for the update.
    offload_optimizer: bool = False
    # Attention over a sequence sharded on mesh.context (jaxpar.kernels.attention):
    # ring | ulysses | allgather; sequences laid out zigzag (causal load balance) or
    # contiguous; longest query/key tile of the blockwise kernels (tiles divide the layout's
    # chunks); the block forward in pure JAX (jax), as one fused Pallas kernel (pallas:
    # Triton, GPUs) or that kernel in the Pallas interpreter (pallas_interpret: for checking).
    context_impl: str = "ring"
    context_layout: str = "zigzag"
    attention_block: int = 512
    attention_kernel: str = "jax"
    # How dropless MoE routing sends each expert device its rows: ragged
    # (jax.lax.ragged_all_to_all, GPUs), padded (a worst-case buffer per peer, any backend),
    # or auto (ragged on GPUs, padded elsewhere).
    expert_exchange: str = "auto"
    # Pipeline parallelism over mesh.stage (jaxpar.pipeline): the schedule (gpipe | 1f1b |
    # interleaved | zb-h1), run over train.microbatches microbatches, and the model chunks
    # (virtual stages) each device holds, more than 1 only for interleaved.
    pipeline_schedule: str = "1f1b"
    pipeline_chunks: int = 1
    # Rule overrides on top of the defaults, 'logical=axis+axis,...' (e.g. 'embed=fsdp').
    storage_rules: str = ""
    compute_rules: str = ""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    global_batch: int = 16
    seq_len: int = 64
    microbatches: int = 1
    seed: int = 0
    compute_dtype: str = "bfloat16"  # parameters are always stored in float32
    peak_tflops: float = 0.0  # per device, for MFU; 0: look up the device kind
    # A step whose loss or gradients hold NaN or Inf is not applied (the state stays as it
    # was); then `stop` ends the run naming the step and the first bad gradient, `skip`
    # goes on with the next batch.
    on_nonfinite: str = "stop"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  # adamw | adam | sgd | lion
    lr: float = 3e-3
    warmup_steps: int = 10
    decay_steps: int = 0  # 0: train.steps
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0  # 0: no clipping


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"  # synthetic | tokens
    path: str = ""  # tokens: a .npy or .bin file of token ids
    dtype: str = "uint16"  # tokens: element type of a .bin file
    # Packed documents: the id that ends each document in the token stream (-1: none).
    # Tokens then attend only inside their document, RoPE positions restart at each one,
    # and no token is trained to predict the next document's first token.
    eos_id: int = -1


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    # Where checkpoints go ("": none). A run whose directory holds one resumes from the
    # latest, exactly (jaxpar.train.checkpoint).
    dir: str = ""
    every: int = 0  # steps between saves; 0: only at the end of the run
    keep: int = 3  # the newest this many are kept
    async_save: bool = True  # write in the background while training goes on


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    # With several processes (jaxpar launch, SLURM, or JAXPAR_* variables; jaxpar.distributed):
    # a process silent this long is lost, and the others exit naming it.
    heartbeat_timeout_s: int = 60
    # How long the processes wait for each other to join at start-up.
    join_timeout_s: int = 300


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=LlamaConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)


# ---------------------------------------------------------------- overrides


def apply_overrides(config: Any, overrides: list[str]) -> Any:
    """Apply 'a.b.c=value' strings to a tree of frozen dataclasses, converting each value to
    the field's type. Unknown keys and unparsable values raise ConfigError."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value; e.g. --set train.steps=50")
        config = _set(config, key.strip().split("."), value.strip(), key.strip())
    return config


def _set(node: Any, path: list[str], value: str, full_key: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(node)}
    name = path[0]
    prefix = full_key[: len(full_key) - len(".".join(path))]
    if name not in fields:
        raise ConfigError(
            f"unknown key {full_key!r}: {prefix or 'the config'} has no {name!r}; valid keys: "
            + ", ".join(prefix + k for k in fields)
        )
    current = getattr(node, name)
    if len(path) > 1:
        if not dataclasses.is_dataclass(current):
            raise ConfigError(f"unknown key {full_key!r}: {prefix + name} is a value, not a section")
        return dataclasses.replace(node, **{name: _set(current, path[1:], value, full_key)})
    if dataclasses.is_dataclass(current):
        raise ConfigError(
            f"{full_key} is a section; set one of its keys: "
            + ", ".join(f"{full_key}.{f.name}" for f in dataclasses.fields(current))
        )
    hint = typing.get_type_hints(type(node))[name]
    return dataclasses.replace(node, **{name: _parse(value, hint, full_key)})


def _parse(text: str, hint: Any, key: str) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if text.lower() == "none" and len(args) < len(typing.get_args(hint)):
            return None
        hint = args[0]
    parsers = {bool: _parse_bool, int: int, float: float, str: str}
    if hint not in parsers:
        raise ConfigError(f"{key} cannot be set from the command line (type {hint})")
    try:
        return parsers[hint](text)
    except ValueError:
        example = {bool: "true", int: "2", float: "0.5"}[hint]
        raise ConfigError(f"{key}={text!r} is not a valid {hint.__name__}; e.g. {key}={example}") from None


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """{'train.steps': 100, ...}: every leaf key and its value."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(flatten(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


# ---------------------------------------------------------------- validation


def validate(config: Config, num_devices: int) -> dict[str, int]:
    """Every check that needs no compile; returns the resolved mesh axis sizes."""
    sizes = config.mesh.resolve(num_devices)
    config.model.validate()
    train, optim = config.train, config.optim
    for field in ("steps", "global_batch", "seq_len", "microbatches"):
        if getattr(train, field) < 1:
            raise ConfigError(f"train.{field}={getattr(train, field)} must be a positive integer")
    if train.on_nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"train.on_nonfinite={train.on_nonfinite!r}; use one of {', '.join(NONFINITE_POLICIES)}")
    if train.compute_dtype not in DTYPES:
        raise ConfigError(f"train.compute_dtype={train.compute_dtype!r}; use one of {', '.join(DTYPES)}")
    batch_ways = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    need = batch_ways * train.microbatches
    if train.global_batch % need:
        raise ConfigError(
            f"train.global_batch={train.global_batch} is not divisible by data x fsdp x expert x microbatches "
            f"= {sizes['data']} x {sizes['fsdp']} x {sizes['expert']} x {train.microbatches} = {need}; "
            f"use a multiple of {need}, e.g. {need * max(1, round(train.global_batch / need))}"
        )
    if config.parallel.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(
            f"parallel.zero_stage={config.parallel.zero_stage}; use 0 (replicate), 1 (shard optimizer state), "
            "2 (+ gradients) or 3 (+ parameters)"
        )
    _validate_zero_plus_plus(config.parallel, sizes)
    from jaxpar.train.optim import OPTIMIZERS

    if optim.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={optim.name!r}; use one of {', '.join(sorted(OPTIMIZERS))}")
    if config.checkpoint.every < 0:
        raise ConfigError(f"checkpoint.every={config.checkpoint.every}; use a number of steps, or 0 to save only at the end")
    if config.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep={config.checkpoint.keep}; keep at least 1 checkpoint, e.g. checkpoint.keep=3")
    for field in ("heartbeat_timeout_s", "join_timeout_s"):
        if getattr(config.distributed, field) < 1:
            raise ConfigError(f"distributed.{field}={getattr(config.distributed, field)} must be a positive number of seconds; e.g. 60")
    if config.data.source not in ("synthetic", "tokens"):
        raise ConfigError(f"data.source={config.data.source!r}; use synthetic or tokens")
    if config.data.source == "tokens" and not config.data.path:
        raise ConfigError("data.source=tokens needs data.path, a .npy or .bin file of token ids")
    eos = config.data.eos_id
    if eos != -1 and config.model.task != "lm":
        raise ConfigError(
            f"data.eos_id={eos} packs documents of a language model, but model.task={config.model.task!r}; use -1"
        )
    if eos != -1 and not 0 <= eos < config.model.vocab_size:
        raise ConfigError(
            f"data.eos_id={eos} must be a token id (0 to model.vocab_size - 1 = {config.model.vocab_size - 1}), "
            "or -1 for unpacked rows"
        )
    if isinstance(config.model, LlamaConfig):
        _validate_llama(config, sizes)
    _validate_context(config, sizes)  # after the model's checks: it divides heads by the tensor degree
    _validate_experts(config, sizes)
    _validate_pipeline(config, sizes)
    return sizes


def _validate_pipeline(config: Config, sizes: dict[str, int]) -> None:
    from jaxpar.pipeline.schedule import SCHEDULES

    parallel, p = config.parallel, sizes["stage"]
    name, v, m = parallel.pipeline_schedule, parallel.pipeline_chunks, config.train.microbatches
    if name not in SCHEDULES:
        raise ConfigError(f"parallel.pipeline_schedule={name!r}; use one of {', '.join(SCHEDULES)}")
    if v < 1:
        raise ConfigError(f"parallel.pipeline_chunks={v} must be a positive number of chunks per device; e.g. 2")
    if v > 1 and name != "interleaved":
        raise ConfigError(
            f"parallel.pipeline_chunks={v} gives each device several model chunks, which only the interleaved "
            f"schedule runs, but parallel.pipeline_schedule={name}; use pipeline_schedule=interleaved or pipeline_chunks=1"
        )
    if p == 1:
        default = ParallelConfig()
        for field in ("pipeline_schedule", "pipeline_chunks"):
            if getattr(parallel, field) != getattr(default, field):
                raise ConfigError(
                    f"parallel.{field}={getattr(parallel, field)!r} shapes a pipeline, but mesh.stage=1 runs none; "
                    f"set mesh.stage>1, or leave {field} at {getattr(default, field)!r}"
                )
        return
    model = config.model
    if type(model) is not LlamaConfig:
        raise ConfigError(
            f"mesh.stage={p} pipelines the layer stack of a Llama model, but model is {type(model).__name__} "
            "(MoE and MLP models are not cut into stages yet); use mesh.stage=1"
        )
    if model.num_layers % (p * v):
        stages = [d // v for d in divisors(model.num_layers) if d % v == 0 and d // v > 1]
        raise ConfigError(
            f"model.num_layers={model.num_layers} does not split evenly into mesh.stage x parallel.pipeline_chunks = "
            f"{p} x {v} = {p * v} chunks; use model.num_layers a multiple of {p * v}"
            + (f", or mesh.stage in {stages}" if stages else "")
        )
    if name in ("1f1b", "zb-h1") and m < p:
        raise ConfigError(
            f"parallel.pipeline_schedule={name} needs at least one microbatch per stage: train.microbatches={m} < "
            f"mesh.stage={p}; use train.microbatches>={p} (more shrinks the bubble, "
            f"{'(p-1)/(3m+p-1)' if name == 'zb-h1' else '(p-1)/(m+p-1)'})"
        )
    if name == "interleaved" and m % p:
        raise ConfigError(
            f"parallel.pipeline_schedule=interleaved sends microbatches in groups of mesh.stage={p}, but "
            f"train.microbatches={m}; use a multiple of {p}, e.g. {p * max(1, round(m / p))}"
        )
    for axis in ("context", "expert"):
        if sizes[axis] > 1:
            raise ConfigError(
                f"mesh.stage={p} with mesh.{axis}={sizes[axis]}: pipeline stages do not yet run the {axis}-parallel "
                f"kernels; use mesh.{axis}=1 (data, fsdp and tensor compose with stages)"
            )
    if parallel.zero_stage >= 2:
        raise ConfigError(
            f"parallel.zero_stage={parallel.zero_stage} with mesh.stage={p}: a pipeline stage accumulates its "
            "microbatches' gradients unreduced and reduces them over data once per step, so ZeRO-2/3 would only "
            "add traffic (DeepSpeed refuses the pair too); use zero_stage 0 or 1, and mesh.fsdp to shard "
            "parameters and gradients inside each stage"
        )
    for flag in ("quantized_weights", "quantized_gradients"):
        if getattr(parallel, flag):
            raise ConfigError(
                f"parallel.{flag}=true with mesh.stage={p}: ZeRO++ collectives are not wired into pipeline stages "
                f"yet; set parallel.{flag}=false or mesh.stage=1"
            )


def _validate_experts(config: Config, sizes: dict[str, int]) -> None:
    model, e = config.model, sizes["expert"]
    if config.parallel.expert_exchange not in EXPERT_EXCHANGES:
        raise ConfigError(
            f"parallel.expert_exchange={config.parallel.expert_exchange!r}; use one of {', '.join(EXPERT_EXCHANGES)}"
        )
    if not isinstance(model, MoEConfig):
        return  # without experts, mesh.expert is one more batch axis
    if model.num_experts % e:
        raise ConfigError(
            f"mesh.expert={e} does not divide model.num_experts={model.num_experts}; use mesh.expert in "
            f"{divisors(model.num_experts)}"
        )
    if model.routing == "capacity" and sizes["context"] > 1:
        raise ConfigError(
            f"model.routing=capacity gives each sequence its expert capacity, but mesh.context={sizes['context']} splits "
            "sequences across devices; use model.routing=dropless, or mesh.context=1"
        )


def _validate_zero_plus_plus(parallel: ParallelConfig, sizes: dict[str, int]) -> None:
    stage = parallel.zero_stage
    if parallel.hpz:
        if sizes["data"] == 1:
            raise ConfigError(
                "parallel.hpz=true is hierarchical ZeRO but mesh.data=1 leaves no across-host degree; "
                "set mesh.data to the number of hosts (e.g. mesh.data=2) and mesh.fsdp to the devices per host"
            )
        if sizes["fsdp"] == 1:
            raise ConfigError(
                "parallel.hpz=true needs an in-host shard for the secondary copy but mesh.fsdp=1; "
                "set mesh.fsdp to the devices per host (e.g. mesh.fsdp=4)"
            )
        if stage != 3:
            raise ConfigError(
                f"parallel.hpz=true needs parallel.zero_stage=3 (parameters sharded across hosts), got {stage}; "
                "below stage 3 parameters already rest inside the host (hybrid sharding)"
            )
    if parallel.quantized_weights and sizes["fsdp"] == 1 and not (stage == 3 and sizes["data"] > 1):
        raise ConfigError(
            "parallel.quantized_weights=true quantizes parameter all-gathers, but with mesh.fsdp=1 and "
            f"zero_stage={stage} parameters are not sharded; set mesh.fsdp>1 or parallel.zero_stage=3 with mesh.data>1"
        )
    if parallel.quantized_gradients and (sizes["data"] == 1 or stage == 0):
        raise ConfigError(
            f"parallel.quantized_gradients=true quantizes the gradient reduce-scatter over mesh.data, but "
            f"mesh.data={sizes['data']} and zero_stage={stage}; use mesh.data>1 and parallel.zero_stage>=1 "
            "(so the data axis shards the reduced gradient)"
        )
    if parallel.quantization_block < 1:
        raise ConfigError(
            f"parallel.quantization_block={parallel.quantization_block} must be a positive number of elements "
            "per scale; e.g. 256"
        )


def _validate_context(config: Config, sizes: dict[str, int]) -> None:
    from jaxpar.kernels.attention import ATTENTION_KERNELS, CONTEXT_IMPLS, SEQUENCE_LAYOUTS

    parallel = config.parallel
    if parallel.context_impl not in CONTEXT_IMPLS:
        raise ConfigError(f"parallel.context_impl={parallel.context_impl!r}; use one of {', '.join(CONTEXT_IMPLS)}")
    if parallel.context_layout not in SEQUENCE_LAYOUTS:
        raise ConfigError(
            f"parallel.context_layout={parallel.context_layout!r}; use one of {', '.join(SEQUENCE_LAYOUTS)}"
        )
    if parallel.attention_block < 1:
        raise ConfigError(f"parallel.attention_block={parallel.attention_block} must be a positive tile length; e.g. 512")
    if parallel.attention_kernel not in ATTENTION_KERNELS:
        raise ConfigError(
            f"parallel.attention_kernel={parallel.attention_kernel!r}; use one of {', '.join(ATTENTION_KERNELS)}"
        )
    c = sizes["context"]
    if parallel.attention_kernel != "jax" and c == 1:
        raise ConfigError(
            f"parallel.attention_kernel={parallel.attention_kernel} is the block kernel of context-parallel attention, "
            "but mesh.context=1 runs plain attention; set mesh.context>1 or parallel.attention_kernel=jax"
        )
    if c > 1 and not isinstance(config.model, LlamaConfig):
        raise ConfigError(
            f"mesh.context={c} shards the sequence, but model {type(config.model).__name__} has none; use mesh.context=1"
        )
    if c > 1 and parallel.context_layout == "zigzag" and config.train.seq_len % (2 * c):
        raise ConfigError(
            f"train.seq_len={config.train.seq_len} is not divisible by 2 x mesh.context = {2 * c} (the zigzag layout "
            f"gives each device two chunks); use a multiple of {2 * c} or parallel.context_layout=contiguous"
        )
    if c > 1:
        _validate_tiles(config, c)
    if c > 1 and parallel.context_impl == "ulysses":
        kv_local = config.model.num_kv_heads // sizes["tensor"]
        if kv_local % c:
            raise ConfigError(
                f"parallel.context_impl=ulysses: mesh.context={c} does not divide the {kv_local} kv heads per tensor "
                f"shard (model.num_kv_heads={config.model.num_kv_heads} / mesh.tensor={sizes['tensor']}); use "
                f"mesh.context in {divisors(kv_local)}, or context_impl=ring or allgather"
            )


def _validate_tiles(config: Config, c: int) -> None:
    """The attention tiles must divide the chunks the sequence layout deals out, so a chunk
    whose length has no divisor near attention_block would silently run tiny tiles."""
    from jaxpar.kernels.attention.blocks import tile
    from jaxpar.kernels.attention.order import chunk_length
    from jaxpar.kernels.attention.pallas import shape_problem, triton_tile

    parallel, s = config.parallel, config.train.seq_len
    chunk = chunk_length(parallel.context_layout, c, s)
    block = parallel.attention_block
    used = tile(chunk, block)
    if used < min(block, chunk) // 4:
        per = s // chunk
        unit = per * (1 << (block.bit_length() - 1))  # chunks a multiple of a power of two <= block
        raise ConfigError(
            f"parallel.attention_block={block}: the {chunk}-token chunks of train.seq_len={s} over {per} "
            f"({parallel.context_layout} over mesh.context={c}) split only into tiles of {used}; use a train.seq_len "
            f"that is a multiple of {unit}, e.g. {max(unit, s // unit * unit)}"
        )
    if parallel.attention_kernel == "pallas":
        problem = shape_problem(config.model.head_dim, triton_tile(used), triton_tile(used))
        if problem:
            raise ConfigError(
                f"parallel.attention_kernel=pallas (Triton) needs {problem} (model.head_dim={config.model.head_dim}, "
                f"tiles from parallel.attention_block={block} and {chunk}-token chunks); use attention_kernel=jax"
            )


def _validate_llama(config: Config, sizes: dict[str, int]) -> None:
    model, t = config.model, sizes["tensor"]
    for field in ("num_heads", "num_kv_heads", "vocab_size", "mlp"):
        value = getattr(model, field)
        if value % t:
            ok = divisors(value)
            raise ConfigError(
                f"mesh.tensor={t} does not divide model.{field}={value}; use mesh.tensor in {ok}"
            )
    if model.embed % sizes["fsdp"]:
        raise ConfigError(
            f"mesh.fsdp={sizes['fsdp']} does not divide model.embed={model.embed}; "
            f"use mesh.fsdp in {divisors(model.embed)}"
        )
    seq_ways = sizes["context"] * (t if config.parallel.sequence_parallel else 1)
    if config.train.seq_len % seq_ways:
        raise ConfigError(
            f"train.seq_len={config.train.seq_len} is not divisible by context x tensor = {seq_ways} "
            f"(sequence parallelism shards the sequence); use a multiple of {seq_ways}"
        )
