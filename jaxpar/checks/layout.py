"""The model against the mesh: tensor, fsdp and sequence divisibility, then context-parallel
attention (which divides heads by the tensor degree, so it runs after)."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError
from jaxpar.kernels.attention.tiles import tile
from jaxpar.kernels.attention.order import chunk_length
from jaxpar.kernels.attention.pallas import shape_problem, triton_tile
from jaxpar.mesh import divisors
from jaxpar.model import (ATTENTION, PROJECTIONS, SEQUENCE, STAGES, declared, field_name, lacks, mesh_divides,
                          model_name, supports)

RULES: list[Rule] = []
rule = collector(RULES)

@rule(
    "mesh-divides-model",
    fields=["mesh.tensor", "mesh.fsdp", "mesh.expert", "model.num_heads", "model.num_kv_heads", "model.vocab_size",
            "model.mlp", "model.embed", "model.num_experts"],
    summary="Each mesh axis splits evenly the model fields its config lists in `mesh_divides` (Llama: tensor the "
    "query heads, vocabulary and MLP width, fsdp the embedding; MoE: expert the experts). Key/value heads that tensor "
    "does not divide are repeated at use.",
    example=["mesh.tensor=8"],
    also=[["model.embed=36", "mesh.fsdp=8"]],
)
def mesh_divides_model(config, sizes) -> None:
    model = config.model
    for axis, fields in mesh_divides(model).items():
        n = sizes.get(axis, 1)
        for field in fields:
            value = getattr(model, field)
            if value % n:
                raise ConfigError(f"mesh.{axis}={n} does not divide model.{field}={value}; "
                                  f"use mesh.{axis} in {divisors(value)}")


@rule(
    "seq-divides-context-tensor",
    fields=["train.seq_len", "mesh.context", "mesh.tensor", "parallel.tensor.sequence_parallel"],
    summary="The sequence splits evenly over mesh.context, times mesh.tensor under sequence parallelism.",
    example=["mesh.tensor=4", "parallel.tensor.sequence_parallel=true", "train.seq_len=18"],
)
def seq_divides_context_tensor(config, sizes) -> None:
    seq_ways = sizes["context"] * (sizes["tensor"] if config.parallel.tensor.sequence_parallel else 1)
    field, length = sequence_length(config)
    if supports(config.model, SEQUENCE) and length % seq_ways:
        raise ConfigError(
            f"{field}={length} is not divisible by context x tensor = {seq_ways} "
            f"(sequence parallelism shards the sequence); use a multiple of {seq_ways}"
        )


@rule(
    "loss-chunks",
    fields=["train.loss_chunks", "train.seq_len", "mesh.context", "mesh.tensor", "parallel.tensor.sequence_parallel",
            "model"],
    summary="train.loss_chunks is 1 or more; above 1 the model is a language model with pipeline stages' members "
    "(capability 'stages'), and each chunk's tokens split evenly over the sequence's shards.",
    example=["train.loss_chunks=0"],
    also=[["train.loss_chunks=3"], ["train.loss_chunks=16", "mesh.context=2"]],
)
def loss_chunks(config, sizes) -> None:
    chunks, seq = config.train.loss_chunks, config.train.seq_len
    where = f"train.loss_chunks={chunks}"
    if chunks < 1:
        raise ConfigError(f"{where} must be 1 (the whole logits at once) or more (that many groups of tokens)")
    if chunks == 1:
        return
    if config.model.task != "lm" or not supports(config.model, STAGES):
        raise lacks(config.model, STAGES, where, "set train.loss_chunks=1 (the chunked loss scores output(apply_layers("
                    "embed(batch))) in pieces: a language model's jaxpar.model.PipelineStages members)")
    seq_ways = sizes["context"] * (sizes["tensor"] if config.parallel.tensor.sequence_parallel else 1)
    if seq % (chunks * seq_ways):
        fits = [c for c in divisors(seq // seq_ways) if c > 1] if seq % seq_ways == 0 else []
        raise ConfigError(f"{where}: a chunk takes one token in every {chunks} of each sequence, so "
                          f"train.seq_len={seq} must divide by loss_chunks x the sequence's shards (context x tensor under sequence "
                          f"parallelism = {seq_ways}); use train.loss_chunks in {fits[:8] or [1]}")


def sequence_length(config) -> tuple[str, int]:
    """(where it comes from, the length of the model's activations' sequence): the model's
    own `sequence_length` (a ViT's patches) or train.seq_len."""
    own = declared(config.model, "sequence_length")
    return ("model.sequence_length", own) if own is not None else ("train.seq_len", config.train.seq_len)


@rule(
    "sequence-parallel-needs-sequence",
    fields=["parallel.tensor.sequence_parallel", "model"],
    summary="Sequence parallelism shards the sequence of a model that declares the 'sequence' capability (its "
    "activations carry seq / norm_seq); on any other it would do nothing.",
    example=["parallel.tensor.sequence_parallel=true"],
    base="mlp",
)
def sequence_parallel_needs_sequence(config, sizes) -> None:
    if config.parallel.tensor.sequence_parallel and not supports(config.model, SEQUENCE):
        raise lacks(config.model, SEQUENCE, "parallel.tensor.sequence_parallel=true", "set parallel.tensor.sequence_parallel=false")


@rule(
    "collective-matmul-needs-sequence-parallel",
    fields=["parallel.tensor.collective_matmul", "parallel.tensor.sequence_parallel", "mesh.tensor", "model"],
    summary="Collective matmul passes sequence chunks round mesh.tensor: a model whose projections go through "
    "jaxpar's helpers (capability 'projections'), parallel.tensor.sequence_parallel=true and mesh.tensor > 1.",
    example=["parallel.tensor.collective_matmul=ring"],
    also=[["parallel.tensor.collective_matmul=ring", "parallel.tensor.sequence_parallel=true"]],
)
def collective_matmul_needs_sequence_parallel(config, sizes) -> None:
    value, t = config.parallel.tensor.collective_matmul, sizes["tensor"]
    if value == "none":
        return
    where = f"parallel.tensor.collective_matmul={value}"
    if not supports(config.model, PROJECTIONS):
        raise lacks(config.model, PROJECTIONS, where, "set parallel.tensor.collective_matmul=none")
    if not config.parallel.tensor.sequence_parallel:
        raise ConfigError(f"{where} overlaps the sequence-parallel all-gather and reduce-scatter, but "
                          "parallel.tensor.sequence_parallel=false; set parallel.tensor.sequence_parallel=true, or "
                          "parallel.tensor.collective_matmul=none")
    if t == 1:
        raise ConfigError(f"{where} needs a ring, but mesh.tensor=1; use mesh.tensor > 1, or "
                          "parallel.tensor.collective_matmul=none")


@rule(
    "matmul-dtype",
    fields=["train.matmul_dtype", "parallel.tensor.collective_matmul", "model"],
    summary="train.matmul_dtype=fp8 runs the projections a model sends through jaxpar's helpers (capability "
    "'projections'), not inside the collective matmul's ring.",
    example=["train.matmul_dtype=fp8", "parallel.tensor.collective_matmul=ring", "parallel.tensor.sequence_parallel=true",
             "mesh.tensor=2"],
)
def matmul_dtype(config, sizes) -> None:
    value = config.train.matmul_dtype
    if value == "compute":
        return
    if not supports(config.model, PROJECTIONS):  # nothing would run in FP8
        raise ConfigError(f"train.matmul_dtype={value}: model {model_name(config.model)} does not run its matmuls "
                          "through jaxpar's projection helpers (column_project / row_project; it declares no "
                          f"'{PROJECTIONS}' capability), and FP8 applies only there, so nothing would run in FP8; set "
                          "train.matmul_dtype=compute, or route its projections through the helpers and declare "
                          f"'{PROJECTIONS}' (docs/your_model.md)")
    if config.parallel.tensor.collective_matmul != "none":
        raise ConfigError(f"train.matmul_dtype={value} with parallel.tensor.collective_matmul="
                          f"{config.parallel.tensor.collective_matmul}: the collective matmul's ring multiplies in the "
                          "compute dtype; set parallel.tensor.collective_matmul=none for FP8, or train.matmul_dtype=compute")


@rule(
    "attention",
    fields=["parallel.attention", "mesh.context"],
    summary="parallel.attention picks the attention of an unsharded sequence, in a model that routes attention "
    "through jaxpar's helper; with mesh.context > 1 the context-parallel kernels run instead, so it stays auto.",
    example=["mesh.context=2", "parallel.attention=flash"],
)
def attention(config, sizes) -> None:
    value = config.parallel.attention
    if value != "auto" and not supports(config.model, ATTENTION):
        raise lacks(config.model, ATTENTION, f"parallel.attention={value}", "set parallel.attention=auto")
    if value != "auto" and sizes["context"] > 1:
        raise ConfigError(
            f"parallel.attention={value} with mesh.context={sizes['context']}: a sharded sequence runs the "
            "context-parallel kernels (parallel.context.impl, parallel.context.kernel); set parallel.attention=auto"
        )


@rule(
    "attention-block-positive",
    fields=["parallel.context.block"],
    summary="The longest attention tile is a positive number of tokens.",
    example=["parallel.context.block=0"],
)
def attention_block_positive(config, sizes) -> None:
    block = config.parallel.context.block
    if block < 1:
        raise ConfigError(f"parallel.context.block={block} must be a positive tile length; e.g. 512")


@rule(
    "attention-kernel-needs-context",
    fields=["parallel.context.kernel", "mesh.context"],
    summary="A Pallas block kernel only runs in context-parallel attention, mesh.context > 1.",
    example=["parallel.context.kernel=pallas_interpret"],
)
def attention_kernel_needs_context(config, sizes) -> None:
    kernel = config.parallel.context.kernel
    if kernel != "jax" and sizes["context"] == 1:
        raise ConfigError(
            f"parallel.context.kernel={kernel} is the block kernel of context-parallel attention, "
            "but mesh.context=1 runs parallel.attention (whose flash kernel uses the jax block forward); set "
            "mesh.context>1 or parallel.context.kernel=jax"
        )


@rule(
    "context-needs-attention-helper",
    fields=["mesh.context", "model"],
    summary="Only a model that routes attention through jaxpar's helper (capability 'attention') shards its "
    "sequence over mesh.context.",
    example=["mesh.context=2"],
    base="mlp",
)
def context_needs_sequence_model(config, sizes) -> None:
    c = sizes["context"]
    if c > 1 and not supports(config.model, ATTENTION):
        raise lacks(config.model, ATTENTION, f"mesh.context={c}", "use mesh.context=1")


@rule(
    "zigzag-seq-divides",
    fields=["train.seq_len", "mesh.context", "parallel.context.layout"],
    summary="The zigzag layout gives each context device two chunks, so 2 x mesh.context divides the sequence.",
    example=["mesh.context=4", "train.seq_len=20"],
)
def zigzag_seq_divides(config, sizes) -> None:
    c, s = sizes["context"], config.train.seq_len
    if c > 1 and config.parallel.context.layout == "zigzag" and s % (2 * c):
        raise ConfigError(
            f"train.seq_len={s} is not divisible by 2 x mesh.context = {2 * c} (the zigzag layout "
            f"gives each device two chunks); use a multiple of {2 * c} or parallel.context.layout=contiguous"
        )


def _tiles(config, c: int) -> tuple[int, int]:
    """(the chunk length the layout deals out, the attention tile that divides it)."""
    chunk = chunk_length(config.parallel.context.layout, c, config.train.seq_len)
    return chunk, tile(chunk, config.parallel.context.block)


# The tiles must divide the layout's chunks, so a chunk whose length has no divisor near
# parallel.context.block would silently run tiny tiles.
@rule(
    "attention-tiles-not-tiny",
    fields=["parallel.context.block", "train.seq_len", "mesh.context"],
    summary="The sequence's chunks (the whole sequence for attention=flash) split into attention tiles of at least "
    "a quarter of parallel.context.block (or of the chunk).",
    example=["mesh.context=2", "train.seq_len=68", "parallel.context.block=16"],
    also=[["parallel.attention=flash", "train.seq_len=67", "parallel.context.block=16"]],
)
def attention_tiles_not_tiny(config, sizes) -> None:
    c, s, block = sizes["context"], config.train.seq_len, config.parallel.context.block
    if c == 1:
        used = tile(s, block)
        if config.parallel.attention == "flash" and used < min(block, s) // 4:
            unit = 1 << (block.bit_length() - 1)
            raise ConfigError(
                f"parallel.attention=flash with parallel.context.block={block}: train.seq_len={s} splits only into "
                f"tiles of {used}; use a train.seq_len that is a multiple of {unit}, e.g. {max(unit, s // unit * unit)}"
            )
        return
    chunk, used = _tiles(config, c)
    if used < min(block, chunk) // 4:
        per = s // chunk
        unit = per * (1 << (block.bit_length() - 1))  # chunks a multiple of a power of two <= block
        raise ConfigError(
            f"parallel.context.block={block}: the {chunk}-token chunks of train.seq_len={s} over {per} "
            f"({config.parallel.context.layout} over mesh.context={c}) split only into tiles of {used}; use a train.seq_len "
            f"that is a multiple of {unit}, e.g. {max(unit, s // unit * unit)}"
        )


@rule(
    "pallas-shapes",
    fields=["parallel.context.kernel", "parallel.context.block", "train.seq_len", "mesh.context"],
    summary="The Triton kernel needs power-of-two tiles of at least 16 tokens (heads of any size are padded to a power "
    "of two).",
    example=["mesh.context=2", "parallel.context.kernel=pallas"],
)
def pallas_shapes(config, sizes) -> None:
    c = sizes["context"]
    if c == 1 or config.parallel.context.kernel != "pallas":
        return
    chunk, used = _tiles(config, c)
    problem = shape_problem(triton_tile(used), triton_tile(used))
    if problem:
        raise ConfigError(
            f"parallel.context.kernel=pallas (Triton) needs {problem} (tiles from parallel.context.block="
            f"{config.parallel.context.block} and the {chunk}-token chunks of train.seq_len={config.train.seq_len} over "
            f"mesh.context={c}); use parallel.context.kernel=jax, or a train.seq_len whose chunks are a multiple of 16"
        )


@rule(
    "ulysses-divides-heads",
    fields=["parallel.context.impl", "mesh.context", "model.num_heads", "mesh.tensor"],
    summary="Ulysses trades the sequence for heads, so mesh.context divides the query heads per tensor shard (key/value "
    "heads it does not divide are repeated at use, as over tensor).",
    example=["mesh.tensor=2", "mesh.context=4", "parallel.context.impl=ulysses"],
)
def ulysses_divides_heads(config, sizes) -> None:
    c = sizes["context"]
    if c == 1 or config.parallel.context.impl != "ulysses":
        return
    local = config.model.num_heads // sizes["tensor"]
    if local % c:
        raise ConfigError(
            f"parallel.context.impl=ulysses: mesh.context={c} does not divide the {local} query heads per tensor "
            f"shard ({field_name(config.model, 'num_heads', config.model.num_heads)} / "
            f"mesh.tensor={sizes['tensor']}); use "
            f"mesh.context in {divisors(local)}, or parallel.context.impl=ring or allgather"
        )
