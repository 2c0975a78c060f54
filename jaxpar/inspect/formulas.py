"""The published figures a compiled step is measured against (../shared/reference.md).

Ψ = parameter count, N = data-parallel degree. Bytes unless a name says elements.
  model state, mixed-precision Adam (ZeRO, arXiv 1910.02054): 2Ψ bf16 parameters + 2Ψ
  gradients + 12Ψ fp32 master, momentum and variance; stage k shards its share over N.
  gradient traffic per device: 2Ψ(N-1)/N elements at ZeRO 0-2 (reduce-scatter + all-gather,
  or one all-reduce), 3Ψ(N-1)/N at ZeRO-3 (all-gather forward and backward, reduce-scatter).
  activations per transformer layer (Korthikanti et al., arXiv 2205.05198), 16-bit:
  s·b·h·(34 + 5as/h) plain; (10 + 24/t + 5as/(ht)) with TP; (34/t + 5as/(ht)) with TP + SP;
  34/t with SP and selective recomputation.
  what remat `dots` keeps of a decoder layer (matmul outputs, 16-bit): the residual stream
  twice (the layer's input, the attention projection's output), the query, key and value
  projections, attention's output and the MLP's gate and up projections.
"""

from __future__ import annotations

import math

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelState:
    """Per-device bytes of each part of the model state."""

    params: float
    grads: float
    master: float
    optimizer: float
    frozen: float = 0.0  # LoRA's frozen weights
    outer: float = 0.0  # DiLoCo's outer state (jaxpar.step.diloco.Outer)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master + self.optimizer + self.frozen + self.outer


def model_state(
    psi: float,
    stage: int,
    zero_degree: int,
    sharded_degree: int = 1,
    compute_bytes: int = 2,
    optimizer_bytes: int = 8,
) -> ModelState:
    """ZeRO's per-device model state. `zero_degree` is N (the axis ZeRO shards over, at its
    stage); `sharded_degree` is what already shards everything (FSDP x TP); `compute_bytes`
    2 for bf16 (with a 4-byte master) or 4 for fp32 (no separate master)."""
    base = psi / sharded_degree
    at = lambda k: base / (zero_degree if stage >= k else 1)  # noqa: E731
    mixed = compute_bytes < 4
    return ModelState(
        params=compute_bytes * at(3),
        grads=compute_bytes * at(2),
        master=4 * at(1) if mixed else 0.0,
        optimizer=optimizer_bytes * at(1),
    )


def frozen_state(frozen_bytes: float, stage: int, zero_degree: int, sharded_degree: int = 1) -> float:
    """LoRA's frozen weights per device: `frozen_bytes` in all (the compute dtype's bytes a
    weight, 1 an FP8 one plus its rows' scales; no gradient, master or optimizer state),
    resting as parameters do (over `zero_degree` too at ZeRO-3). With the adapters' 16 bytes
    each (model_state of their count) this is 2 bytes per frozen parameter (1 in FP8) plus
    16 per trained one, over the sharding."""
    return frozen_bytes / sharded_degree / (zero_degree if stage >= 3 else 1)


def zero_paper_bytes(psi: float, stage: int, n: int) -> float:
    """The ZeRO paper's table: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def gradient_traffic_elements(psi: float, n: int, stage: int) -> float:
    """Per-device elements sent per step by the gradient / parameter collectives."""
    if n <= 1:
        return 0.0
    return (3 if stage >= 3 else 2) * psi * (n - 1) / n


def activation_bytes_per_layer(
    s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, selective: bool = False
) -> float:
    """Korthikanti et al. eq. 1-2 and table 2, 16-bit activations, per device."""
    attention = 5 * a * s / (h * t)
    if selective:
        return s * b * h * (34 / t if sequence_parallel else 10 + 24 / t)
    if sequence_parallel:
        return s * b * h * (34 / t + attention)
    if t > 1:
        return s * b * h * (10 + 24 / t + attention)
    return s * b * h * (34 + 5 * a * s / h)


def matmul_outputs_bytes_per_layer(s: int, b: int, h: int, attention: float, mlp: float, t: int = 1,
                                   sequence_parallel: bool = False) -> float:
    """What remat `dots` keeps of a decoder layer, 16-bit, per device (jaxpar.nn): the
    residual stream twice, h wide (the layer's input and the attention projection's output,
    from which the norms are recomputed; split by t under sequence parallelism), and split by
    t a token's `attention` (its query, key, value and attention-output widths summed) and
    `mlp` (the gate and up projections' widths summed; an MoE layer's over its top-k experts,
    with their outputs). The down projection's output is not kept: the next layer's input is."""
    stream = s * b * h / (t if sequence_parallel or t == 1 else 1)
    return 2 * (2 * stream + s * b * (attention + mlp) / t)


def context_traffic_elements(impl: str, s: int, b: int, hq: int, hkv: int, n: int, window: int = 0,
                             layout: str = "zigzag") -> dict[str, dict[str, float]]:
    """Per-device elements one attention layer sends over a context axis of n devices,
    {"forward"|"backward": {collective kind: elements}}. s is the whole sequence, b the
    batch per device, hq / hkv the query / key-value widths (heads x head dim) per device.

    ring (reference.md; Liu et al.): K and V hop t-1 times forward, 2(s/n)·b·hkv·(t-1); the
      backward hops them again and sends dK, dV t times (home with their block). t = n, but
      under a sliding window of w keys over the contiguous layout only the device's own
      block and the ceil((w-1)/(s/n)) before it are seen: t = min(n, 1 + that).
    ulysses (DeepSpeed blog, 4sh/n for MHA): all-to-alls of q, k, v and o, each sending
      (n-1)/n of its s/n shard: (2hq + 2hkv)·(s/n)·b·(n-1)/n; the backward mirrors it.
    allgather: K and V gathered, 2·s·b·hkv·(n-1)/n; gathered again backward and their
      gradients reduce-scattered.
    (A window leaves Ulysses' and all-gather's traffic as it is: it saves their FLOPs.)
    """
    if n <= 1:
        return {"forward": {}, "backward": {}}
    shard = s // n * b
    if impl == "ring":
        kv = 2 * shard * hkv
        t = n if not window or layout != "contiguous" else min(n, 1 + math.ceil((window - 1) / (s // n)))
        return {"forward": {"collective-permute": kv * (t - 1)},
                "backward": {"collective-permute": kv * (t - 1) + kv * t if t > 1 else 0}}
    if impl == "ulysses":
        each = (2 * hq + 2 * hkv) * shard * (n - 1) / n
        return {"forward": {"all-to-all": each}, "backward": {"all-to-all": each}}
    if impl == "allgather":
        kv = 2 * s * b * hkv * (n - 1) / n
        return {"forward": {"all-gather": kv}, "backward": {"all-gather": kv, "reduce-scatter": kv}}
    raise ValueError(f"context impl {impl!r}; use ring, ulysses or allgather")


def windowed_tile_pairs(queries: int, block: int, window: int, start: int | None = None) -> int:
    """(query tile, key tile) pairs a block kernel computes under a sliding window of w keys,
    for `queries` consecutive queries in tiles of `block`: each query tile sees its own key
    tile and the m = ceil((w-1)/block) before it, fewer where the sequence starts (`start`:
    the first query's place; None: far from the start). Causal attention without a window
    computes about queries/block x (queries/block + 1) / 2 over a whole sequence."""
    m, tiles = math.ceil((window - 1) / block), queries // block
    if start is None:
        return tiles * (1 + m)
    first = start // block
    return sum(1 + min(first + i, m) for i in range(tiles))


# Bytes per element of an FP8 dispatch (jaxpar.kernels.experts.payload): e4m3 and a float32
# scale per 128
FP8_PAYLOAD_BYTES = 1 + 4 / 128


def expert_traffic_elements(tokens: int, top_k: int, hidden: int, capacity_factor: float) -> float:
    """Elements one all-to-all of expert parallelism moves per device (reference.md): each of
    a device's `tokens` goes to its top-k experts, in buffers capacity_factor x the balanced
    share. A MoE layer runs two forward (dispatch, combine) and two backward."""
    return tokens * top_k * hidden * capacity_factor
