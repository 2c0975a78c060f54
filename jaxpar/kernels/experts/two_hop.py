"""The experts' exchange in two hops when the expert axis spans hosts: DeepSeek-V3's
node-limited routing with fixed-size buffers (capacity routing with group capacity,
model.group_capacity).

The G groups of consecutive experts lie whole on hosts (H hosts of the expert axis divide
G), and a token takes at most one slot per group it chose (jaxpar.kernels.experts.slots
.group_slots), so it crosses to a host once per group, whatever its choices there:

  hop 1   across hosts, among the devices with the same index inside their host: each
          device sends [G, b x C_g, D], one row per (token, group) with a group slot
          (C_g = capacity_factor x S x top_groups / G a sequence), and beside each row its
          choices there: expert (within the host), expert slot and gate. A device receives
          its host's groups from every host.
  hop 2   inside the host: the rows placed in [E_host, H x b x C, D] by expert and slot, an
          all-to-all to the devices holding those experts: [E/n, n x b x C, D], what the
          one-hop exchange delivers, in another order.
  back    hop 2 reversed; the forwarding device sums each row's choices on its host,
          weighted by their gates; hop 1 reversed (one row per token and group); the
          sender sums its token's groups.

Across hosts each device sends capacity_factor x T x top_groups rows of D a layer (a share
(H - 1) / H of its hop-1 buffer crosses), against capacity_factor x T x k in one hop:
top_groups / k of the bytes (DeepSeek-V3: 4 of 8). The pairs kept are the one-hop
exchange's under the same group capacity, so the values are too, summed in another order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.kernels.experts.combine import row_sources, rows_at, weighted_rows
from jaxpar.kernels.experts.payload import dispatched
from jaxpar.kernels.experts.slots import first_in_group


def two_hop_exchange(x_BSD, ids_BSK, gates_BSK, slots_BSK, group_slots_BSK, cap: int, group_cap: int, weights, ffn,
                     axis: str, hosts: int, groups: int, num_experts: int, reduce_axes=(), dispatch_dtype="compute",
                     arrived=lambda a: a):
    """y [B, S, D]: each token's kept choices through their experts, gate-weighted (float32
    sums, in x's dtype). `slots` are the expert slots with every pair its group dropped
    already DROPPED; `group_slots` the (token, group) slots; `axis` one mesh axis, its
    devices host-major (jaxpar.mesh); `arrived` names each exchanged buffer."""
    b, s, d = x_BSD.shape
    k = ids_BSK.shape[-1]
    n = jax.lax.axis_size(axis)
    local, rows = n // hosts, b * group_cap
    across = [[h * local + i for h in range(hosts)] for i in range(local)]  # same index inside each host
    inside = [[h * local + i for i in range(local)] for h in range(hosts)]
    move = lambda groups_, split, concat: lambda v: jax.lax.all_to_all(  # noqa: E731
        v, axis, split, concat, tiled=True, axis_index_groups=groups_)

    group = ids_BSK // (num_experts // groups)
    row = jnp.arange(b)[:, None, None] * group_cap + group_slots_BSK  # the (token, group)'s row in its group
    sends = first_in_group(group) & (group_slots_BSK >= 0)
    send_row = jnp.where(sends, row, rows)  # past the end: nothing
    token = jnp.broadcast_to(jnp.arange(b * s).reshape(b, s, 1), (b, s, k))
    payload = rows_at(x_BSD.reshape(b * s, d), row_sources((groups, rows), (group, send_row), token))
    # each kept choice, in its row: its expert on the receiving host, its slot, its gate
    kept_row = jnp.where(slots_BSK >= 0, row, rows)
    choice = jnp.broadcast_to(jnp.arange(k), (b, s, k))
    e_host = num_experts // hosts
    meta = lambda fill, value: jnp.full((groups, rows, k), fill, value.dtype).at[group, kept_row, choice].set(  # noqa: E731
        value, mode="drop")
    expert, slot, gate = meta(-1, ids_BSK % e_host), meta(0, slots_BSK), meta(0, gates_BSK.astype(jnp.float32))

    # hop 1: [G/H, H x rows, ...], sender h's rows at block h
    hop1 = move(across, 0, 1)
    got = arrived(dispatched(payload, hop1, dtype=dispatch_dtype))
    expert, slot, gate = hop1(expert), hop1(slot), hop1(gate)
    sender = jnp.arange(hosts * rows) // rows
    sequence = jnp.arange(hosts * rows) % rows // group_cap
    at = (sender * b + sequence)[None, :, None] * cap + slot  # [G/H, H x rows, k] in the host's expert buffers
    where = jnp.where(expert >= 0, at, hosts * b * cap)
    received = jnp.broadcast_to(jnp.arange(got.shape[0] * got.shape[1]).reshape(*got.shape[:2], 1), expert.shape)
    host_buf = rows_at(got.reshape(-1, d), row_sources((e_host, hosts * b * cap), (expert, where), received))

    # hop 2: [E/n, L x H x b x C, D], my experts, every device's rows
    out = ffn(weights, arrived(dispatched(host_buf, move(inside, 0, 1), dtype=dispatch_dtype)))
    out = jax.lax.psum(out, reduce_axes) if reduce_axes else out
    out = arrived(move(inside, 1, 0)(out))  # [E_host, H x b x C, D]
    flat = e_host * hosts * b * cap
    summed = weighted_rows(out.reshape(flat, d), jnp.where(expert >= 0, expert * (hosts * b * cap) + where, flat),
                           gate, x_BSD.dtype)  # [G/H, H x rows, D]
    back = arrived(move(across, 1, 0)(summed))  # [G, rows, D]: my rows' sums on each group
    # each token's groups, at their first choices
    index = jnp.where(send_row < rows, group * rows + send_row, groups * rows)
    return weighted_rows(back.reshape(groups * rows, d), index, jnp.ones(send_row.shape, jnp.float32), x_BSD.dtype)
