"""Turning logical names into shardings: parameters by their Flax NNX annotations,
activations by `constrain` calls inside the model.

Models only *name* axes; which mesh axes those names land on is the active `Layout`'s
business. The layout is entered once, around tracing of the step (`with use_layout(layout):`), so model
code stays free of meshes and rules, and is the identity when no layout is active.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Iterator, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.mesh import divisors
from jaxpar.sharding.rules import Rules

_ACTIVE: contextvars.ContextVar["Layout | None"] = contextvars.ContextVar("jaxpar_layout", default=None)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and the rules that place logical names on it."""

    mesh: Mesh
    rules: Rules

    def sharding(self, names: Sequence[str | None], kind: str = "compute") -> NamedSharding:
        return NamedSharding(self.mesh, self.rules.spec(names, kind))



@contextlib.contextmanager
def use_layout(layout: Layout | None) -> Iterator[Layout | None]:
    """Make `layout` the one `constrain` and `compute_value` apply, for the duration."""
    token = _ACTIVE.set(layout)
    try:
        yield layout
    finally:
        _ACTIVE.reset(token)


def active_layout() -> Layout | None:
    return _ACTIVE.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout to the compute rules of the active layout (no-op without one)."""
    layout = _ACTIVE.get()
    if layout is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of rank {x.ndim}")
    return jax.lax.with_sharding_constraint(x, layout.sharding(names, "compute"))


def logical_names(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The names an NNX variable was annotated with (`nnx.with_partitioning`), or all None."""
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names else (None,) * len(variable.shape)


def compute_value(param: nnx.Variable) -> jax.Array:
    """A parameter's value laid out for use: FSDP shards are gathered here, at the point of
    use (so inside a scanned layer stack, one layer at a time); tensor shards stay put.

    Inside `scan_layers` a stacked parameter arrives one layer at a time while its names
    still include the stacked axis: the leading surplus names are dropped.
    """
    value = param[...]
    names = logical_names(param)
    return constrain(value, names[len(names) - value.ndim :])


def param_names(abstract_state: nnx.State) -> dict:
    """Pure-dict tree (the shape of `nnx.to_pure_dict`) of each parameter's logical names."""
    out: dict = {}
    for path, variable in nnx.to_flat_state(abstract_state):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _Names(logical_names(variable))
    return out


@dataclasses.dataclass(frozen=True)
class _Names:
    """A leaf holding a tuple of names (tuples themselves are pytree nodes)."""

    names: tuple[str | None, ...]




def shardings_for(tree_names: Any, shapes: Any, layout: Layout, kind: str = "storage", where: str = "param") -> Any:
    """NamedShardings for a tree of arrays (or ShapeDtypeStructs) given their logical names.

    Checks divisibility up front: a dimension that its mesh axes do not divide raises a
    ConfigError naming the array, the dimension and the sizes that would work.
    """

    def one(path, names: _Names, shape) -> NamedSharding:
        spec = layout.rules.spec(names.names, kind)
        check_divisible(jax.tree_util.keystr(path), shape.shape, names.names, spec, layout.mesh, where)
        return NamedSharding(layout.mesh, spec)

    return jax.tree_util.tree_map_with_path(one, tree_names, shapes, is_leaf=lambda x: isinstance(x, _Names))


def check_divisible(
    path: str, shape: Sequence[int], names: Sequence[str | None], spec: P, mesh: Mesh, where: str
) -> None:
    for dim, (size, name, axes) in enumerate(zip(shape, names, tuple(spec) + (None,) * len(shape))):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        degree = math.prod(mesh.shape[a] for a in axes)
        if size % degree:
            raise ConfigError(
                f"{where} {path}: dimension {dim} ('{name}') has size {size}, which mesh "
                f"{'x'.join(axes)}={degree} does not divide; use a degree in "
                f"{divisors(size)} or change the rules for '{name}'"
            )
