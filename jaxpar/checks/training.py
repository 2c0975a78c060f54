"""The run itself: train, ZeRO and ZeRO++, optim, checkpoint, distributed and data."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError

RULES: list[Rule] = []
rule = collector(RULES)

DTYPES = ("float32", "bfloat16")
NONFINITE_POLICIES = ("stop", "skip")
TRAIN_COUNTS = ("steps", "global_batch", "seq_len", "microbatches")
TIMEOUTS = ("heartbeat_timeout_s", "join_timeout_s")
# data.source -> what its data.path names, for those that read one
FILE_SOURCES = {
    "tokens": "a .npy or .bin file of token ids",
    "text": "a .txt, .jsonl or .parquet file, a folder of them, or a glob",
}
SOURCES = ("synthetic", *FILE_SOURCES)


@rule(
    "train-counts-positive",
    fields=[f"train.{f}" for f in TRAIN_COUNTS],
    summary="Steps, global batch, sequence length and microbatches are positive integers.",
    example=["train.steps=0"],
)
def train_counts_positive(config, sizes) -> None:
    for field in TRAIN_COUNTS:
        if getattr(config.train, field) < 1:
            raise ConfigError(f"train.{field}={getattr(config.train, field)} must be a positive integer")


@rule(
    "train-seed-and-peak",
    fields=["train.seed", "train.peak_tflops"],
    summary="The seed is a non-negative integer; train.peak_tflops is 0 (look the device up) or positive.",
    example=["train.seed=-1"],
    also=[["train.peak_tflops=-1"]],
)
def train_seed_and_peak(config, sizes) -> None:
    if config.train.seed < 0:  # numpy's generators, which draw the data, take none below 0
        raise ConfigError(f"train.seed={config.train.seed} must be 0 or more")
    if not 0 <= config.train.peak_tflops < float("inf"):
        raise ConfigError(f"train.peak_tflops={config.train.peak_tflops} must be 0 (look up the device kind) or a "
                          "positive TFLOP/s per device, e.g. 989 for an H100's bf16")


@rule(
    "profile-steps",
    fields=["train.profile_steps", "train.steps"],
    summary="train.profile_steps is empty or START:STOP with 0 <= START < STOP <= train.steps (steps counted "
    "from 0).",
    example=["train.profile_steps=8:5"],
    also=[["train.profile_steps=5"], ["train.steps=10", "train.profile_steps=5:20"]],
)
def profile_steps(config, sizes) -> None:
    from jaxpar.train.profile import parse_steps

    window = parse_steps(config.train.profile_steps)
    if window is not None and window[1] > config.train.steps:
        raise ConfigError(f"train.profile_steps={config.train.profile_steps} ends after the run's last step "
                          f"(train.steps={config.train.steps}); use STOP <= {config.train.steps}")


@rule(
    "on-nonfinite-policy",
    fields=["train.on_nonfinite"],
    summary="A step with NaN or Inf either stops the run or is skipped.",
    example=["train.on_nonfinite=ignore"],
)
def on_nonfinite_policy(config, sizes) -> None:
    value = config.train.on_nonfinite
    if value not in NONFINITE_POLICIES:
        raise ConfigError(f"train.on_nonfinite={value!r}; use one of {', '.join(NONFINITE_POLICIES)}")


@rule(
    "on-replicated-policy",
    fields=["parallel.on_replicated"],
    summary="A parameter the rules leave whole on every device is warned about, refused, or allowed.",
    example=["parallel.on_replicated=loud"],
)
def on_replicated_policy(config, sizes) -> None:
    from jaxpar.sharding.replicated import check_policy

    check_policy(config.parallel.on_replicated)


@rule(
    "compute-dtype",
    fields=["train.compute_dtype"],
    summary="Compute runs in float32 or bfloat16 (parameters are always stored in float32).",
    example=["train.compute_dtype=float16"],
)
def compute_dtype(config, sizes) -> None:
    if config.train.compute_dtype not in DTYPES:
        raise ConfigError(f"train.compute_dtype={config.train.compute_dtype!r}; use one of {', '.join(DTYPES)}")


@rule(
    "batch-divides-data-ways",
    fields=["train.global_batch", "train.microbatches", "mesh.data", "mesh.fsdp", "mesh.expert"],
    summary="Every microbatch splits evenly over the batch axes: data x fsdp x expert x microbatches divides "
    "the global batch.",
    example=["train.global_batch=12"],
)
def batch_divides_data_ways(config, sizes) -> None:
    train = config.train
    need = sizes["data"] * sizes["fsdp"] * sizes["expert"] * train.microbatches
    if train.global_batch % need:
        raise ConfigError(
            f"train.global_batch={train.global_batch} is not divisible by data x fsdp x expert x microbatches "
            f"= {sizes['data']} x {sizes['fsdp']} x {sizes['expert']} x {train.microbatches} = {need}; "
            f"use a multiple of {need}, e.g. {need * max(1, round(train.global_batch / need))}"
        )


@rule(
    "zero-stage",
    fields=["parallel.zero_stage"],
    summary="The ZeRO stage is 0, 1, 2 or 3.",
    example=["parallel.zero_stage=4"],
)
def zero_stage(config, sizes) -> None:
    if config.parallel.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(
            f"parallel.zero_stage={config.parallel.zero_stage}; use 0 (replicate), 1 (shard optimizer state), "
            "2 (+ gradients) or 3 (+ parameters)"
        )


@rule(
    "hpz-needs-data-axis",
    fields=["parallel.hpz", "mesh.data"],
    summary="Hierarchical ZeRO (hpZ) needs an across-host degree, mesh.data > 1.",
    example=["parallel.hpz=true", "mesh.data=1", "mesh.fsdp=8"],
)
def hpz_needs_data_axis(config, sizes) -> None:
    if config.parallel.hpz and sizes["data"] == 1:
        raise ConfigError(
            "parallel.hpz=true is hierarchical ZeRO but mesh.data=1 leaves no across-host degree; "
            "set mesh.data to the number of hosts (e.g. mesh.data=2) and mesh.fsdp to the devices per host"
        )


@rule(
    "hpz-needs-fsdp-axis",
    fields=["parallel.hpz", "mesh.fsdp"],
    summary="hpZ keeps its secondary parameter copy sharded inside the host, on mesh.fsdp > 1.",
    example=["parallel.hpz=true"],
)
def hpz_needs_fsdp_axis(config, sizes) -> None:
    if config.parallel.hpz and sizes["fsdp"] == 1:
        raise ConfigError(
            "parallel.hpz=true needs an in-host shard for the secondary copy but mesh.fsdp=1; "
            "set mesh.fsdp to the devices per host (e.g. mesh.fsdp=4)"
        )


@rule(
    "hpz-needs-zero-3",
    fields=["parallel.hpz", "parallel.zero_stage"],
    summary="hpZ only changes ZeRO-3, where parameters are sharded across hosts.",
    example=["parallel.hpz=true", "mesh.data=2", "mesh.fsdp=4"],
)
def hpz_needs_zero_3(config, sizes) -> None:
    stage = config.parallel.zero_stage
    if config.parallel.hpz and stage != 3:
        raise ConfigError(
            f"parallel.hpz=true needs parallel.zero_stage=3 (parameters sharded across hosts), got {stage}; "
            "below stage 3 parameters already rest inside the host (hybrid sharding)"
        )


@rule(
    "quantized-weights-need-sharded-params",
    fields=["parallel.quantized_weights", "mesh.fsdp", "parallel.zero_stage", "mesh.data"],
    summary="qwZ quantizes parameter all-gathers, so parameters must be sharded: mesh.fsdp > 1, or ZeRO-3 over "
    "mesh.data > 1.",
    example=["parallel.quantized_weights=true"],
)
def quantized_weights_need_sharded_params(config, sizes) -> None:
    parallel, stage = config.parallel, config.parallel.zero_stage
    if parallel.quantized_weights and sizes["fsdp"] == 1 and not (stage == 3 and sizes["data"] > 1):
        raise ConfigError(
            "parallel.quantized_weights=true quantizes parameter all-gathers, but with mesh.fsdp=1 and "
            f"zero_stage={stage} parameters are not sharded; set mesh.fsdp>1 or parallel.zero_stage=3 with mesh.data>1"
        )


@rule(
    "quantized-gradients-need-data-sharding",
    fields=["parallel.quantized_gradients", "parallel.gradient_compression", "mesh.data", "parallel.zero_stage"],
    summary="qgZ (parallel.quantized_gradients, or gradient_compression=int8) quantizes the gradient reduce-scatter "
    "over mesh.data, so it needs mesh.data > 1 and ZeRO >= 1.",
    example=["parallel.quantized_gradients=true"],
    also=[["parallel.gradient_compression=int8"]],
)
def quantized_gradients_need_data_sharding(config, sizes) -> None:
    stage = config.parallel.zero_stage
    if config.parallel.int8_gradients and (sizes["data"] == 1 or stage == 0):
        named = ("parallel.quantized_gradients=true" if config.parallel.quantized_gradients
                 else "parallel.gradient_compression=int8")
        raise ConfigError(
            f"{named} quantizes the gradient reduce-scatter over mesh.data, but "
            f"mesh.data={sizes['data']} and zero_stage={stage}; use mesh.data>1 and parallel.zero_stage>=1 "
            "(so the data axis shards the reduced gradient)"
        )


GRADIENT_COMPRESSION = ("none", "int8", "powersgd", "topk")


@rule(
    "gradient-compression",
    fields=["parallel.gradient_compression", "parallel.powersgd_rank", "parallel.topk_fraction",
            "parallel.quantized_gradients", "mesh.hosts", "mesh.data"],
    summary="parallel.gradient_compression is none, int8, powersgd or topk; powersgd and topk compress the "
    "reduction over mesh.data across hosts, so they need every data replica on its own host "
    "(mesh.hosts.data = mesh.data > 1), a rank >= 1, a fraction in (0, 1].",
    example=["parallel.gradient_compression=lossy"],
    also=[["parallel.gradient_compression=topk", "parallel.topk_fraction=0", "mesh.data=2", "mesh.hosts.data=2",
           "mesh.fsdp=4"],
          ["parallel.gradient_compression=powersgd", "parallel.powersgd_rank=0", "mesh.data=2", "mesh.hosts.data=2",
           "mesh.fsdp=4"],
          ["parallel.gradient_compression=powersgd", "mesh.data=2", "mesh.fsdp=4"],
          ["parallel.gradient_compression=topk", "mesh.data=4", "mesh.hosts.data=2", "mesh.fsdp=2"],
          ["parallel.gradient_compression=topk", "parallel.quantized_gradients=true", "mesh.data=2",
           "mesh.hosts.data=2", "mesh.fsdp=4", "parallel.zero_stage=1"]],
)
def gradient_compression(config, sizes) -> None:
    parallel, method = config.parallel, config.parallel.gradient_compression
    if method not in GRADIENT_COMPRESSION:
        raise ConfigError(f"parallel.gradient_compression={method!r}; use one of {', '.join(GRADIENT_COMPRESSION)}")
    if method in ("none", "int8"):
        return
    if method == "topk" and not 0 < parallel.topk_fraction <= 1:
        raise ConfigError(f"parallel.topk_fraction={parallel.topk_fraction}: the share of each gradient block "
                          "sent; use 0 < fraction <= 1 (e.g. 0.01)")
    if method == "powersgd" and parallel.powersgd_rank < 1:
        raise ConfigError(f"parallel.powersgd_rank={parallel.powersgd_rank}; use a rank >= 1 (e.g. 4)")
    data, across = sizes["data"], config.mesh.hosts.data
    if across < 2:
        raise ConfigError(
            f"parallel.gradient_compression={method} compresses the reduction over mesh.data across hosts, but "
            f"mesh.hosts.data={across} puts no data replicas on other hosts; set mesh.data and mesh.hosts.data to the "
            "number of hosts (e.g. mesh.data=2 mesh.hosts.data=2) and mesh.fsdp to the devices per host"
        )
    if data != across:
        raise ConfigError(
            f"parallel.gradient_compression={method} with mesh.data={data} and mesh.hosts.data={across}: "
            f"{data // across} data replicas share each host, and compression would cover their in-host reduction "
            f"too; set mesh.data={across} and put the in-host degree on mesh.fsdp (x{data // across}), where it stays exact"
        )
    if parallel.quantized_gradients:
        raise ConfigError(f"parallel.quantized_gradients=true with parallel.gradient_compression={method}: one "
                          "compressor per reduction; set parallel.quantized_gradients=false, or "
                          "parallel.gradient_compression=int8 (the same qgZ)")


@rule(
    "quantization-block-positive",
    fields=["parallel.quantization_block"],
    summary="Each int8 scale covers a positive number of elements.",
    example=["parallel.quantization_block=0"],
)
def quantization_block_positive(config, sizes) -> None:
    block = config.parallel.quantization_block
    if block < 1:
        raise ConfigError(
            f"parallel.quantization_block={block} must be a positive number of elements per scale; e.g. 256"
        )


@rule(
    "optimizer-name",
    fields=["optim.name"],
    summary="optim.name names one of the optimizers of jaxpar.train.optim.",
    example=["optim.name=adagrad"],
)
def optimizer_name(config, sizes) -> None:
    from jaxpar.train.optim import OPTIMIZERS  # lazily: it imports optax

    if config.optim.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={config.optim.name!r}; use one of {', '.join(sorted(OPTIMIZERS))}")


# optim field -> (what holds, as a test of the value; what to say)
OPTIM_RANGES = {
    "lr": (lambda x: 0 < x < float("inf"), "a positive learning rate, e.g. 3e-4"),
    "warmup_steps": (lambda x: x >= 0, ">= 0 (0: no warm-up)"),
    "decay_steps": (lambda x: x >= 0, ">= 0 (0: decay over train.steps)"),
    "min_lr_ratio": (lambda x: 0 <= x <= 1, "between 0 and 1 (the final learning rate over the peak)"),
    "b1": (lambda x: 0 <= x < 1, "in [0, 1), e.g. 0.9"),
    "b2": (lambda x: 0 <= x < 1, "in [0, 1), e.g. 0.95"),
    "eps": (lambda x: 0 < x < float("inf"), "> 0, e.g. 1e-8"),
    "weight_decay": (lambda x: x >= 0, ">= 0 (0: none)"),
    "clip_norm": (lambda x: x >= 0, ">= 0 (0: no clipping)"),
}


@rule(
    "optimizer-values",
    fields=[f"optim.{f}" for f in OPTIM_RANGES],
    summary="The optimizer's numbers make sense: a positive learning rate, non-negative steps, decay and clipping, "
    "betas in [0, 1), a positive eps, a final learning-rate ratio in [0, 1].",
    example=["optim.lr=-1"],
    also=[["optim.lr=0"], ["optim.b2=1"], ["optim.warmup_steps=-5"], ["optim.min_lr_ratio=2"]],
)
def optimizer_values(config, sizes) -> None:
    for field, (holds, what) in OPTIM_RANGES.items():
        value = getattr(config.optim, field)
        if not holds(value):
            raise ConfigError(f"optim.{field}={value} makes no sense; use {what}")


@rule(
    "checkpoint-every",
    fields=["checkpoint.every"],
    summary="Checkpoints are saved every so many steps, or (0) only at the end.",
    example=["checkpoint.every=-1"],
)
def checkpoint_every(config, sizes) -> None:
    if config.checkpoint.every < 0:
        raise ConfigError(f"checkpoint.every={config.checkpoint.every}; use a number of steps, or 0 to save only at the end")


@rule(
    "checkpoint-keep",
    fields=["checkpoint.keep"],
    summary="At least the newest checkpoint is kept.",
    example=["checkpoint.keep=0"],
)
def checkpoint_keep(config, sizes) -> None:
    if config.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep={config.checkpoint.keep}; keep at least 1 checkpoint, e.g. checkpoint.keep=3")


@rule(
    "init-from-needs-hf-format",
    fields=["checkpoint.init_from", "model"],
    summary="Starting from a Hugging Face checkpoint needs a model that declares Hugging Face's format (jaxpar.hf).",
    example=["checkpoint.init_from=checkpoints/llama"],
    base="mlp",
)
def init_from_needs_hf_format(config, sizes) -> None:
    if config.checkpoint.init_from:
        from jaxpar.hf.load import check_format

        try:
            check_format(config.model)
        except ConfigError as e:
            raise ConfigError(f"checkpoint.init_from={config.checkpoint.init_from!r}: {e}") from None


@rule(
    "distributed-timeouts-positive",
    fields=[f"distributed.{f}" for f in TIMEOUTS],
    summary="The heartbeat and join timeouts of a multi-process run are positive numbers of seconds.",
    example=["distributed.heartbeat_timeout_s=0"],
    also=[["distributed.join_timeout_s=0"]],
)
def distributed_timeouts_positive(config, sizes) -> None:
    for field in TIMEOUTS:
        if getattr(config.distributed, field) < 1:
            raise ConfigError(
                f"distributed.{field}={getattr(config.distributed, field)} must be a positive number of seconds; e.g. 60"
            )


@rule(
    "data-source",
    fields=["data.source"],
    summary="Batches come from the synthetic source, a file of tokens, or text.",
    example=["data.source=web"],
)
def data_source(config, sizes) -> None:
    if config.data.source not in SOURCES:
        raise ConfigError(f"data.source={config.data.source!r}; use synthetic, tokens (a file of token ids) or text")


@rule(
    "file-data-needs-language-model",
    fields=["data.source", "model"],
    summary="A token file or text feeds a language model (model.task=lm).",
    example=["data.source=tokens", "data.path=tokens.npy"],
    base="mlp",
)
def file_data_needs_language_model(config, sizes) -> None:
    source = config.data.source
    if source in FILE_SOURCES and config.model.task != "lm":  # else the synthetic classes would train, silently
        raise ConfigError(f"data.source={source} holds tokens for a language model, but model.task="
                          f"{config.model.task!r}; use data.source=synthetic, or give your batches to "
                          "jaxpar.train.run(trainer, data=...)")


@rule(
    "tokens-need-path",
    fields=["data.source", "data.path"],
    summary="data.source=tokens or text reads what data.path names; data.path needs one of them.",
    example=["data.source=tokens"],
    also=[["data.path=tokens.npy"], ["data.source=text", "data.tokenizer=tokenizer.json"]],
)
def tokens_need_path(config, sizes) -> None:
    source, path = config.data.source, config.data.path
    if source in FILE_SOURCES and not path:
        raise ConfigError(f"data.source={source} needs data.path, {FILE_SOURCES[source]}")
    if source not in FILE_SOURCES and path:  # else the file would be ignored, silently
        raise ConfigError(f"data.path={path!r} is read only with data.source=tokens or text, but "
                          f"data.source={source!r}; set data.source=tokens (token ids) or text, or drop data.path")


@rule(
    "text-needs-tokenizer",
    fields=["data.source", "data.tokenizer"],
    summary="data.source=text is tokenized with data.tokenizer, a tokenizer.json (which `jaxpar sample` and "
    "`jaxpar export` also read, with any source).",
    example=["data.source=text", "data.path=corpus.jsonl"],
)
def text_needs_tokenizer(config, sizes) -> None:
    if config.data.source == "text" and not config.data.tokenizer:
        raise ConfigError("data.source=text needs data.tokenizer, a Hugging Face tokenizer.json "
                          "(the one beside the model's weights)")


@rule(
    "text-field-named",
    fields=["data.text_field"],
    summary="data.text_field names the JSONL key or Parquet column that holds each document.",
    example=["data.text_field="],
)
def text_field_named(config, sizes) -> None:
    if not config.data.text_field:
        raise ConfigError("data.text_field='' names no key; set it to the JSONL key or Parquet column that holds "
                          "each document's text, e.g. data.text_field=text")


@rule(
    "data-order",
    fields=["data.order", "data.source"],
    summary="Rows are windows at random positions or epochs of consecutive rows; epochs need a token file or text.",
    example=["data.order=sorted"],
    also=[["data.order=epochs"]],
)
def data_order(config, sizes) -> None:
    from jaxpar.data.order import ORDERS

    order, source = config.data.order, config.data.source
    if order not in ORDERS:
        raise ConfigError(f"data.order={order!r}; use windows (random positions) or epochs (every row once per epoch)")
    if order == "epochs" and source not in FILE_SOURCES:  # a synthetic stream has no rows to go through
        raise ConfigError(f"data.order=epochs goes through a token file or text once per epoch, but "
                          f"data.source={source!r} is endless; set data.source=tokens or text, or data.order=windows")


@rule(
    "eos-needs-language-model",
    fields=["data.eos_id", "model"],
    summary="Packed documents (data.eos_id) are for language models only.",
    example=["data.eos_id=0"],
    base="mlp",
)
def eos_needs_language_model(config, sizes) -> None:
    eos = config.data.eos_id
    if eos != -1 and config.model.task != "lm":
        raise ConfigError(
            f"data.eos_id={eos} packs documents of a language model, but model.task={config.model.task!r}; use -1"
        )


@rule(
    "eos-in-vocabulary",
    fields=["data.eos_id", "model.vocab_size"],
    summary="data.eos_id is a token id of the model's vocabulary, or -1 for unpacked rows.",
    example=["data.eos_id=128"],
)
def eos_in_vocabulary(config, sizes) -> None:
    eos = config.data.eos_id
    if eos != -1 and not 0 <= eos < config.model.vocab_size:
        raise ConfigError(
            f"data.eos_id={eos} must be a token id (0 to model.vocab_size - 1 = {config.model.vocab_size - 1}), "
            "or -1 for unpacked rows"
        )


@rule(
    "eval-every",
    fields=["train.eval_every"],
    summary="Held-out evaluation runs every so many steps, or (0) never.",
    example=["train.eval_every=-1"],
)
def eval_every(config, sizes) -> None:
    if config.train.eval_every < 0:
        raise ConfigError(
            f"train.eval_every={config.train.eval_every}; use a number of steps between evaluations "
            "(e.g. train.eval_every=100), or 0 for none"
        )


@rule(
    "eval-batches-positive",
    fields=["train.eval_batches"],
    summary="An evaluation averages the loss over at least one held-out global batch.",
    example=["train.eval_batches=0"],
)
def eval_batches_positive(config, sizes) -> None:
    if config.train.eval_batches < 1:
        raise ConfigError(
            f"train.eval_batches={config.train.eval_batches} must be a positive number of held-out global batches; "
            "e.g. train.eval_batches=4"
        )


@rule(
    "eval-fraction-range",
    fields=["data.eval_fraction"],
    summary="The held-out share of a token file is a fraction below 1, or 0 for none.",
    example=["data.eval_fraction=1.5"],
    also=[["data.eval_fraction=-0.1"]],
)
def eval_fraction_range(config, sizes) -> None:
    fraction = config.data.eval_fraction
    if not 0 <= fraction < 1:
        raise ConfigError(
            f"data.eval_fraction={fraction} must be in (0, 1), the share of the token file held out "
            "(e.g. 0.01: its last 1%), or 0 to train on all of it"
        )


@rule(
    "eval-fraction-needs-token-file",
    fields=["data.eval_fraction", "data.source"],
    summary="data.eval_fraction splits a token file or text; synthetic sources hold out a random stream of their own.",
    example=["data.eval_fraction=0.1"],
)
def eval_fraction_needs_token_file(config, sizes) -> None:
    fraction = config.data.eval_fraction
    if fraction and (config.data.source not in FILE_SOURCES or config.model.task != "lm"):
        raise ConfigError(
            f"data.eval_fraction={fraction} holds out the end of a token file or text, but data.source="
            f"{config.data.source} (model.task={config.model.task!r}) draws held-out batches from a random stream "
            "of its own; leave data.eval_fraction=0, or set data.source=tokens or text"
        )


@rule(
    "token-eval-needs-held-out-part",
    fields=["train.eval_every", "data.eval_fraction"],
    summary="Evaluating a model trained on a token file or text needs a held-out part of it, data.eval_fraction > 0.",
    example=["train.eval_every=10", "data.source=tokens", "data.path=tokens.npy"],
    also=[["train.eval_every=10", "data.source=text", "data.path=corpus.jsonl", "data.tokenizer=tokenizer.json"]],
)
def token_eval_needs_held_out_part(config, sizes) -> None:
    every, data = config.train.eval_every, config.data
    if every and data.source in FILE_SOURCES and config.model.task == "lm" and not data.eval_fraction:
        raise ConfigError(
            f"train.eval_every={every} evaluates on held-out batches, but data.eval_fraction=0 holds none of "
            f"data.path={data.path!r} out of training; set data.eval_fraction=0.01 (its last 1%)"
        )
