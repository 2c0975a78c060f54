"""Expert parallelism: tokens to the devices holding their experts and back, by all-to-all
inside `jax.shard_map`.

Each device routes the tokens it holds, then

  capacity   packs them into a buffer [E, groups x C, D] (C slots per expert per sequence,
             jaxpar.kernels.experts.slots), all-to-all over the expert axes turns it into
             [E/n, n x groups x C, D] for its own experts, which run as one batched matmul
             each; a second all-to-all returns the outputs.
  dropless   sorts its (token, choice) pairs by expert and sends each expert device its
             run of them. Runs differ in length; the CPU backend has no ragged all-to-all,
             so each device sends a buffer sized for the worst case (every pair to one
             device: n x T x k rows received) and the receiver regroups by expert for
             `jax.lax.ragged_dot`. Nothing is dropped, and the results equal the ragged
             exchange's.

The expert computation is the caller's: `ffn(weights, x)` with x [E_local, C, D]
(capacity) or `ffn(weights, x, group_sizes)` with x [M, D] grouped by expert, rows past
the groups zero (dropless). Its output is a partial sum over `reduce_axes` (tensor
parallelism inside the experts) that the kernel completes.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.kernels.experts.slots import capacity_slots, expert_capacity

ROUTINGS = ("capacity", "dropless")


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """Where things live and how tokens are routed.

    token_spec     x [B, S, D] (D unsharded); expert ids and gates [B, S, K] follow B and S
    weight_specs   one per expert weight, each [E, ...] with E over `axis`
    axis           the expert-parallel mesh axes (empty: every device holds every expert)
    reduce_axes    mesh axes the ffn's output is a partial sum over
    """

    mesh: Mesh
    token_spec: P
    weight_specs: tuple[P, ...]
    axis: tuple[str, ...]
    reduce_axes: tuple[str, ...] = ()
    routing: str = "capacity"
    capacity_factor: float = 1.25

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r}; use one of {', '.join(ROUTINGS)}")
        object.__setattr__(self, "token_spec", P(*self.token_spec, *(None,) * (3 - len(self.token_spec))))

    @property
    def degree(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axis)

    @property
    def pair_spec(self) -> P:
        return P(self.token_spec[0], self.token_spec[1], None)


def expert_parallel(x_BSD, expert_ids_BSK, gates_BSK, weights, ffn: Callable, spec: ExpertSpec):
    """y [B, S, D] = sum over each token's kept choices of gate x expert(token), and the
    kept mask [B, S, K]. Differentiable (all-to-all transposes to all-to-all)."""
    if spec.routing == "capacity" and spec.token_spec[1] is not None:
        raise ValueError(
            f"capacity routing groups whole sequences, but the sequence is sharded over {spec.token_spec[1]}; "
            "use dropless routing"
        )

    @partial(
        jax.shard_map,
        mesh=spec.mesh,
        in_specs=(spec.token_spec, spec.pair_spec, spec.pair_spec, spec.weight_specs),
        out_specs=(spec.token_spec, spec.pair_spec),
        check_vma=False,
    )
    def body(x, ids, gates, weights):
        return local_experts(x, ids, gates, weights, ffn, spec.routing, spec.capacity_factor,
                             spec.axis if spec.degree > 1 else (), spec.reduce_axes, weights[0].shape[0] * spec.degree)

    return body(x_BSD, expert_ids_BSK, gates_BSK, tuple(weights))


def local_experts(x_BSD, ids_BSK, gates_BSK, weights, ffn, routing: str, capacity_factor: float,
                  axis: tuple[str, ...] = (), reduce_axes: tuple[str, ...] = (), num_experts: int | None = None):
    """One device's part (or the whole computation, with no axes): route, exchange over
    `axis`, run the local experts, exchange back, combine."""
    num_experts = weights[0].shape[0] if num_experts is None else num_experts
    b, s, d = x_BSD.shape
    k = ids_BSK.shape[-1]
    if routing == "capacity":
        cap = expert_capacity(capacity_factor, s, k, num_experts)
        slots = jax.vmap(lambda e, g: capacity_slots(e, g, num_experts, cap))(ids_BSK, gates_BSK)
        kept = slots >= 0
        y_pairs = _capacity_exchange(x_BSD, ids_BSK, slots, cap, weights, ffn, axis, reduce_axes, num_experts)
    else:
        kept = jnp.ones(ids_BSK.shape, bool)
        y_pairs = _dropless_exchange(x_BSD, ids_BSK, weights, ffn, axis, reduce_axes, num_experts)
    gates = jnp.where(kept, gates_BSK, 0).astype(jnp.float32)
    y = jnp.einsum("bskd,bsk->bsd", y_pairs.astype(jnp.float32), gates)
    return y.astype(x_BSD.dtype), kept


def _capacity_exchange(x_BSD, ids_BSK, slots_BSK, cap, weights, ffn, axis, reduce_axes, num_experts):
    """Outputs [B, S, K, D] of each pair's expert (zero where dropped)."""
    b, s, d = x_BSD.shape
    k = ids_BSK.shape[-1]
    rows = jnp.arange(b)[:, None, None]
    where = jnp.where(slots_BSK >= 0, rows * cap + slots_BSK, b * cap)  # past the end: dropped
    pairs = jnp.broadcast_to(x_BSD[:, :, None, :], (b, s, k, d))
    buf = jnp.zeros((num_experts, b * cap, d), x_BSD.dtype).at[ids_BSK, where].add(pairs, mode="drop")
    if axis:
        buf = jax.lax.all_to_all(buf, axis, 0, 1, tiled=True)  # [E/n, n x b x C, D]: my experts, every sender
    out = ffn(weights, buf)
    if reduce_axes:
        out = jax.lax.psum(out, reduce_axes)
    if axis:
        out = jax.lax.all_to_all(out, axis, 1, 0, tiled=True)  # back: [E, b x C, D]
    return out.at[ids_BSK, where].get(mode="fill", fill_value=0)


def _dropless_exchange(x_BSD, ids_BSK, weights, ffn, axis, reduce_axes, num_experts):
    b, s, d = x_BSD.shape
    k = ids_BSK.shape[-1]
    pairs = b * s * k
    ids = ids_BSK.reshape(pairs)
    order = jnp.argsort(ids, stable=True)  # pairs grouped by expert
    x_sorted = x_BSD.reshape(b * s, d)[order // k]
    counts = jnp.bincount(ids, length=num_experts).astype(jnp.int32)
    if not axis:
        y_sorted = _reduced(ffn(weights, x_sorted, counts), reduce_axes)
    else:
        y_sorted = _padded_exchange(x_sorted, jnp.sort(ids), counts, weights, ffn, axis, reduce_axes)
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(b, s, k, d)


def _reduced(out, reduce_axes):
    return jax.lax.psum(out, reduce_axes) if reduce_axes else out


def _padded_exchange(x_sorted, ids_sorted, counts, weights, ffn, axis, reduce_axes):
    """Rows [P, D] sorted by expert -> their experts' outputs, same order. Device d gets the
    rows of experts [d x E_local, (d+1) x E_local): a contiguous run, sent in a P-row buffer."""
    pairs, d = x_sorted.shape
    local = weights[0].shape[0]  # experts on this device
    n = counts.shape[0] // local
    per_device = counts.reshape(n, local).sum(1)
    starts = jnp.cumsum(per_device) - per_device
    j = jnp.arange(pairs)
    take = starts[:, None] + j[None, :]  # [n, P]
    valid = j[None, :] < per_device[:, None]
    send = jnp.where(valid[..., None], x_sorted[jnp.minimum(take, pairs - 1)], 0)
    recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)  # [n senders, P, D]
    recv_counts = jax.lax.all_to_all(counts.reshape(n, local), axis, 0, 0, tiled=True)  # [n senders, E_local]
    # Each sender's rows arrive sorted by my local experts; regroup all of them by expert.
    ends = jnp.cumsum(recv_counts, axis=1)
    expert_of_row = jax.vmap(lambda e: jnp.searchsorted(e, j, side="right"))(ends)  # [n, P]; `local` = padding
    regroup = jnp.argsort(expert_of_row.reshape(-1), stable=True)
    out = ffn(weights, recv.reshape(n * pairs, d)[regroup], recv_counts.sum(0))
    out = _reduced(out, reduce_axes)
    out = jnp.zeros_like(out).at[regroup].set(out).reshape(n, pairs, d)
    back = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)  # [n receivers, P, D]
    device = ids_sorted // local
    return back[device, j - starts[device]]
