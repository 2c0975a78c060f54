"""The key/value cache sampling runs a model with, entered around tracing as a layout is.

Under `caching(...)` every `attend` a model makes writes its new keys and values into a
cache and attends over it (jaxpar.kernels.attention.cached), so a model written for
training samples with a cache unchanged: nothing in it names the cache. The cache is a
list of entries, one per attention call in the order the model makes them; a stack run
by `jaxpar.nn.scan_layers` is one entry whose arrays carry a leading layer axis (the scan
reads and returns one layer's slice a step), and a layer that switches on its kind
(`jaxpar.nn.by_kind`) returns its branch's entries from the switch. Attention inside other
control flow of a model's own (a `lax.cond`) cannot hand its entry out: JAX reports a
leaked tracer.

A call without entries (`given=None`, the prompt's pass) makes them, zeros of the cache's
length written at the prompt's places; later calls (one token a row) read and rewrite them.
Entries are laid out like keys and values (rows over the batch axes, heads over tensor)
with the cache's places unsplit.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.kernels.attention.cached import cached_attention, write
from jaxpar.sharding.annotate import constrain

CACHE_NAMES = ("batch", None, "kv_heads", "head_dim")  # a place is never split: one token a step

_ACTIVE: contextvars.ContextVar[Caching | None] = contextvars.ContextVar("jaxpar_kv_cache", default=None)


@dataclasses.dataclass
class Caching:
    """One traced call's cache: `positions[B, S]` of the tokens it runs (consecutive a row),
    the cache's `length` (places a row), the entries it was `given` (None: make them) and the
    entries it has `made` so far, in the model's order."""

    positions: jax.Array
    length: int
    given: list | None
    made: list = dataclasses.field(default_factory=list)

    def next_given(self) -> Any:
        """The given entry for the model's next attention call (None where entries are made)."""
        if self.given is None:
            return None
        if len(self.made) >= len(self.given):
            raise ValueError(f"kv cache: the model made more attention calls than the {len(self.given)} entries "
                             "its first pass made; a model must attend the same way on every call")
        return self.given[len(self.made)]

    def nested(self, given: Any) -> Caching:
        """A cache for one layer of a stack, or one branch of a switch: the same tokens."""
        return Caching(self.positions, self.length, given)


@contextlib.contextmanager
def caching(positions: jax.Array, length: int, given: list | None) -> Iterator[Caching]:
    """Make a cache the one `attend` reads and writes, for the duration; yields it, to read
    `made` afterwards."""
    cache = Caching(positions, length, given)
    token = _ACTIVE.set(cache)
    try:
        yield cache
    finally:
        _ACTIVE.reset(token)


def active_cache() -> Caching | None:
    return _ACTIVE.get()


def attend_cached(cache: Caching, q_BSHK: jax.Array, k_BSGK: jax.Array, v_BSGV: jax.Array, causal: bool,
                  window: int) -> jax.Array:
    """`attend` under a cache: write k and v at the tokens' places, attend over the cache."""
    if not causal:
        raise ValueError("kv cache: attention that is not causal reads keys after the query, which a cache of "
                         "the tokens so far does not hold; sample without the cache")
    entry = cache.next_given()
    if entry is None:
        b, _, g = k_BSGK.shape[:3]
        entry = tuple(jnp.zeros((b, cache.length, g, x.shape[-1]), x.dtype) for x in (k_BSGK, v_BSGV))
    start = cache.positions[:, 0]
    k_all, v_all = (constrain(write(c, x, start), CACHE_NAMES) for c, x in zip(entry, (k_BSGK, v_BSGV)))
    cache.made.append((k_all, v_all))
    return cached_attention(q_BSHK, k_all, v_all, cache.positions, window)


def run_nested(cache: Caching, given: Any, fn: Callable, *args: Any) -> tuple[Any, list]:
    """(fn(*args), the entries it made) with a cache of its own over `given`: one layer of a
    scanned stack, or one branch of a switch, hands its entries out as an output."""
    token = _ACTIVE.set(cache.nested(given))
    try:
        out = fn(*args)
        return out, _ACTIVE.get().made
    finally:
        _ACTIVE.reset(token)
