"""Text from a trained language model: `generate` continues a prompt token by token on the
trainer's mesh, in any layout `jaxpar.train.inference.forward` runs (tensor, sequence and
context parallel, FSDP, experts, pipeline stages).

No KV cache: every new token runs the whole forward pass again over a fixed-length buffer,
so n new tokens cost n full forward passes. It is for looking at what a model learned (after
a fine-tune, say), not for serving.

The buffer holds a prompt a row (`generate_batch`: prompts of different lengths at once;
`generate`: one), the tokens drawn so far, then padding; its length (the longest prompt plus
max_new_tokens, rounded up to what the layout splits) is fixed, so the step compiles once,
and each row's next token is read at its own position. Causal attention keeps the padding
after a position out of that position's logits; a model whose tokens meet other than
through causal attention (MoE routing with a capacity limit, where padding and other rows
compete for expert slots) can see it. Rows are rounded up to what the batch axes (mesh data
x fsdp x expert) split, the extra rows repeating the first prompt.

Under pipeline stages (mesh.stage > 1) the forward pass runs the whole model at once, not
stage by stage: every device gathers every stage's layers (jaxpar.train.pipelined.unpipelined),
and `generate` warns (StagesGathered) with the bytes of parameters that puts on each device.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError, JaxparWarning
from jaxpar.model import declared
from jaxpar.train.inference import forward
from jaxpar.train.replicas import without_axis
from jaxpar.units import byte_size


class StagesGathered(JaxparWarning):
    """Sampling under pipeline stages holds the whole model on every device."""


def generate(trainer, params: Any, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, eos_id: int = -1, vocab_limit: int | None = None) -> list[int]:
    """The tokens that follow `prompt_ids`, at most `max_new_tokens` of them, ending early
    with `eos_id` (included) when it is drawn. Temperature 0 is greedy (argmax); above 0 each
    token is drawn from softmax(logits / temperature) over the `top_k` largest logits (0: the
    whole vocabulary; ties with the k-th are kept), with jax.random keys from `seed`.
    `vocab_limit`: only ids below it are chosen (a tokenizer's vocabulary, where the model's
    is larger: ids past it decode to nothing). `params`: the weights where they rest, as a
    TrainState holds them (`state.params`)."""
    return generate_batch(trainer, params, [prompt_ids], max_new_tokens, temperature, top_k, seed, eos_id,
                          vocab_limit)[0]


def generate_batch(trainer, params: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                   top_k: int = 0, seed: int = 0, eos_id: int = -1, vocab_limit: int | None = None,
                   length: int | None = None) -> list[list[int]]:
    """`generate` for several prompts of any lengths at once, one a row: row r's next token is
    read at its own position, so each prompt's continuation is the one `generate` gives it
    alone (greedy; a draw's key is the seed's at that row and position). `length`: the
    buffer's (default the longest prompt plus max_new_tokens, rounded up to what the layout
    splits); calls with one length and as many rows compile once."""
    _check_arguments(trainer, prompts, max_new_tokens, temperature, top_k)
    _warn_of_gathered_stages(trainer, params)
    multiple = sequence_multiple(trainer.layout.mesh.shape, trainer.config.parallel)
    need = max(map(len, prompts)) + max_new_tokens
    length = _round_up(max(length or 0, need), multiple)
    padded = prompts + [prompts[0]] * (_round_up(len(prompts), batch_rows(trainer)) - len(prompts))  # repeat the first
    starts = np.array([len(p) for p in padded], np.int32)
    tokens = np.zeros((len(padded), length), np.int32)
    for r, p in enumerate(padded):
        tokens[r, :len(p)] = p
    tokens = jax.device_put(tokens, trainer.batch.shardings["inputs"])
    step, key = next_token_step(trainer), jax.random.key(seed)
    limit = np.iinfo(np.int32).max if vocab_limit is None else vocab_limit
    settings = (np.float32(temperature), np.int32(top_k), np.int32(limit), key)  # one dtype each: one trace
    drawn = [[] for _ in prompts]
    for t in range(max_new_tokens):
        tokens, token = step(params, tokens, starts + np.int32(t), *settings)
        for r, x in enumerate(np.asarray(token)[:len(prompts)].tolist()):
            if not drawn[r] or drawn[r][-1] != eos_id:
                drawn[r].append(x)
        if all(d and d[-1] == eos_id for d in drawn):
            break
    return drawn


def _warn_of_gathered_stages(trainer, params: Any) -> None:
    """Under mesh.stage > 1, say how much of the model each device holds to sample: all of
    every stage's layers (sharded over the other axes as in training), not its stage's."""
    stages = trainer.layout.mesh.shape["stage"]
    if stages == 1:
        return

    def per_device(x: jax.Array, sharding) -> int:
        return math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize

    leaves = list(zip(jax.tree.leaves(params), jax.tree.leaves(trainer.shardings.params)))
    whole = sum(per_device(x, without_axis(s, "stage")) for x, s in leaves)
    resting = sum(per_device(x, s) for x, s in leaves)
    warnings.warn(f"mesh.stage={stages}: sampling runs the whole model on every device, not stage by stage, so each "
                  f"device gathers every stage's layers: {byte_size(whole)} of parameters per device (training holds "
                  f"{byte_size(resting)}); where that does not fit, sample with mesh.stage=1 and the layers sharded "
                  "over mesh.fsdp or mesh.tensor", StagesGathered, stacklevel=3)


def next_token_step(trainer) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """jit((params, tokens [B, L], positions [B], temperature, top_k, vocab_limit, key) ->
    (tokens with row r's column positions[r] filled, the B tokens)): each row's token after
    its tokens before positions[r]. All but the arrays' shapes are traced, so one compile
    serves every call of a buffer shape."""
    logits_of = forward(trainer)

    def step(params, tokens, positions, temperature, top_k, vocab_limit, key):
        logits = logits_of(params, {"inputs": tokens})  # [B, L, V]
        last = jnp.take_along_axis(logits, (positions - 1)[:, None, None], axis=1)[:, 0].astype(jnp.float32)
        last = jnp.where(jnp.arange(last.shape[-1]) < vocab_limit, last, -jnp.inf)
        rows = jnp.arange(tokens.shape[0])
        keys = jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(key, p), r))(rows, positions)
        token = jax.vmap(choose, in_axes=(0, None, None, 0))(last, temperature, top_k, keys)
        return tokens.at[rows, positions].set(token), token

    return jax.jit(step)


def choose(logits_V: jax.Array, temperature: jax.Array, top_k: jax.Array, key: jax.Array) -> jax.Array:
    """Greedy at temperature 0; else one draw from softmax(logits / temperature) restricted
    to the top_k largest logits (0: all of them)."""
    vocab = logits_V.shape[0]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    threshold = jnp.sort(logits_V)[vocab - k]  # the k-th largest
    kept = jnp.where(logits_V >= threshold, logits_V, -jnp.inf)
    drawn = jax.random.categorical(key, kept / jnp.maximum(temperature, 1e-6))
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits_V)).astype(jnp.int32)


def sequence_multiple(mesh_shape: Mapping[str, int], parallel: Any) -> int:
    """What a sequence's length must be a multiple of on this mesh: mesh.context (twice it
    for the zigzag layout's two chunks a device), times mesh.tensor under sequence parallelism
    (jaxpar.checks' seq-divides-context-tensor and zigzag-seq-divides)."""
    context = mesh_shape["context"]
    chunks = 2 * context if context > 1 and parallel.context_layout == "zigzag" else context
    sequence_ways = context * (mesh_shape["tensor"] if parallel.sequence_parallel else 1)
    return math.lcm(chunks, sequence_ways)


def batch_rows(trainer) -> int:
    """The fewest rows a batch can have: the product of the mesh axes its rows split over."""
    sharding = trainer.batch.shardings["inputs"]
    axes = sharding.spec[0] if len(sharding.spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(sharding.mesh.shape[a] for a in axes)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_arguments(trainer, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_k: int) -> None:
    model = trainer.config.model
    if model.task != "lm":
        raise ConfigError(f"generate needs a language model (model.task='lm'); {type(model).__name__} has "
                          f"model.task={model.task!r}")
    if not prompts or not all(prompts):
        raise ConfigError("prompt_ids=[] is empty; give at least one token to continue")
    vocab = declared(model, "vocab_size")
    outside = [t for p in prompts for t in p if t < 0 or (vocab is not None and t >= vocab)]
    if outside:
        raise ConfigError(f"prompt_ids hold {outside[0]}, outside model.vocab_size={vocab}; give ids in [0, {vocab})")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens}; give at least 1")
    if not temperature >= 0:  # NaN too
        raise ConfigError(f"temperature={temperature}; use 0 for greedy, or a positive value such as 0.8 to sample")
    if top_k < 0:
        raise ConfigError(f"top_k={top_k}; use 0 for the whole vocabulary, or a positive count such as 40")
