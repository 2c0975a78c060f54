"""Muon for a sharded model (`optim.name=muon`): which parameters are matrices, and the
optax transformation that orthogonalises their updates whole under any layout.

The update rule is Moonlight's (Liu et al. 2025, "Muon is Scalable for LLM Training"), the
form Kimi K2 and GLM-4.5 trained with. For a matrix W with gradient G:

    M <- mu M + G                          (optim.momentum)
    U  = G + mu M  (Nesterov), else M      (optim.nesterov)
    O  = NewtonSchulz(U)                   (optim.ns_steps, ns_dtype; jaxpar.kernels.newton_schulz)
    W <- W - lr (s O + wd W)               (optim.weight_decay)

with s = optim.muon_rms x sqrt(max(rows, cols)) ("rms", Moonlight's: the update's RMS near
AdamW's, so the two share one learning rate) or sqrt(max(1, cols / rows)) ("shape", Keller
Jordan's). Everything that is not a matrix (the embedding and head, norms, biases, routers'
biases) takes AdamW at the same learning rate, as Moonlight and K2 do.

optax's `contrib.muon` averages its momentum (M <- mu M + (1 - mu) G) and corrects its bias.
Without Nesterov the two momenta are proportional and the Newton-Schulz step normalises the
scale away, so the updates agree (tests/equivalence/test_muon.py). With Nesterov optax corrects G's and
M's bias by different factors, which moves the direction: there the two differ.

Which parameters are matrices comes from their logical names, so a user's model needs no
Muon-specific code: dims named by the model's `stack_axes` (default "layers", "experts":
jaxpar.model) index a stack of matrices; a parameter with two or more other dims and no
"vocab" dim is a matrix, its input side its first such dim (or all but the last, when only
the last is "embed": an output projection). The model's `not_matrices` names parameters
that have two dims but are no matrix (Qwen2's q/k/v biases, heads x head_dim).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.newton_schulz import (Iteration, MatrixAxes, orthogonalize, orthogonalize_together, parse_coeffs,
                                         share_key)
from jaxpar.model import declared

DEFAULT_STACK_AXES = ("layers", "experts")
SCOPE = "muon_orthogonalize"  # the name stack of the orthogonalisation's ops (jaxpar.inspect.optimizer)


@dataclasses.dataclass(frozen=True)
class Matrix:
    """One parameter Muon updates: how it is a stack of matrices, and where its optimizer
    state rests (None: on one device)."""

    axes: MatrixAxes
    spec: P | None = None
    mesh: Mesh | None = None
    held: tuple[str, ...] = ()  # mesh axes a vmap holds different values over (DiLoCo's groups)


Matrices = dict[str, Matrix]  # by the parameter's dotted path ("layers.attn.wq")


def matrix_axes(names: tuple[str | None, ...], stack_axes: tuple[str, ...]) -> MatrixAxes | None:
    """How a parameter with logical `names` is a stack of matrices, or None when it is no
    matrix (the module docstring's rule)."""
    batch = tuple(d for d, n in enumerate(names) if n in stack_axes)
    rest = [d for d in range(len(names)) if d not in batch]
    if len(rest) < 2 or "vocab" in names:
        return None
    if names[rest[-1]] == "embed" and names[rest[0]] != "embed":  # an output projection: (heads, head_dim) -> embed
        return MatrixAxes(batch, tuple(rest[:-1]), (rest[-1],))
    return MatrixAxes(batch, (rest[0],), tuple(rest[1:]))


def find_matrices(model: Any, names: Any, shardings: Any | None = None, held: tuple[str, ...] = ()) -> Matrices:
    """Every matrix parameter of a model config, by path: `names` the tree of
    jaxpar.sharding.ParamNames, `shardings` the optimizer state's NamedShardings (None: one
    device); `held`: mesh axes the update is vmapped over (DiLoCo's groups on `data`)."""
    from jaxpar.sharding import ParamNames

    stack_axes = declared(model, "stack_axes") or DEFAULT_STACK_AXES
    skipped = declared(model, "not_matrices") or ()
    is_names = lambda x: isinstance(x, ParamNames)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(names, is_leaf=is_names)[0]
    placed = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding)) if shardings else [None] * len(flat)
    found = {}
    for (path, leaf), sharding in zip(flat, placed):
        where = path_of(path)
        axes = matrix_axes(leaf.names, stack_axes)
        if axes is None or any(fnmatch.fnmatchcase(where, pattern) for pattern in skipped):
            continue
        found[where] = Matrix(axes, sharding.spec if sharding else None, sharding.mesh if sharding else None, held)
    return found


@functools.lru_cache(maxsize=8)
def model_matrices(model: Any) -> tuple[tuple[tuple[int, ...], MatrixAxes, tuple[str | None, ...]], ...]:
    """(shape, axes, logical names) of every matrix parameter of a model config, from its
    abstract parameters (nothing allocated): what the planner prices Muon by."""
    from flax import nnx

    from jaxpar.sharding import param_names

    with nnx.use_eager_sharding(False):
        abstract = nnx.state(nnx.eval_shape(lambda: model.build(nnx.Rngs(0))))
    names = param_names(abstract)
    shapes = {path_of(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract))[0]}
    logical = {path_of(p): n.names for p, n in jax.tree_util.tree_flatten_with_path(
        names, is_leaf=lambda x: hasattr(x, "names"))[0]}
    return tuple((shapes[path], m.axes, logical[path]) for path, m in find_matrices(model, names).items())


def path_of(path: tuple) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


class MuonState(NamedTuple):
    momentum: Any  # float32, one per matrix, sharded as the parameter's optimizer state


def scale_by_muon(matrices: Matrices, momentum: float = 0.95, nesterov: bool = True, iteration: Iteration = Iteration(),
                  scale: str = "rms", rms: float = 0.2) -> optax.GradientTransformation:
    """Momentum, Newton-Schulz and the shape scale of the module docstring, on the leaves
    `matrices` names (optax.partition hands it only those)."""

    def init(params: Any) -> MuonState:
        return MuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def update(updates: Any, state: MuonState, params: Any = None) -> tuple[Any, MuonState]:
        del params
        kept = jax.tree.map(lambda m, g: momentum * m + g.astype(jnp.float32), state.momentum, updates)
        used = jax.tree.map(lambda m, g: g.astype(jnp.float32) + momentum * m, kept, updates) if nesterov else kept
        flat, tree = jax.tree_util.tree_flatten_with_path(used)
        paths = [path_of(p) for p, _ in flat]
        with jax.named_scope(SCOPE):  # explain finds the orthogonalisation's collectives and FLOPs by it
            done = orthogonalized(matrices, dict(zip(paths, (u for _, u in flat))), iteration)
        scaled = [_shape_scale(matrices[p].axes.shape(done[p].shape), scale, rms) * done[p] for p in paths]
        out = jax.tree_util.tree_unflatten(tree, scaled)
        return jax.tree.map(lambda o, g: o.astype(g.dtype), out, updates), MuonState(kept)

    return optax.GradientTransformation(init, update)


def _shape_scale(sides: tuple[int, int], scale: str, rms: float) -> float:
    rows, cols = sides
    return rms * max(rows, cols) ** 0.5 if scale == "rms" else max(1.0, cols / rows) ** 0.5


def orthogonalized(matrices: Matrices, updates: dict[str, jax.Array], iteration: Iteration) -> dict[str, jax.Array]:
    """Each update (by path) orthogonalised: on one device one parameter at a time (the
    reference); sharded, the parameters of one share group together (`share_groups`)."""
    done = {p: orthogonalize(u, matrices[p].axes, iteration) for p, u in updates.items() if _local(matrices[p])}
    for group in share_groups(matrices, {p: u.shape for p, u in updates.items() if p not in done}):
        first = matrices[group[0]]
        outs = orthogonalize_together([updates[p] for p in group], [matrices[p].axes for p in group],
                                      [matrices[p].spec for p in group], first.mesh, iteration, first.held)
        done.update(zip(group, outs))
    return done


def share_groups(matrices: Matrices, shapes: dict[str, tuple[int, ...]]) -> list[list[str]]:
    """The sharded parameters of `shapes` (by path) grouped by their share_key, in order:
    each group is orthogonalised as one stack (jaxpar.kernels.newton_schulz)."""
    groups: dict[tuple, list[str]] = {}
    for path, shape in shapes.items():
        m = matrices[path]
        if not _local(m):
            groups.setdefault(share_key(shape, m.axes, m.spec, m.mesh, m.held), []).append(path)
    return list(groups.values())


def _local(m: Matrix) -> bool:
    return m.mesh is None or m.mesh.size == 1


def iteration_of(optim: Any) -> Iteration:
    """The Newton-Schulz settings of a jaxpar.config.OptimConfig."""
    return Iteration(optim.ns_steps, parse_coeffs(optim.ns_coeffs), dtype=optim.ns_dtype)


def muon(lr: optax.ScalarOrSchedule, optim: Any, matrices: Matrices) -> optax.GradientTransformation:
    """Muon on `matrices`, AdamW on every other parameter, at one learning rate (the module
    docstring); `optim` a jaxpar.config.OptimConfig."""

    def labels(params: Any) -> Any:
        return jax.tree_util.tree_map_with_path(lambda p, _: "muon" if path_of(p) in matrices else "adamw", params)

    rule = optax.chain(
        scale_by_muon(matrices, optim.momentum, optim.nesterov, iteration_of(optim), optim.muon_scale, optim.muon_rms),
        optax.add_decayed_weights(optim.weight_decay),
        optax.scale_by_learning_rate(lr),
    )
    adamw = optax.adamw(lr, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay)
    return optax.partition({"muon": rule, "adamw": adamw}, labels)
