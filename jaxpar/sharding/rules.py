"""Logical axis names -> mesh axes.

Two tables, because a parameter is stored one way and used another:
  storage: parameters, gradients and optimizer state at rest (FSDP shards `embed`);
  compute: activations and parameters at the point of use (FSDP shards gathered).
Tensor-parallel dimensions (heads, mlp, vocab) are sharded in both.

Logical names used by jaxpar's models:
  batch, norm_seq (sequence in norm/residual regions: Megatron-SP shards it over tensor),
  seq (sequence inside attention/MLP), embed, heads, kv_heads, head_dim, mlp, vocab, layers,
  experts (expert parallelism), expert_mlp (each expert's hidden layer).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from jax.sharding import PartitionSpec as P

from jaxpar.errors import QUOTED, ConfigError, did_you_mean
from jaxpar.mesh import AXES, BATCH_AXES

Table = Mapping[str, tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class Rules:
    """A storage and a compute table; unknown logical names map to no mesh axis."""

    storage: tuple[tuple[str, tuple[str, ...]], ...]
    compute: tuple[tuple[str, tuple[str, ...]], ...]

    @staticmethod
    def of(storage: Table, compute: Table) -> "Rules":
        return Rules(tuple(sorted(storage.items())), tuple(sorted(compute.items())))

    def table(self, kind: str) -> dict[str, tuple[str, ...]]:
        if kind not in ("storage", "compute"):
            raise ValueError(f"kind={kind!r}; use 'storage' or 'compute'")
        return dict(self.storage if kind == "storage" else self.compute)

    def spec(self, names: Sequence[str | None], kind: str) -> P:
        """PartitionSpec for an array whose dimensions carry `names`.

        A mesh axis is used at most once per array: the first dimension that claims it wins
        (so ("heads", "kv_heads") never puts `tensor` on both).
        """
        table = self.table(kind)
        used: set[str] = set()
        out = []
        for name in names:
            axes = tuple(a for a in table.get(name, ()) if a not in used) if name is not None else ()
            used.update(axes)
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*out)

    def with_aliases(self, aliases: Mapping[str, str | None]) -> "Rules":
        """A model's own logical names shard like the jaxpar names they stand for
        ({'dm': 'embed', 'ff': 'mlp'}: jaxpar.model's `axis_names`); None: never sharded,
        on purpose (a position table's rows). A name of neither kind is refused: it would
        leave its dimensions whole on every device without a word."""
        s, c = self.table("storage"), self.table("compute")
        for own, canonical in aliases.items():
            if canonical is not None and canonical not in LOGICAL_NAMES:
                raise ConfigError(f"the model's axis_names maps {own!r} to {canonical!r}, which is no jaxpar logical "
                                  f"name{did_you_mean(str(canonical), LOGICAL_NAMES, QUOTED)}; use one of {', '.join(LOGICAL_NAMES)}, or None for a dimension never "
                                  "sharded")
            s[own], c[own] = (s.get(canonical, ()), c.get(canonical, ())) if canonical else ((), ())
        return Rules.of(s, c)

    def without(self, axis: str, kinds: Sequence[str] = ("storage", "compute")) -> "Rules":
        """The rules with mesh axis `axis` named by no logical name of `kinds`' tables (a
        context manual over it holds each device's own part)."""
        strip = lambda kind: {k: tuple(a for a in v if a != axis) for k, v in self.table(kind).items()}  # noqa: E731
        return self.with_overrides(*(strip(kind) if kind in kinds else None for kind in ("storage", "compute")))

    def with_overrides(self, storage: Table | None = None, compute: Table | None = None) -> "Rules":
        s, c = self.table("storage"), self.table("compute")
        s.update(storage or {})
        c.update(compute or {})
        return Rules.of(s, c)


def default_rules(mesh_shape: Mapping[str, int], sequence_parallel: bool) -> Rules:
    """Rules for PP x DP x FSDP x TP (+SP) x EP on a mesh; axes of size 1 are left out of every spec."""

    def live(*axes: str) -> tuple[str, ...]:
        return tuple(a for a in axes if mesh_shape.get(a, 1) > 1)

    tensor = live("tensor")
    compute = {
        "batch": live(*BATCH_AXES),
        "norm_seq": live("context", "tensor") if sequence_parallel else live("context"),
        "seq": live("context"),
        "embed": (),
        "heads": tensor,
        "kv_heads": tensor,
        "head_dim": (),
        "mlp": tensor,
        "vocab": tensor,
        "layers": live("stage"),  # pipeline parallelism: each stage holds its layers
        "experts": live("expert"),
        "expert_mlp": tensor,
    }
    storage = dict(compute, embed=live("fsdp"))
    return Rules.of(storage, compute)


# jaxpar's logical names: what the default rules place, and what a model's axis_names maps onto
LOGICAL_NAMES = tuple(default_rules({}, False).table("compute"))


def kv_heads_repeat(kv_heads: int, tensor: int, context: int = 1) -> int:
    """How many times each grouped-query key/value head is repeated where it is used, so that
    the heads split evenly over `tensor` (times Ulysses' `context` degree, which splits heads
    too): 1 where they already do; else lcm(kv_heads, tensor x context) / kv_heads. With
    tensor a multiple of kv_heads, as Megatron and MaxText do: each device computes one head,
    which tensor / kv_heads devices share. Exact: query head i reads key/value head
    i // (heads / kv_heads), and after the repeat head i // (heads / (kv_heads x repeat)),
    the same one."""
    ways = tensor * context
    return 1 if kv_heads % ways == 0 else math.lcm(kv_heads, ways) // kv_heads


def parse_table(text: str, field: str) -> dict[str, tuple[str, ...]]:
    """'seq=context+tensor,embed=' -> {'seq': ('context', 'tensor'), 'embed': ()}."""
    out: dict[str, tuple[str, ...]] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, axes = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"{field}={text!r}: '{item}' is not 'logical=axis+axis'; e.g. 'embed=fsdp,seq='")
        parsed = tuple(a for a in (x.strip() for x in axes.split("+")) if a)
        bad = [a for a in parsed if a not in AXES]
        if bad:
            raise ConfigError(f"{field}={text!r}: unknown mesh axis {bad[0]!r}; use {', '.join(AXES)}")
        out[name.strip()] = parsed
    return out
