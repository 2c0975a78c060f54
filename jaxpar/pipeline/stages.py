"""A model cut into pipeline stages: which piece runs where, as the executor's three
functions (jaxpar.pipeline.executor.Stages).

The model provides the pieces (jaxpar.model.PipelineStages: `embed`, `apply_layers` over
whatever layers its `layers` holds, `output`); a stage rebuilds the model from the weights
it holds, with only its chunk of the layer stack, so one model definition serves every
stage. The embedding runs on the first virtual stage, the output and the loss on the last
(their cost lands on those two stages: `jaxpar explain` shows the split).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.pipeline.executor import STAGE, Stages, no_report
from jaxpar.pipeline.split import StageSplit

LAYERS = "layers"  # the key of the stacked layers in the model's parameter tree


def split_layers(params: dict) -> tuple[Any, dict]:
    """(the stacked layers, every other weight)."""
    return params[LAYERS], {k: v for k, v in params.items() if k != LAYERS}


def join_layers(layers: Any, other: dict) -> dict:
    return {**other, LAYERS: layers}


def in_pipeline_order(tree: Any, split: StageSplit) -> Any:
    """Every array under a "layers" key of `tree` (parameters, gradients, optimizer state,
    a whole TrainState) stacked over the model's layers, put in pipeline order
    (`StageSplit.to_pipeline_order`: padded where stages differ)."""
    return _under_layers(tree, split.to_pipeline_order, split.layers)


def in_model_order(tree: Any, split: StageSplit) -> Any:
    """The inverse of `in_pipeline_order`."""
    return _under_layers(tree, split.to_model_order, split.rows)


def _under_layers(tree: Any, fn, rows: int) -> Any:
    """`fn` on the arrays under a "layers" key stacked over `rows` rows (an optimizer's
    placeholders or per-layer scalars of other shapes are left alone)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: fn(x) if _stacked_layers(path, x, rows) else x, tree)


def _stacked_layers(path, x: Any, rows: int) -> bool:
    return getattr(x, "ndim", 0) >= 1 and x.shape[0] == rows and _in_layers(path)


def _in_layers(path) -> bool:
    return any(getattr(k, "key", None) == LAYERS for k in path)


def stored_shapes(tree: Any, split: StageSplit) -> Any:
    """The abstract arrays of `tree` (model order) as they rest in pipeline order."""
    return _under_layers(tree, lambda a: jax.ShapeDtypeStruct((split.rows, *a.shape[1:]), a.dtype), split.layers)


# ------------------------------------------------ the two orders as a collective, for checkpoints
#
# Sharded over `stage`, the two orders put different chunks on a device: in pipeline order
# device s holds chunks s, s + p, ...; in model order chunks s*v ... s*v + v-1. The partitioner
# cannot express that permutation between contiguous shards and gathers the whole stack on
# every device; here each chunk that changes device moves once, point to point.


def _home_in_pipeline_order(chunk: int, p: int, v: int) -> tuple[int, int]:
    """(device, slot among its v chunks) of chunk `chunk` (a virtual stage) in pipeline order."""
    return chunk % p, chunk // p


def _home_in_model_order(chunk: int, p: int, v: int) -> tuple[int, int]:
    return chunk // v, chunk % v


@dataclasses.dataclass(frozen=True)
class Round:
    """One collective permute: device d sends its chunk at slot `send[d]` to device `to[d]`,
    which keeps it at slot `keep_at[to[d]]`. `to` is a permutation of the devices."""

    send: tuple[int, ...]
    to: tuple[int, ...]
    keep_at: tuple[int, ...]


@functools.cache
def relayout_rounds(p: int, v: int, to: str) -> tuple[Round, ...]:
    """The moves that take every chunk from its home in one order to its home in the other
    (`to`: "model" or "pipeline") as v rounds in which every device sends one chunk and
    receives one: the chunk moves form a v-regular bipartite multigraph between devices,
    which splits into v perfect matchings (Hall), found here by augmenting paths."""
    homes = (_home_in_pipeline_order, _home_in_model_order)
    source, dest = homes if to == "model" else homes[::-1]
    device_of = lambda chunk: source(chunk, p, v)[0]  # noqa: E731
    target_of = lambda chunk: dest(chunk, p, v)[0]  # noqa: E731
    pending = {d: [c for c in range(p * v) if device_of(c) == d] for d in range(p)}
    rounds = []
    for _ in range(v):
        matched: dict[int, int] = {}  # target device -> the chunk it receives this round
        for d in range(p):
            if not _augment(d, pending, matched, set(), device_of, target_of):
                raise AssertionError(f"no perfect matching in round {len(rounds)} of p={p}, v={v}")
        sent = {device_of(c): c for c in matched.values()}
        rounds.append(Round(send=tuple(source(sent[d], p, v)[1] for d in range(p)),
                            to=tuple(target_of(sent[d]) for d in range(p)),
                            keep_at=tuple(dest(matched[d], p, v)[1] for d in range(p))))
        for c in matched.values():
            pending[device_of(c)].remove(c)
    return tuple(rounds)


def _augment(device: int, pending: dict, matched: dict, seen: set, device_of: Callable, target_of: Callable) -> bool:
    """Kuhn's augmenting path: match one of `device`'s pending chunks to a free target,
    re-matching earlier choices where that frees one."""
    for chunk in pending[device]:
        target = target_of(chunk)
        if target in seen:
            continue
        seen.add(target)
        if target not in matched or _augment(device_of(matched[target]), pending, matched, seen, device_of, target_of):
            matched[target] = chunk
            return True
    return False


def _relayout_blocks(blocks: list[jax.Array], rounds: tuple[Round, ...]) -> list[jax.Array]:
    """Inside a shard_map over `stage`: each of this device's blocks ([v * n, ...] rows of a
    stack) in the other order. A chunk that stays on its device is not sent."""
    v, p = len(rounds), len(rounds[0].to)
    me = jax.lax.axis_index(STAGE)
    sent_slot = jnp.asarray([r.send for r in rounds])[:, me]
    kept = jnp.asarray([[s == d for s, d in enumerate(r.to)] for r in rounds])[:, me]  # sent to itself (`to` permutes)
    filled_by = [[0] * v for _ in range(p)]  # [device][slot] -> the round that brings its chunk
    for i, r in enumerate(rounds):
        for d, slot in enumerate(r.keep_at):
            filled_by[d][slot] = i
    order = jnp.asarray(filled_by)[me]
    out = []
    for x in blocks:
        chunks = x.reshape(v, x.shape[0] // v, *x.shape[1:])
        received = []
        for i, r in enumerate(rounds):
            piece = jax.lax.dynamic_index_in_dim(chunks, sent_slot[i], keepdims=False)
            moves = [(s, d) for s, d in enumerate(r.to) if s != d]
            got = jax.lax.ppermute(piece, STAGE, moves) if moves else piece
            received.append(jnp.where(kept[i], piece, got))
        out.append(jnp.take(jnp.stack(received), order, axis=0, mode="clip").reshape(x.shape))
    return out


def relaid_layers(tree: Any, shardings: Any, p: int, v: int, to: str) -> Any:
    """`in_model_order` (to="model") or `in_pipeline_order` (to="pipeline") of `tree`, whose
    arrays are laid out by `shardings` (a tree of NamedShardings like it), moving chunks
    between stages with collective permutes instead of gathering the stack. An array whose
    layer axis is not sharded over `stage` (replicated: every device has every chunk) gets
    the plain reorder, which needs no communication then."""
    even = StageSplit(p, v, (1,) * (p * v))  # the plain reorders of equal chunks, whatever their size
    plain = {"model": even.to_model_order, "pipeline": even.to_pipeline_order}[to]
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    placed = treedef.flatten_up_to(shardings)
    out = [x for _, x in leaves]
    moving = []  # (index, sharding) of the stacks sharded over `stage`, moved by one shard_map below
    for i, ((path, x), sharding) in enumerate(zip(leaves, placed)):
        if not (_in_layers(path) and getattr(x, "ndim", 0) and x.shape[0] % (p * v) == 0):  # equal chunks of a stack
            continue
        if tuple(sharding.spec)[:1] in ((STAGE,), ((STAGE,),)):
            moving.append((i, sharding))
        else:
            out[i] = plain(x)
    if moving:
        blocks = [_on_device(out[i], sharding) for i, sharding in moving]
        specs = [sharding.spec for _, sharding in moving]
        body = functools.partial(_relayout_blocks, rounds=relayout_rounds(p, v, to))
        moved = jax.shard_map(body, mesh=moving[0][1].mesh, in_specs=(specs,), out_specs=specs, check_vma=False)(blocks)
        for (i, _), x in zip(moving, moved):
            out[i] = x
    return jax.tree_util.tree_unflatten(treedef, out)


def _on_device(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Offloaded optimizer state is moved on the device (the jit puts it back)."""
    return x if sharding.memory_kind in (None, "device") else jax.device_put(x, sharding.with_memory_kind("device"))


# ------------------------------------------------ uneven stages: the model order's own layout
#
# Stages of different sizes rest padded ([rows] in pipeline order, sharded over `stage`);
# in model order the stack has `layers` rows, which `stage` need not divide. There the layer
# axis stays whole and `stage` moves onto another dimension of each leaf, so a device holds
# 1/p of every layer, as many bytes as its stage's share: checkpoints are written and read in
# that layout, the move between the two an all-to-all within `stage` and a local gather.


def model_layout(sharding: NamedSharding, shape: tuple[int, ...], p: int) -> NamedSharding:
    """Where a stacked leaf of `shape` (model order) rests when `stage` cannot shard its layer
    axis: `stage` on the dimension it divides that leaves the largest shard, else on none
    (replicated over `stage`: per-layer scalars, tiny)."""
    mesh = sharding.mesh
    axes = lambda entry: () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)  # noqa: E731
    spec = [axes(e) for e in tuple(sharding.spec)] + [()] * (len(shape) - len(tuple(sharding.spec)))
    spec[0] = tuple(a for a in spec[0] if a != STAGE)
    shards = lambda d: int(np.prod([mesh.shape[a] for a in spec[d]]))  # noqa: E731
    fits = [d for d in range(1, len(shape)) if shape[d] % (shards(d) * p) == 0]
    if fits:
        d = max(fits, key=lambda d: shape[d] // shards(d))
        spec[d] = (*spec[d], STAGE)
    return NamedSharding(mesh, P(*[e if e else None for e in spec]))


def model_layout_state(abstract: Any, split: StageSplit) -> Any:
    """`abstract` (ShapeDtypeStructs with shardings, as the state rests) as it is in model
    order: the stacked leaves [layers, ...] in `model_layout`."""
    def leaf(path, a):
        if not _stacked_layers(path, a, split.rows):
            return a
        shape = (split.layers, *a.shape[1:])
        return jax.ShapeDtypeStruct(shape, a.dtype, sharding=model_layout(a.sharding, shape, split.p))
    return jax.tree_util.tree_map_with_path(leaf, abstract)


def to_model_layout(tree: Any, shardings: Any, split: StageSplit) -> Any:
    """Inside jit: `tree` (as it rests, laid out by `shardings`) in model order and layout:
    each stacked leaf resharded to the model layout at its padded size (an all-to-all over
    `stage`), then its rows gathered where they now all are."""
    def leaf(path, x, sharding):
        if not _stacked_layers(path, x, split.rows):
            return x
        target = model_layout(sharding, (split.layers, *x.shape[1:]), split.p)
        x = jax.lax.with_sharding_constraint(_on_device(x, sharding), target)
        return jax.lax.with_sharding_constraint(split.to_model_order(x), target)
    return jax.tree_util.tree_map_with_path(leaf, tree, shardings)


def from_model_layout(tree: Any, shardings: Any, split: StageSplit) -> Any:
    """The inverse of `to_model_layout`: padded into pipeline order where the rows are, then
    resharded to `shardings` (the jit's out_shardings)."""
    def leaf(path, x, sharding):
        if not _stacked_layers(path, x, split.layers):
            return x
        x = split.to_pipeline_order(x)
        return jax.lax.with_sharding_constraint(x, model_layout(sharding, (split.layers, *x.shape[1:]), split.p))
    return jax.tree_util.tree_map_with_path(leaf, tree, shardings)


def layers_mover(shardings: Any, split: StageSplit, to: str) -> Callable[[Any], Any] | None:
    """The jitted move of a tree laid out by `shardings` (as it rests) to model order
    (`to="model"`) or back (`to="pipeline"`); None where the two coincide (equal stages of
    one chunk each). Stages of one size swap chunks point to point (`relaid_layers`); of
    several, the model order has its own layout (`model_layout`), the jit's output taking it
    from the body. Moved back, the tree is donated (it is the mover's to reuse)."""
    if split.even and split.v == 1:
        return None
    if not split.even:
        move = to_model_layout if to == "model" else from_model_layout
        return jax.jit(functools.partial(move, shardings=shardings, split=split),
                       out_shardings=shardings if to == "pipeline" else None)
    return jax.jit(functools.partial(relaid_layers, shardings=shardings, p=split.p, v=split.v, to=to),
                   out_shardings=shardings, donate_argnums=(0,) if to == "pipeline" else ())


Score = Callable[[Callable[[Any], Any], Any, dict], tuple]  # (output, hidden, microbatch) -> (loss sum, weight)


def model_stages(graphdef: nnx.GraphDef, score: Score) -> Stages:
    """Stages of any model that implements jaxpar.model.PipelineStages, scored on the last
    stage by `score(model.output, hidden, microbatch) -> (loss sum, weight)` (the output
    passed uncalled, so a loss may run it in pieces: jaxpar.step.loss.chunked_task_loss),
    with the report of the layers (an empty one where `apply_layers` returns x alone, not
    (x, report)), plus the module's `output_report(hidden, microbatch)` where it has one."""

    def model(chunk: Any, other: dict, frozen: tuple | None):
        """`frozen`: (the chunk's frozen layers, the other frozen weights), LoRA's base."""
        return nnx.merge(graphdef, join_layers(chunk, other), *([join_layers(*frozen)] if frozen else []))

    def layers(net, x, mb):
        out = net.apply_layers(x, mb)
        return out if isinstance(out, tuple) else (out, no_report())

    def first(chunk, other, mb, frozen=None):
        net = model(chunk, other, frozen)
        return layers(net, net.embed(mb), mb)

    def mid(chunk, other, x, mb, frozen=None):
        return layers(model(chunk, other, frozen), x, mb)

    def last(chunk, other, x, mb, frozen=None):
        net = model(chunk, other, frozen)
        x, report = layers(net, x, mb)
        extra = getattr(net, "output_report", lambda x, mb: None)(x, mb)  # the module's own terms at the end
        return (*score(net.output, x, mb), report if extra is None else _plus(report, extra))

    return Stages(first, mid, last, aux=True)


def _plus(report: dict, extra: dict) -> dict:
    """A chunk's report with what `output_report` adds on the last stage: its loss, and its
    token metrics' sums (keys `apply_layers` already reports, so every stage's report has
    one structure)."""
    metrics = dict(report["sums"].get("token_metrics", {}))
    for name, value in extra.get("sums", {}).get("token_metrics", {}).items():
        metrics[name] = metrics[name] + value
    return {**report, "loss": report["loss"] + extra["loss"], "sums": {**report["sums"], "token_metrics": metrics}}
