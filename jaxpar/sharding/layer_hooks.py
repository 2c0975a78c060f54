"""Hooks on a layer stack's parameters, applied one layer at a time inside the layer scan.

A hook is a function (one layer's slice of a stacked parameter, that layer's slice of some
state stacked beside it) -> the slice the layer computes with. `jaxpar.nn.scan_layers`
scans the state beside the parameters and applies the hook in its loop body, so whatever
the hook's custom VJP does to the gradient runs inside the backward loop, one layer at a
time: where a GPU overlaps it with the layers still to go (gradient compression,
jaxpar.step.compressed).

The trainer binds hooks to the arrays a model will hold (`use_layer_hooks`, inside the
function it differentiates): a stacked parameter is recognised by the identity of the
array, which nnx.merge and nnx.split pass through unchanged. A model that runs its stack
some other way takes no hook, and its caller sees that in `LayerHooks.taken` (a trace with
`jax.eval_shape` finds out before anything compiles).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

import jax

Hook = Callable[[jax.Array, Any], jax.Array]


@dataclasses.dataclass
class LayerHooks:
    """Parameter path -> hook, and how often each path's array has been taken by a scan
    (counted across every trace, so a probe reads it afterwards)."""

    hooks: dict[str, Hook]
    taken: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def bind(self, params: Any, state: dict[str, Any]) -> _Bound:
        """The hooks of one trace: each path in `state` bound to the array `params` holds
        there (a pure-dict tree, its paths joined with '.')."""
        flat, _ = jax.tree_util.tree_flatten_with_path(params)
        by_id = {}
        for path, leaf in flat:
            name = jax.tree_util.keystr(path, simple=True, separator=".")
            if name in state:
                by_id[id(leaf)] = (name, state[name], self.hooks[name])
        return _Bound(self, by_id)


@dataclasses.dataclass
class _Bound:
    owner: LayerHooks
    by_id: dict[int, tuple[str, Any, Hook]]

    def take(self, leaf: Any) -> tuple[Any, Hook] | None:
        """(stacked state, hook) for a stacked parameter a scan is about to run, or None."""
        found = self.by_id.get(id(leaf))
        if found is None:
            return None
        name, state, hook = found
        self.owner.taken[name] += 1
        return state, hook


_ACTIVE: contextvars.ContextVar[_Bound | None] = contextvars.ContextVar("jaxpar_layer_hooks", default=None)


@contextlib.contextmanager
def use_layer_hooks(bound: _Bound | None) -> Iterator[None]:
    token = _ACTIVE.set(bound)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def take_layer_hooks(leaves: list) -> tuple[list, list]:
    """For a scan over stacked `leaves`: (the state to scan beside each, None where it has
    none; the hook to apply to each slice, None where none)."""
    bound = _ACTIVE.get()
    found = [bound.take(leaf) if bound is not None else None for leaf in leaves]
    return [f[0] if f else None for f in found], [f[1] if f else None for f in found]
