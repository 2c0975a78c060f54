"""Text from a trained language model: `generate` continues a prompt token by token on the
trainer's mesh, in any layout `jaxpar.generate.inference.forward` runs (tensor, sequence and
context parallel, FSDP, experts, pipeline stages).

Two ways to run the model, the same tokens either way (tests/equivalence/test_kv_cache.py):

  * **with a key/value cache** (the default where the layout allows): one pass over the
    buffer of prompts (prefill) fills a cache of every layer's keys and values, then each new token
    is one pass over that token alone, attending over the cache
    (jaxpar.sharding.kv_cache). Every model whose attention goes through
    `jaxpar.sharding.attend` gets it. The cache rests like keys and values do: rows over
    the batch axes, heads over mesh.tensor. Not under context parallelism (mesh.context >
    1: a token a step has no sequence to split), nor for a model whose tokens meet other
    than through that attention call (refused where it makes none).
  * **without** (`kv_cache=False`, and under mesh.context > 1): every new token runs the
    whole forward pass again over a fixed-length buffer, so n new tokens cost n full
    passes; every layout, context parallelism included.

The buffer holds a prompt a row (`generate_batch`: prompts of different lengths at once;
`generate`: one), the tokens drawn so far, then padding; its length (the longest prompt plus
max_new_tokens, rounded up to what the layout splits) is fixed, so each step compiles once,
and each row's next token is read at its own position. Causal attention keeps the padding
after a position out of that position's logits; a model whose tokens meet other than
through causal attention (MoE routing with a capacity limit, where padding and other rows
compete for expert slots) can see it. Rows are rounded up to what the batch axes (mesh data
x fsdp x expert) split, the extra rows repeating the first prompt.

Under pipeline stages (mesh.stage > 1) the forward pass runs the whole model at once, not
stage by stage: every device gathers every stage's layers (jaxpar.step.pipelined.unpipelined),
and `generate` warns (StagesGathered) with the bytes of parameters that puts on each device.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import ConfigError, JaxparWarning
from jaxpar.model import declared
from jaxpar.sharding import use_layout
from jaxpar.sharding.kv_cache import caching
from jaxpar.generate.inference import forward, whole_model
from jaxpar.step.loss import model_outputs
from jaxpar.step.replicas import without_axis
from jaxpar.units import byte_size


class StagesGathered(JaxparWarning):
    """Sampling under pipeline stages holds the whole model on every device."""


def generate(trainer, params: Any, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, stop_ids: Collection[int] = (), vocab_limit: int | None = None,
             top_p: float = 1.0, kv_cache: bool | None = None) -> list[int]:
    """The tokens that follow `prompt_ids`, at most `max_new_tokens` of them, ending early
    at the first of `stop_ids` drawn (included): a checkpoint's end-of-text ids, its chat
    template's end of turn (jaxpar.hf.generation.stop_ids). Temperature 0 is greedy (argmax);
    above 0 each token is drawn from softmax(logits / temperature) over the `top_k` largest
    logits (0: the whole vocabulary; ties with the k-th are kept) and, of those, the fewest
    likeliest whose probabilities reach `top_p` (1: all), with jax.random keys from `seed`. `vocab_limit`:
    only ids below it are chosen (a tokenizer's vocabulary, where the model's is larger: ids
    past it decode to nothing). `kv_cache`: True, False, or None for the cache where the
    layout allows it (the module's docstring). `params`: the weights where they rest, as
    `trainer.weights(state)` gives them (`state.params`, with LoRA's frozen weights joined)."""
    return generate_batch(trainer, params, [prompt_ids], max_new_tokens, temperature, top_k, seed, stop_ids,
                          vocab_limit, top_p=top_p, kv_cache=kv_cache)[0]


def generate_batch(trainer, params: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                   top_k: int = 0, seed: int = 0, stop_ids: Collection[int] = (), vocab_limit: int | None = None,
                   length: int | None = None, top_p: float = 1.0, kv_cache: bool | None = None) -> list[list[int]]:
    """`generate` for several prompts of any lengths at once, one a row: row r's next token is
    read at its own position, so each prompt's continuation is the one `generate` gives it
    alone (greedy; a draw's key is the seed's at that row and position). `length`: the
    buffer's (default the longest prompt plus max_new_tokens, rounded up to what the layout
    splits); calls with one length and as many rows compile once."""
    _check_arguments(trainer, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids)
    stops = frozenset(stop_ids)
    cached = uses_kv_cache(trainer, kv_cache)
    _warn_of_gathered_stages(trainer, params)
    layout = trainer.layout
    multiple = sequence_multiple(layout.mesh.shape, layout.context.layout, layout.tensor.sequence_parallel)
    need = max(map(len, prompts)) + max_new_tokens
    length = _round_up(max(length or 0, need), multiple)
    padded = prompts + [prompts[0]] * (_round_up(len(prompts), batch_rows(trainer)) - len(prompts))  # repeat the first
    starts = np.array([len(p) for p in padded], np.int32)
    tokens = np.zeros((len(padded), length), np.int32)
    for r, p in enumerate(padded):
        tokens[r, :len(p)] = p
    limit = np.iinfo(np.int32).max if vocab_limit is None else vocab_limit
    # one dtype each: one trace
    settings = (np.float32(temperature), np.int32(top_k), np.float32(top_p), np.int32(limit), jax.random.key(seed))
    steps = (_cached_tokens if cached else _recomputed_tokens)(trainer, params, tokens, starts, settings)
    drawn = [[] for _ in prompts]
    for _, token in zip(range(max_new_tokens), steps):
        for r, x in enumerate(token[:len(prompts)].tolist()):
            if not drawn[r] or drawn[r][-1] not in stops:
                drawn[r].append(x)
        if all(d and d[-1] in stops for d in drawn):
            break
    return drawn


def uses_kv_cache(trainer, kv_cache: bool | None) -> bool:
    """Whether sampling runs with the key/value cache: as asked, or (None) where the layout
    allows it. Asking for it where the sequence is split is refused."""
    context = trainer.layout.mesh.shape["context"]
    if kv_cache and context > 1:
        raise ConfigError(f"kv_cache=True with mesh.context={context}: a cached step runs one token a row, which "
                          "has no sequence to split; sample with mesh.context=1, or without the cache (kv_cache=False)")
    return context == 1 if kv_cache is None else kv_cache


def _recomputed_tokens(trainer, params, tokens: np.ndarray, starts: np.ndarray, settings: tuple):
    """Each step's drawn tokens [B] (numpy), the whole buffer run again for each, until the
    buffer is full."""
    step = next_token_step(trainer)
    tokens = jax.device_put(tokens, trainer.batch.shardings["inputs"])
    for t in range(tokens.shape[1] - int(starts.max())):
        tokens, token = step(params, tokens, starts + np.int32(t), *settings)
        yield np.asarray(token)


def _cached_tokens(trainer, params, tokens: np.ndarray, starts: np.ndarray, settings: tuple):
    """Each step's drawn tokens [B] (numpy), until the buffer is full: the whole buffer once
    into the cache (its shape, not the prompts' lengths, fixes the compile: batches of other
    prompts reuse it; places past a prompt hold padding's keys, which the mask keeps out and
    the tokens drawn there overwrite), then a token a row a step against it."""
    prefill, decode = cached_steps(trainer)
    cache, token = prefill(params, jax.device_put(tokens, trainer.batch.shardings["inputs"]), starts, *settings)
    yield np.asarray(token)
    for t in range(1, tokens.shape[1] - int(starts.max())):
        cache, token = decode(params, cache, token, starts + np.int32(t), *settings)
        yield np.asarray(token)


def _warn_of_gathered_stages(trainer, params: Any) -> None:
    """Under mesh.stage > 1, say how much of the model each device holds to sample: all of
    every stage's layers (sharded over the other axes as in training), not its stage's."""
    stages = trainer.layout.mesh.shape["stage"]
    if stages == 1:
        return

    def per_device(x: jax.Array, sharding) -> int:
        return math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize

    leaves = list(zip(jax.tree.leaves(params), jax.tree.leaves(trainer.weight_shardings)))
    whole = sum(per_device(x, without_axis(s, "stage")) for x, s in leaves)
    resting = sum(per_device(x, s) for x, s in leaves)
    warnings.warn(f"mesh.stage={stages}: sampling runs the whole model on every device, not stage by stage, so each "
                  f"device gathers every stage's layers: {byte_size(whole)} of parameters per device (training holds "
                  f"{byte_size(resting)}); where that does not fit, sample with mesh.stage=1 and the layers sharded "
                  "over mesh.fsdp or mesh.tensor", StagesGathered, stacklevel=3)


def derived(trainer, name: str, make: Callable[[], Any]) -> Any:
    """make(), once a trainer (Trainer.derived): later calls reuse its compiles."""
    if name not in trainer.derived:
        trainer.derived[name] = make()
    return trainer.derived[name]


def next_token_step(trainer) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """jit((params, tokens [B, L], positions [B], temperature, top_k, top_p, vocab_limit, key)
    -> (tokens with row r's column positions[r] filled, the B tokens)): each row's token
    after its tokens before positions[r], the whole buffer run again. All but the arrays'
    shapes are traced, so one compile serves every call of a buffer shape; one a trainer."""
    return derived(trainer, "next_token_step", lambda: _next_token_step(trainer))


def _next_token_step(trainer) -> Callable:
    logits_of = forward(trainer)

    def step(params, tokens, positions, *settings):
        logits = logits_of(params, {"inputs": tokens})  # [B, L, V]
        token = draw(jnp.take_along_axis(logits, (positions - 1)[:, None, None], axis=1)[:, 0], positions, *settings)
        token = everywhere(trainer, token)
        return tokens.at[jnp.arange(tokens.shape[0]), positions].set(token), token

    return jax.jit(step)


def cached_steps(trainer) -> tuple[Callable, Callable]:
    """(prefill, decode), jitted, one pair a trainer:

      prefill(params, buffer [B, L], starts [B], *settings) -> (cache, tokens [B]): the
          buffer (row b's prompt in its first starts[b] places, then anything) into a new
          cache of L places a row, and each row's token at place starts[b];
      decode(params, cache, tokens [B], places [B], *settings) -> (cache, tokens [B]): each
          row's token at places[b] - 1 into the cache (donated), and the row's next.
    """
    return derived(trainer, "cached_steps", lambda: _cached_steps(trainer))


def _cached_steps(trainer) -> tuple[Callable, Callable]:
    def run(params, tokens_BS, positions_BS, given, length):
        params, layout = whole_model(trainer, params)
        with use_layout(layout), caching(positions_BS, length, given) as cache:
            logits = model_outputs(nnx.merge(trainer.graphdef, params), {"inputs": tokens_BS, "positions": positions_BS})
        if not cache.made:
            raise ConfigError(f"kv_cache: {type(trainer.config.model).__name__} makes no attention call through "
                              "jaxpar.sharding.attend, so there is nothing to cache; sample with kv_cache=False")
        return logits, cache.made

    def prefill(params, buffer, starts, *settings):
        positions = jnp.broadcast_to(jnp.arange(buffer.shape[1], dtype=jnp.int32), buffer.shape)
        logits, cache = run(params, buffer, positions, None, buffer.shape[1])
        last = jnp.take_along_axis(logits, (starts - 1)[:, None, None], axis=1)[:, 0]
        return cache, everywhere(trainer, draw(last, starts, *settings))

    def decode(params, cache, tokens, places, *settings):
        logits, cache = run(params, tokens[:, None], (places - 1)[:, None], cache, cache_length(cache))
        return cache, everywhere(trainer, draw(logits[:, 0], places, *settings))

    return jax.jit(prefill), jax.jit(decode, donate_argnums=(1,))


def cache_length(cache: list) -> int:
    """Places a row of a cache (every entry's keys: [..., B, L, heads, K])."""
    return jax.tree.leaves(cache)[0].shape[-3]


def draw(logits_BV: jax.Array, places: jax.Array, temperature, top_k, top_p, vocab_limit, key) -> jax.Array:
    """Each row's token from its logits, for place places[b]: ids at or past vocab_limit are
    never chosen; a draw's key is the seed's folded with the place, then the row."""
    logits = jnp.where(jnp.arange(logits_BV.shape[-1]) < vocab_limit, logits_BV.astype(jnp.float32), -jnp.inf)
    rows = jnp.arange(logits.shape[0])
    keys = jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(key, p), r))(rows, places)
    return jax.vmap(choose, in_axes=(0, None, None, None, 0))(logits, temperature, top_k, top_p, keys)


def everywhere(trainer, token_B: jax.Array) -> jax.Array:
    """The drawn tokens on every device: each process reads them all (several processes)."""
    return jax.lax.with_sharding_constraint(token_B, trainer.layout.sharding((None,)))


def choose(logits_V: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, key: jax.Array) -> jax.Array:
    """Greedy at temperature 0; else one draw from softmax(logits / temperature) restricted
    to the top_k largest logits (0: all of them) and, of those, the fewest likeliest whose
    probabilities sum to top_p or more (nucleus sampling; 1: all)."""
    vocab = logits_V.shape[0]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    threshold = jnp.sort(logits_V)[vocab - k]  # the k-th largest
    kept = jnp.where(logits_V >= threshold, logits_V, -jnp.inf) / jnp.maximum(temperature, 1e-6)
    probs = jax.nn.softmax(kept)
    descending = jnp.sort(probs)[::-1]
    before = jnp.cumsum(descending) - descending  # the mass of the likelier tokens
    floor = jnp.min(jnp.where(before < top_p, descending, jnp.inf))  # the least likely token kept
    kept = jnp.where(probs >= floor, kept, -jnp.inf)
    drawn = jax.random.categorical(key, kept)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits_V)).astype(jnp.int32)


def sequence_multiple(mesh_shape: Mapping[str, int], seq_layout: str, sequence_parallel: bool) -> int:
    """What a sequence's length must be a multiple of on this mesh: mesh.context (twice it
    for the zigzag layout's two chunks a device), times mesh.tensor under sequence parallelism
    (jaxpar.checks' seq-divides-context-tensor and zigzag-seq-divides)."""
    context = mesh_shape["context"]
    chunks = 2 * context if context > 1 and seq_layout == "zigzag" else context
    sequence_ways = context * (mesh_shape["tensor"] if sequence_parallel else 1)
    return math.lcm(chunks, sequence_ways)


def batch_rows(trainer) -> int:
    """The fewest rows a batch can have: the product of the mesh axes its rows split over."""
    sharding = trainer.batch.shardings["inputs"]
    axes = sharding.spec[0] if len(sharding.spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(sharding.mesh.shape[a] for a in axes)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_arguments(trainer, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_k: int,
                     top_p: float, stop_ids: Collection[int]) -> None:
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
    if not isinstance(stop_ids, Collection) or not all(isinstance(i, (int, np.integer)) for i in stop_ids):
        raise ConfigError(f"stop_ids={stop_ids!r}; give a collection of token ids, e.g. stop_ids=[2] (or () for none)")
    if not temperature >= 0:  # NaN too
        raise ConfigError(f"temperature={temperature}; use 0 for greedy, or a positive value such as 0.8 to sample")
    if top_k < 0:
        raise ConfigError(f"top_k={top_k}; use 0 for the whole vocabulary, or a positive count such as 40")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p={top_p}; use 1 for the whole vocabulary, or a probability mass in (0, 1] such as 0.9")
