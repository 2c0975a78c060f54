"""Typed run configuration and dotted overrides. The checks that run before compile are the
catalogue in jaxpar.checks (`jaxpar.checks.validate`), which reads these classes; this module
imports nothing of it. A choice field's type is a Literal of jaxpar.choices, which holds its
allowed values."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from jaxpar.choices import (CompilerPreset, ComputeDtype, DataOrder, DataSource, LoraBaseDtype, MatmulDtype, MuonScale,
                            OnNonfinite, Optimizer, check_choice)
from jaxpar.errors import ConfigError, did_you_mean
from jaxpar.mesh import MeshConfig
from jaxpar.model import ModelConfig
# parallel's sections are re-exported: a recipe imports them with the rest of the config
from jaxpar.specs import (RENAMED_KEYS, CompressionConfig, ContextConfig, ParallelConfig,  # noqa: F401
                          PipelineConfig, RulesConfig, TensorConfig, ZeroConfig)


def default_model() -> ModelConfig:
    """A tiny Llama, the shipped example (imported here, lazily: the models import jaxpar)."""
    from jaxpar.models.llama import LlamaConfig

    return LlamaConfig()


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # optimizer steps the run ends at (a resumed run counts the steps before it too)
    global_batch: int = 16  # sequences (or examples) per step, over all devices
    seq_len: int = 64  # tokens per sequence
    microbatches: int = 1  # gradient accumulation: each step's batch in this many pieces, one after another
    seed: int = 0  # parameters' initialisation and the data's order
    compute_dtype: ComputeDtype = "bfloat16"  # activations' and matmuls'; parameters are always stored in float32
    # compute: matmuls in compute_dtype. fp8: the projections that go through jaxpar's
    # helpers (jaxpar.sharding.projections) multiply in float8, e4m3 forward and e5m2 for
    # gradients, each tensor scaled by its current amax (jaxpar.kernels.fp8); master
    # weights, optimizer state and everything else unchanged.
    matmul_dtype: MatmulDtype = "compute"
    # FP8 experts (train.matmul_dtype=fp8, a model whose experts multiply through
    # jaxpar.sharding.expert_matmul): each operand scaled in tiles of this many along the
    # contraction, 1 x b for activations and b x b for weights (DeepSeek-V3's 128;
    # jaxpar.kernels.experts.fp8). 0: one scale per row and column over the whole
    # contraction, one GEMM a product, the form XLA runs fastest on Hopper.
    fp8_expert_block: int = 128
    # The built-in language-model loss in this many groups of tokens, one group's logits
    # alive at a time (jaxpar.step.loss.chunked_cross_entropy_sum): the [tokens, vocab]
    # float32 logits and their gradient shrink by this factor. 1: all logits at once.
    loss_chunks: int = 1
    peak_tflops: float = 0.0  # per device, for MFU; 0: look up the device kind
    # One plain line every log_every steps (and after the last) where no progress bar
    # shows: output that is not a terminal (SLURM, nohup, a pipe) or --no-progress. 0: none.
    log_every: int = 10
    # A step whose loss or gradients hold NaN or Inf is not applied (the state stays as it
    # was); then `stop` ends the run naming the step and the first bad gradient, `skip`
    # goes on with the next batch.
    on_nonfinite: OnNonfinite = "stop"
    # Every eval_every steps (0: never) and after the last one, the loss on eval_batches
    # held-out global batches, never trained on (jaxpar.data.heldout): `eval_loss` in the
    # progress bar and the metrics.
    eval_every: int = 0
    # DPO's beta on data.source=preference (jaxpar.step.preference): how far the policy's
    # log-ratios to the reference are scaled before the sigmoid.
    dpo_beta: float = 0.1
    eval_batches: int = 4  # held-out global batches each evaluation's loss is taken over (eval_every)
    # "START:STOP": a jax.profiler trace of steps START+1..STOP (as the log lines number them:
    # the steps after START are done) into profile_dir, for TensorBoard's profile plugin or
    # Perfetto (jaxpar.loop.profile). "": none.
    profile_steps: str = ""
    profile_dir: str = "runs/profile"  # the folder profile_steps' trace is written to


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: Optimizer = "adamw"  # the update rule (jaxpar.step.optim)
    lr: float = 3e-3  # peak learning rate, reached after warmup_steps
    warmup_steps: int = 10  # linear warm-up from 0
    decay_steps: int = 0  # steps (warm-up included) of the cosine decay to min_lr_ratio x lr; 0: train.steps
    min_lr_ratio: float = 0.1  # the decayed learning rate as a share of lr
    b1: float = 0.9  # Adam's first-moment decay
    b2: float = 0.95  # Adam's second-moment decay
    eps: float = 1e-8  # Adam's denominator floor
    weight_decay: float = 0.1  # decoupled (adamw, lion), on every parameter
    clip_norm: float = 1.0  # the gradients' global norm is clipped to this; 0: no clipping
    # Muon (name=muon, jaxpar.step.muon; what is not a matrix takes AdamW: b1, b2, eps):
    momentum: float = 0.95  # Muon: the matrices' momentum
    nesterov: bool = True  # Muon: the update reads the gradient plus momentum x the momentum (Nesterov)
    ns_steps: int = 5  # Muon: Newton-Schulz iterations
    ns_coeffs: str = "3.4445,-4.7750,2.0315"  # Muon: the quintic iteration's coefficients "a,b,c"
    # Muon: what the iteration multiplies in and its pieces travel in: float32, or bfloat16
    # (Keller Jordan's and Moonlight's; half the FLOP time and bytes on a GPU)
    ns_dtype: ComputeDtype = "float32"
    # Muon: how an orthogonalised update is scaled by its shape: "rms" (muon_rms x
    # sqrt(max(rows, cols)), Moonlight's: AdamW's learning rate fits) or "shape"
    # (sqrt(max(1, cols / rows)), Keller Jordan's)
    muon_scale: MuonScale = "rms"
    muon_rms: float = 0.2  # Muon: the update's RMS under muon_scale=rms (0.2: AdamW's, per Moonlight)
    # QK-clip (Kimi K2's MuonClip, with any optimizer; jaxpar.step.update): after each step the
    # query and key weights of every head whose largest attention logit passed this are scaled
    # back so that it would have been this; 0: off. K2 used 100.
    qk_clip: float = 0.0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # where batches come from: synthetic (drawn from seed and step), tokens, text or chat (path),
    # or mix (several of them by weight: data.mix)
    source: DataSource = "synthetic"
    # tokens: a .npy or .bin file of token ids; text: a .txt, .jsonl or .parquet file, a
    # folder of them, or a glob (jaxpar.data.text), tokenized with data.tokenizer; chat:
    # .jsonl or .parquet conversations (jaxpar.data.chat), rendered with the chat template.
    path: str = ""
    dtype: str = "uint16"  # tokens: element type of a .bin file
    tokenizer: str = ""  # text: a Hugging Face tokenizer.json
    text_field: str = "text"  # text: the JSONL key or Parquet column that holds each document
    # chat: the key of each record's conversation ([{"role", "content"}, ...]); records with
    # "prompt" and "completion" instead are trained on the completion.
    messages_field: str = "messages"
    # chat: the template's file (a .jinja, or a tokenizer_config.json); "": the tokenizer's own,
    # chat_template.jinja or tokenizer_config.json beside data.tokenizer.
    chat_template: str = ""
    # tokens and text: how rows are drawn from the token stream. windows: seq_len + 1 tokens
    # at random positions drawn from (seed, step); epochs: the stream cut into consecutive
    # rows, every row once per epoch, in an order shuffled from (seed, epoch).
    order: DataOrder = "windows"
    # Packed documents: the id that ends each document in the token stream (-1: none).
    # Tokens then attend only inside their document, RoPE positions restart at each one,
    # and no token is trained to predict the next document's first token.
    eos_id: int = -1
    # text: the id put before each document (-1: none), as the model's tokenizer adds it
    # (Gemma's and Llama 3's <bos>; Qwen has none): the recipe hf:FOLDER reads it from the
    # tokenizer, and `jaxpar sample` puts it before the prompt too.
    bos_id: int = -1
    # tokens: the last eval_fraction of the file is held out (0 < f < 1): training windows
    # are drawn only from the rest, held-out batches only from it (jaxpar.data.heldout).
    # 0: the whole file trains. Synthetic sources hold out a random stream of their own.
    eval_fraction: float = 0.0
    # text: processes that tokenize the corpus when the run starts, a chunk of documents each
    # at a time, in order (0: this process; jaxpar.data.tokenized)
    workers: int = 0
    # text: a folder where the tokenized corpus is written (a .npy and a side file) and read
    # memory-mapped, found again by the next run of the same files and tokenizer ("": held in
    # memory, tokenized by every run)
    cache: str = ""
    # mix: "WEIGHT KIND:PATH, ..." e.g. "0.7 text:web/*.txt, 0.3 tokens:code.bin" (kinds: tokens,
    # text, chat, synthetic), each source read with the fields above (jaxpar.data.mixing)
    mix: str = ""
    # mix: changes of the weights, "; "-separated: "STEP=w,w,..." from that step on, "anneal
    # N=w,w,..." linearly to these over the run's last N steps ("": data.mix's throughout)
    mix_schedule: str = ""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    # Where checkpoints go ("": none). A run whose directory holds one resumes from the
    # latest, exactly (jaxpar.loop.checkpoint).
    dir: str = ""
    # Steps between saves (0: only at the end). With a dir, at most this many steps are
    # lost to a crash; saves are asynchronous, so their cost is the device-to-host copy.
    # Ctrl-C and SIGTERM save at the next step whatever this is (jaxpar.loop.stop).
    every: int = 100
    keep: int = 3  # the newest this many are kept
    async_save: bool = True  # write in the background while training goes on
    # A Hugging Face checkpoint folder (config.json and *.safetensors) whose weights the run
    # starts from when checkpoint.dir holds no checkpoint (jaxpar.hf): each process reads
    # only the slices its devices hold.
    init_from: str = ""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    # With several processes (jaxpar launch, SLURM, or JAXPAR_* variables; jaxpar.distributed):
    # a process silent this long is lost, and the others exit naming it.
    heartbeat_timeout_s: int = 60
    # How long the processes wait for each other to join at start-up.
    join_timeout_s: int = 300


@dataclasses.dataclass(frozen=True)
class CompilerConfig:
    # XLA options for the train step (jaxpar.xla_options): overlap (communication hidden
    # behind computation: the latency-hiding scheduler and its companions), none, or auto
    # (overlap on GPUs, none elsewhere).
    preset: CompilerPreset = "auto"
    # XLA options on top of the preset, 'name=value,...' (e.g.
    # 'xla_gpu_enable_latency_hiding_scheduler=false'); each is checked against the jaxlib.
    options: str = ""
    # A scan's stacked outputs (a layer loop's saved activations, its stacked weight
    # gradients) allocated without the zero fill jax gives them (jaxpar.scan_stacks): each
    # slot is written before it is read. One device only; only a GPU's program changes;
    # process-wide, set by each build.
    uninitialised_stacks: bool = False


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    # Low-rank adapters (jaxpar.step.lora): rank > 0 freezes the targeted weights in the
    # compute dtype (no gradient, master copy or optimizer state) and trains A [in, rank] and
    # B [rank, out] beside each, added as (alpha / rank) * A @ B; 0: no adapters.
    rank: int = 0
    alpha: float = 16.0  # the adapters' scale: each adds (alpha / rank) * A @ B
    # Comma-separated patterns (fnmatch) over parameter paths, e.g. '*.wq,*.wv'; a weight
    # that matches is adapted. '': every projection, i.e. each weight of two or more
    # dimensions, all named, with the residual axis ('embed') first or last; vocabulary
    # tables, routers (an unnamed side) and expert weights left out.
    targets: str = ""
    # A PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) whose A and B
    # the run starts from instead of drawing them; its base is checkpoint.init_from
    # (jaxpar.hf.peft). Its r and lora_alpha must be lora.rank and lora.alpha.
    init_from: str = ""
    # How the adapted weights rest: compute (train.compute_dtype) or fp8 (e4m3 with a scale
    # per input row: 1 byte a weight, dequantized where it is used; QLoRA's idea).
    base_dtype: LoraBaseDtype = "compute"


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=default_model)  # any jaxpar.model.ModelConfig
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    compiler: CompilerConfig = dataclasses.field(default_factory=CompilerConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)


# ---------------------------------------------------------------- overrides


def apply_overrides(config: Any, overrides: list[str]) -> Any:
    """Apply 'a.b.c=value' strings to a tree of frozen dataclasses, converting each value to
    the field's type. Unknown keys, unparsable values and a choice field's value outside its
    Literal raise ConfigError; one read from a --config file names the file."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value; e.g. --set train.steps=50")
        key = RENAMED_KEYS.get(key.strip(), key.strip())
        try:
            config = _set(config, key.split("."), value.strip(), key)
        except ConfigError as e:
            file = getattr(item, "file", None)  # read from a --config file (jaxpar.config_text.FileOverride)
            if file is None:
                raise
            hint = "" if "did you mean" in str(e) else did_you_mean(key, flatten(config))
            raise ConfigError(f"--config {file}: {e}{hint}") from None
    return config


def _set(node: Any, path: list[str], value: str, full_key: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(node)}
    name = path[0]
    prefix = full_key[: len(full_key) - len(".".join(path))]
    if name not in fields:
        raise ConfigError(
            f"unknown key {full_key!r}: {prefix[:-1] if prefix else 'the config'} has no {name!r}"
            f"{did_you_mean(name, fields, prefix + '{}')}; valid keys: "
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
    if typing.get_origin(hint) is Literal:
        return _parse_choice(text, typing.get_args(hint), key)
    parsers = {bool: _parse_bool, int: int, float: float, str: str}
    if hint not in parsers:
        raise ConfigError(f"{key} cannot be set from the command line (type {hint})")
    try:
        return parsers[hint](text)
    except ValueError:
        example = {bool: "true", int: "2", float: "0.5"}[hint]
        raise ConfigError(f"{key}={text!r} is not a valid {hint.__name__}; e.g. {key}={example}") from None


def _parse_choice(text: str, allowed: tuple, key: str) -> Any:
    """A choice as its Literal's type (parallel.zero.stage=2 is the int 2), refused with the
    catalogue's message (jaxpar.choices.check_choice) unless allowed."""
    try:
        value = _parse(text, type(allowed[0]), key)
    except ConfigError:  # not even of the right type: refused below, as typed
        value = text
    check_choice(key, value, allowed)
    return value


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def with_overrides(config: Any, overrides: list[str], num_devices: int) -> Any:
    """A recipe's or a checkpoint's config with `--set` overrides, as the CLI applies them:
    its mesh is the layout it was written for, so naming any mesh.* axis replaces it (unnamed
    axes 1, data filling with -1), and on a single device every layout collapses to the
    single-device run."""
    if num_devices == 1 or any(o.startswith("mesh.") for o in overrides):
        config = dataclasses.replace(config, mesh=MeshConfig(hosts=config.mesh.hosts))
    return apply_overrides(config, overrides)


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


def parse_steps(spec: str) -> tuple[int, int] | None:
    """train.profile_steps: "START:STOP" -> (START, STOP); "" -> None. ConfigError on anything else."""
    if not spec:
        return None
    start, sep, stop = spec.partition(":")
    try:
        window = int(start), int(stop)
    except ValueError:
        window = None
    if not sep or window is None or not 0 <= window[0] < window[1]:
        raise ConfigError(f"train.profile_steps={spec!r}; give START:STOP with 0 <= START < STOP, e.g. 5:8 to trace "
                          "steps 6, 7 and 8 (the steps after 5 are done), or leave it empty")
    return window
