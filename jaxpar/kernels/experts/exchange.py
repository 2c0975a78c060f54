"""Expert parallelism: tokens to the devices holding their experts and back, by all-to-all
inside `jax.shard_map`.

Each device routes the tokens it holds, then

  capacity   packs them into a buffer [E, groups x C, D] (C slots per expert per sequence,
             jaxpar.kernels.experts.slots), all-to-all over the expert axes turns it into
             [E/n, n x groups x C, D] for its own experts, which run as one batched matmul
             each; a second all-to-all returns the outputs.
  dropless   sorts its (token, choice) pairs by expert and sends each expert device its
             run of them; the receiver regroups the rows by expert for a grouped matmul.
             Runs differ in length. `exchange` says how they travel:
               ragged   jax.lax.ragged_all_to_all: only the real rows (GPU; the CPU
                        backend has none)
               padded   all_to_all of a buffer per peer sized for the worst case (every
                        pair to one device), on any backend: n x the traffic
               ragged_emulated  the ragged exchange's bookkeeping with its collective built
                        from all_to_all: checks the ragged path where it cannot run
             Either way each device can receive n x T x k rows (T: tokens per device), so
             nothing is dropped; the results are the same.

With group capacity (model.group_capacity: a token takes one slot per group of experts it
chose) and the expert axis over hosts that hold whole groups, capacity routing exchanges in
two hops, a token crossing to a host once per group (jaxpar.kernels.experts.two_hop).

The dispatch (tokens to their experts) carries `dispatch_dtype`: the compute dtype, or
FP8 tiles and their scales (jaxpar.kernels.experts.payload); the combine carries the
compute dtype.

The buffers each all-to-all delivers are named EXCHANGED_NAME, so remat policies can keep
them rather than exchange again (jaxpar.nn). The expert computation is the caller's:
`ffn(weights, x)` with x [E_local, C, D]
(capacity) or `ffn(weights, x, group_sizes)` with x [M, D] grouped by expert, rows past
the groups zero (dropless). Its output is a partial sum over `reduce_axes` (tensor
parallelism inside the experts) that the kernel completes.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Callable, get_args

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.choices import ExpertExchange, Routing
from jaxpar.kernels.experts.combine import placed_rows, weighted_rows
from jaxpar.kernels.experts.payload import dispatched
from jaxpar.kernels.experts.slots import DROPPED, capacity_slots, expert_capacity, group_slots
from jaxpar.kernels.experts.two_hop import two_hop_exchange

ROUTINGS = get_args(Routing)
# The config's exchanges with auto resolved (jaxpar.step.layout), and the emulated
# ragged one, which tests run where ragged_all_to_all is missing.
EXCHANGES = (*(e for e in get_args(ExpertExchange) if e != "auto"), "ragged_emulated")
EXCHANGED_NAME = "expert_exchange"  # the all-to-all outputs, for remat policies to keep


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """Where things live and how tokens are routed.

    token_spec     x [B, S, D] (D unsharded); expert ids and gates [B, S, K] follow B and S
    weight_specs   one per expert weight, each [E, ...] with E over `axis`
    axis           the expert-parallel mesh axes (empty: every device holds every expert)
    reduce_axes    mesh axes the ffn's output is a partial sum over
    dispatch_dtype compute | fp8: what the dispatch moves (jaxpar.kernels.experts.payload)
    group_capacity (groups, top_groups) of group-limited routing whose groups also have a
                   capacity (model.group_capacity), or None
    hosts          hosts the expert axis spans (one axis, devices host-major: jaxpar.mesh)
    manual         those of `axis` the caller is already manual over: the tokens and weights
                   given are the device's own over them
    """

    mesh: Mesh
    token_spec: P
    weight_specs: tuple[P, ...]
    axis: tuple[str, ...]
    reduce_axes: tuple[str, ...] = ()
    routing: str = "capacity"
    capacity_factor: float = 1.25
    exchange: str = "padded"  # dropless only: padded | ragged | ragged_emulated
    dispatch_dtype: str = "compute"
    group_capacity: tuple[int, int] | None = None
    hosts: int = 1
    manual: tuple[str, ...] = ()

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r}; use one of {', '.join(ROUTINGS)}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange={self.exchange!r}; use one of {', '.join(EXCHANGES)}")
        object.__setattr__(self, "token_spec", P(*self.token_spec, *(None,) * (3 - len(self.token_spec))))

    @property
    def degree(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axis)

    @property
    def pair_spec(self) -> P:
        return P(self.token_spec[0], self.token_spec[1], None)


def expert_parallel(x_BSD, expert_ids_BSK, gates_BSK, priority_BSK, weights, ffn: Callable, spec: ExpertSpec):
    """y [B, S, D] = sum over each token's kept choices of gate x expert(token), and the
    kept mask [B, S, K]; `priority` orders the claims on capacity (router probabilities).
    Differentiable (all-to-all transposes to all-to-all)."""
    if spec.routing == "capacity" and spec.token_spec[1] is not None:
        raise ValueError(
            f"capacity routing groups whole sequences, but the sequence is sharded over {spec.token_spec[1]}; "
            "use dropless routing"
        )
    if spec.token_spec[2] is not None:
        raise ValueError(f"the hidden dimension of the tokens must be whole on each device, not sharded over {spec.token_spec[2]}")
    split = math.prod(spec.mesh.shape[a] for a in spec.axis if a not in spec.manual)  # what the shard_map splits
    if weights[0].shape[0] % split:
        raise ValueError(f"{weights[0].shape[0]} experts do not split over expert-parallel degree {split}")

    @partial(
        jax.shard_map,
        mesh=spec.mesh,
        in_specs=(spec.token_spec, spec.pair_spec, spec.pair_spec, spec.pair_spec, spec.weight_specs),
        out_specs=(spec.token_spec, spec.pair_spec),
        check_vma=False,
    )
    def body(x, ids, gates, priority, weights):
        return local_experts(x, ids, gates, priority, weights, ffn, spec.routing, spec.capacity_factor,
                             spec.axis if spec.degree > 1 else (), spec.reduce_axes, weights[0].shape[0] * spec.degree,
                             spec.exchange, spec.dispatch_dtype, spec.group_capacity,
                             spec.hosts if spec.degree > 1 else 1)

    return body(x_BSD, expert_ids_BSK, gates_BSK, priority_BSK, tuple(weights))


def local_experts(x_BSD, ids_BSK, gates_BSK, priority_BSK, weights, ffn, routing: str, capacity_factor: float,
                  axis: tuple[str, ...] = (), reduce_axes: tuple[str, ...] = (), num_experts: int | None = None,
                  exchange: str = "padded", dispatch_dtype: str = "compute",
                  group_capacity: tuple[int, int] | None = None, hosts: int = 1):
    """One device's part (or the whole computation, with no axes): route, exchange over
    `axis`, run the local experts, exchange back, combine."""
    num_experts = weights[0].shape[0] if num_experts is None else num_experts
    b, s, d = x_BSD.shape
    k = ids_BSK.shape[-1]
    if routing == "capacity":
        cap = expert_capacity(capacity_factor, s, k, num_experts)
        slots = jax.vmap(lambda e, p: capacity_slots(e, p, num_experts, cap))(ids_BSK, priority_BSK)
        if group_capacity:
            groups, top_groups = group_capacity
            group_cap = expert_capacity(capacity_factor, s, top_groups, groups)
            claims = jax.vmap(lambda e, p: group_slots(e, p, groups, num_experts, group_cap))(ids_BSK, priority_BSK)
            slots = jnp.where(claims >= 0, slots, DROPPED)
            if two_hops(axis, hosts, groups):
                y = two_hop_exchange(x_BSD, ids_BSK, gates_BSK, slots, claims, cap, group_cap, weights, ffn, axis[0],
                                     hosts, groups, num_experts, reduce_axes, dispatch_dtype, _arrived)
                return y, slots >= 0
        kept = slots >= 0
        rows, index = _capacity_exchange(x_BSD, ids_BSK, slots, cap, weights, ffn, axis, reduce_axes, num_experts,
                                         dispatch_dtype)
    else:
        kept = jnp.ones(ids_BSK.shape, bool)
        rows, index = _dropless_exchange(x_BSD, ids_BSK, weights, ffn, axis, reduce_axes, num_experts, exchange,
                                         dispatch_dtype)
    return weighted_rows(rows, index, jnp.where(kept, gates_BSK, 0), x_BSD.dtype), kept


def two_hops(axis: tuple[str, ...], hosts: int, groups: int) -> bool:
    """Whether group-capacity routing exchanges in two hops: one expert axis over hosts that
    hold whole groups."""
    return len(axis) == 1 and hosts > 1 and groups % hosts == 0


def _capacity_exchange(x_BSD, ids_BSK, slots_BSK, cap, weights, ffn, axis, reduce_axes, num_experts, dispatch_dtype):
    """The experts' output rows [E x b x C, D] and each pair's row [B, S, K] (past the end
    where dropped)."""
    b, s, d = x_BSD.shape
    rows = num_experts * b * cap
    sequence = jnp.arange(b)[:, None, None]
    index = jnp.where(slots_BSK >= 0, ids_BSK * (b * cap) + sequence * cap + slots_BSK, rows)  # past the end: dropped
    buf = placed_rows(x_BSD.reshape(b * s, d), index.reshape(b * s, -1), rows).reshape(num_experts, b * cap, d)
    # [E/n, n x b x C, D]: my experts, every sender
    buf = dispatched(buf, lambda v: jax.lax.all_to_all(v, axis, 0, 1, tiled=True) if axis else v, dtype=dispatch_dtype)
    buf = _arrived(buf) if axis else buf
    out = _reduced(ffn(weights, buf), reduce_axes)
    if axis:
        out = _arrived(jax.lax.all_to_all(out, axis, 1, 0, tiled=True))  # back: [E, b x C, D]
    return out.reshape(rows, d), index


def _arrived(x):
    """An exchanged buffer, named so remat policies can keep it (jaxpar.nn) rather than run
    the all-to-all again in the backward pass."""
    return checkpoint_name(x, EXCHANGED_NAME)


def _dropless_exchange(x_BSD, ids_BSK, weights, ffn, axis, reduce_axes, num_experts, exchange, dispatch_dtype):
    """The experts' output rows [B x S x K, D], sorted by expert, and each pair's row."""
    b, s, d = x_BSD.shape
    k = ids_BSK.shape[-1]
    pairs = b * s * k
    ids = ids_BSK.reshape(pairs)
    order = jnp.argsort(ids, stable=True)  # pairs grouped by expert
    x_sorted = x_BSD.reshape(b * s, d)[order // k]
    counts = jnp.bincount(ids, length=num_experts).astype(jnp.int32)
    if not axis:
        y_sorted = _reduced(ffn(weights, dispatched(x_sorted, lambda v: v, dtype=dispatch_dtype), counts), reduce_axes)
    elif exchange == "padded":
        y_sorted = _padded_exchange(x_sorted, jnp.sort(ids), counts, weights, ffn, axis, reduce_axes, dispatch_dtype)
    else:
        collective = jax.lax.ragged_all_to_all if exchange == "ragged" else emulated_ragged_all_to_all
        y_sorted = _ragged_exchange(x_sorted, counts, weights, ffn, axis, reduce_axes, collective, dispatch_dtype)
    place = jnp.zeros_like(order).at[order].set(jnp.arange(pairs, dtype=order.dtype))  # each pair's sorted row
    return y_sorted, place.reshape(b, s, k)


def _reduced(out, reduce_axes):
    return jax.lax.psum(out, reduce_axes) if reduce_axes else out


def _by_expert(rows, expert_of_row, group_sizes, weights, ffn, reduce_axes):
    """The received rows through their local experts, back in arrival order: grouped by
    expert for the grouped matmul (rows past the received ones carry expert `local`, last)."""
    regroup = jnp.argsort(expert_of_row, stable=True)
    out = _reduced(ffn(weights, rows[regroup], group_sizes), reduce_axes)
    return jnp.zeros_like(out).at[regroup].set(out)


def _padded_exchange(x_sorted, ids_sorted, counts, weights, ffn, axis, reduce_axes, dispatch_dtype):
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
    recv = _arrived(dispatched(send, lambda v: jax.lax.all_to_all(v, axis, 0, 0, tiled=True),
                               dtype=dispatch_dtype))  # [n senders, P, D]
    recv_counts = jax.lax.all_to_all(counts.reshape(n, local), axis, 0, 0, tiled=True)  # [n senders, E_local]
    # Each sender's rows arrive sorted by my local experts; regroup all of them by expert.
    ends = jnp.cumsum(recv_counts, axis=1)
    expert_of_row = jax.vmap(lambda e: jnp.searchsorted(e, j, side="right"))(ends)  # [n, P]; `local` = padding
    out = _by_expert(recv.reshape(n * pairs, d), expert_of_row.reshape(-1), recv_counts.sum(0), weights, ffn, reduce_axes)
    out = out.reshape(n, pairs, d)
    back = _arrived(jax.lax.all_to_all(out, axis, 0, 0, tiled=True))  # [n receivers, P, D]
    device = ids_sorted // local
    return back[device, j - starts[device]]


def _ragged_exchange(x_sorted, counts, weights, ffn, axis, reduce_axes, collective, dispatch_dtype):
    """Rows [P, D] sorted by expert -> their experts' outputs, same order, moving only the
    real rows. Each receiver lays its rows out sender by sender, each sender's run sorted
    by the receiver's experts; the return trip retraces the offsets."""
    pairs, d = x_sorted.shape
    local = weights[0].shape[0]
    n = counts.shape[0] // local
    send_sizes = counts.reshape(n, local).sum(1)  # rows to each device
    send_offsets = jnp.cumsum(send_sizes) - send_sizes
    recv_counts = jax.lax.all_to_all(counts.reshape(n, local), axis, 0, 0, tiled=True)  # [n senders, E_local]
    recv_sizes = recv_counts.sum(1)
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
    # Where my rows land on each receiver: its offset for me; and, for the way back, where
    # each sender keeps the rows it sent me.
    land_at = jax.lax.all_to_all(recv_offsets, axis, 0, 0, tiled=True)
    kept_at = jax.lax.all_to_all(send_offsets, axis, 0, 0, tiled=True)
    move = lambda v, *sizes: collective(v, jnp.zeros((n * pairs, *v.shape[1:]), v.dtype), *sizes, axis_name=axis)
    received = _arrived(dispatched(x_sorted, move, send_offsets, send_sizes, land_at, recv_sizes, dtype=dispatch_dtype))
    row = jnp.arange(n * pairs)
    sender = jnp.minimum(jnp.searchsorted(jnp.cumsum(recv_sizes), row, side="right"), n - 1)
    within = row - recv_offsets[sender]
    expert_of_row = jax.vmap(lambda s, w: jnp.searchsorted(jnp.cumsum(recv_counts[s]), w, side="right"))(sender, within)
    out = _by_expert(received, expert_of_row, recv_counts.sum(0), weights, ffn, reduce_axes)
    return _arrived(collective(out, jnp.zeros((pairs, d), out.dtype), recv_offsets, recv_sizes, kept_at, send_sizes,
                               axis_name=axis))


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """jax.lax.ragged_all_to_all's semantics from all_to_all of one padded slice per peer
    (one slice per device: len(offsets) == the axis size)."""
    rows, n = operand.shape[0], input_offsets.shape[0]
    r = jnp.arange(rows)
    send = jnp.where((r[None, :] < send_sizes[:, None])[..., None],
                     operand[jnp.minimum(input_offsets[:, None] + r[None, :], rows - 1)], 0)
    recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)  # [n senders, rows, ...]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each sender's slice goes here
    where = jnp.where(r[None, :] < recv_sizes[:, None], at[:, None] + r[None, :], output.shape[0])
    return output.at[where.reshape(-1)].set(recv.reshape(n * rows, *operand.shape[1:]), mode="drop")
