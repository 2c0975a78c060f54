"""Parameters the rules leave whole on every device, found before anything compiles.

A model written with its own logical names ("dm", "ff") matches no rule, so every one of its
parameters silently rests whole on every device: FSDP and tensor parallelism then save no
memory at all. `replicated_params` finds them, `report_replicated` warns, refuses or stays
quiet as `parallel.rules.on_replicated` says.

The rule, in one sentence: a parameter is reported when it has 2 or more dimensions per
layer (a stacked `layers` dimension does not count), the storage rules place it on no mesh
axis, one of its dimension names is unknown to the storage table (the model's own name) or
it has no names at all (not annotated), and some mesh axis that shards parameters is > 1.

- "Shards parameters": the storage table places some name other than the activation names
  (batch, seq, norm_seq) on it. With the default rules that is fsdp (embed), tensor
  (heads, mlp, vocab, ...), expert (experts) and stage (layers); never data or context,
  which replicate parameters by design (ZeRO-3 adds data on top of the rules).
- Known names placed on no axis are the rules' own choice (a stacked norm scale
  [layers, embed] under tensor parallelism only), and so is None for one dimension of an
  annotated parameter (a router's experts column: ("layers", "embed", None)): not reported.
- Vectors and scalars (norm scales, biases), stacked per layer or not, are cheap to
  replicate and are not reported.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Sequence, get_args

import jax

from jaxpar.choices import OnReplicated
from jaxpar.errors import ConfigError, JaxparWarning
from jaxpar.sharding.annotate import ParamNames

POLICIES = get_args(OnReplicated)
ACTIVATION_NAMES = ("batch", "seq", "norm_seq")  # their axes shard activations, not parameters
STACKED = "layers"  # the scanned layer stack: a vector per layer is still a vector
SUGGESTED_AXES = ("fsdp", "tensor", "expert")  # storage-only sharding is safe on these, in this order
# jaxpar's names for parameter dimensions: what a model's `axis_names` maps its own names onto
PARAM_NAMES = ("embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "experts", "expert_mlp")


class ReplicatedParams(JaxparWarning):
    """Parameters rest whole on every device because no sharding rule knows their names."""


@dataclasses.dataclass(frozen=True)
class Replicated:
    """One parameter left whole on every device.

    rule        the storage rule that would shard it ('ff=fsdp'), or '' when none would
                (no dimension with a name, or no sharding axis divides it)
    suggestion  what to do about it, in words
    """

    path: str
    names: tuple[str | None, ...]
    shape: tuple[int, ...]
    rule: str
    suggestion: str


def replicated_params(names: Any, shapes: Any, layout: Any) -> list[Replicated]:
    """The parameters the rules silently replicate (the module docstring's rule), in tree order.

    names: tree of `param_names` leaves (`.names`); shapes: the matching tree of arrays or
    ShapeDtypeStructs; layout: a jaxpar.sharding.Layout.
    """
    axes = sharding_axes(layout.rules.table("storage"), layout.mesh.shape)
    if not axes:
        return []
    leaves, treedef = jax.tree_util.tree_flatten_with_path(names, is_leaf=lambda x: isinstance(x, ParamNames))
    out = []
    for (path, leaf), shape in zip(leaves, treedef.flatten_up_to(shapes)):
        entry = _check_one(path_text(path), tuple(leaf.names), tuple(shape.shape), layout, axes)
        if entry is not None:
            out.append(entry)
    return out


def sharding_axes(table: dict[str, tuple[str, ...]], mesh_shape: Any) -> tuple[str, ...]:
    """Mesh axes > 1 on which the storage table places some parameter name (any but the
    activation names), in mesh order."""
    used = {a for name, mapped in table.items() if name not in ACTIVATION_NAMES for a in mapped}
    return tuple(a for a in mesh_shape if a in used and mesh_shape[a] > 1)


def _check_one(path: str, names: tuple, shape: tuple, layout: Any, axes: tuple[str, ...]) -> Replicated | None:
    """A `Replicated` for this parameter if the rule says so, else None."""
    table = layout.rules.table("storage")
    own = [n for n in names if n is not None and n not in table]
    unannotated = all(n is None for n in names)
    per_layer = sum(n != STACKED for n in names)
    if per_layer < 2 or not (own or unannotated) or any(layout.rules.spec(names, "storage")):
        return None
    rule = suggest_rule(names, shape, table, axes, layout.mesh.shape)
    named = rule.partition("=")[0] or (own[0] if own else None)
    return Replicated(path, names, shape, rule, suggestion_text(rule, named))


def suggest_rule(names: Sequence[str | None], shape: Sequence[int], table: dict, axes: Sequence[str],
                 mesh_shape: Any) -> str:
    """'name=axis': the largest dimension with an unknown (but present) name that one of
    fsdp, tensor, expert (in that order) is live here and divides; '' when none fits."""
    dims = sorted(((size, name) for size, name in zip(shape, names) if name is not None and name not in table),
                  key=lambda d: -d[0])  # stable: the first of equal sizes wins
    for size, name in dims:
        fits = [a for a in SUGGESTED_AXES if a in axes and size % mesh_shape[a] == 0]
        if fits:
            return f"{name}={fits[0]}"
    return ""


def suggestion_text(rule: str, own: str | None) -> str:
    """What the user can do: the rule override (or annotating the parameter, when it has no
    name to match), or mapping the model's own name onto jaxpar's (`axis_names`)."""
    if own is None:
        return "annotate it with nnx.with_partitioning(init, names) so a rule can place it"
    head = f"parallel.rules.storage='{rule}'" if rule else f"a parallel.rules.storage entry for '{own}'"
    return f"{head}, or map '{own}' to a jaxpar name in the model's axis_names"


def path_text(path: Sequence[Any]) -> str:
    """('layers', 'attn', 'wq') key path -> 'layers.attn.wq'."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator=".")


def replication_message(entries: Sequence[Replicated], limit: int = 5) -> str:
    """One message: a first line that stands alone (how many parameters, how many values,
    the override that would shard them all), then the `limit` largest parameters with their
    names, shapes and suggestion, and how many more."""
    entries = sorted(entries, key=lambda e: -math.prod(e.shape))  # stable: tree order among equals
    total = sum(math.prod(e.shape) for e in entries)
    rules = _combined_rules(entries)
    fix = f"parallel.rules.storage='{rules}'" if rules else "parallel.rules.storage entries for their names"
    lines = [f"{len(entries)} parameter(s) ({total:,} values) match no sharding rule and rest whole on every "
             f"device; shard them with {fix}, or give the model config axis_names mapping its own names to "
             f"jaxpar's ({', '.join(PARAM_NAMES)}), e.g. {{'dm': 'embed', 'ff': 'mlp'}}:"]
    lines += [f"  {e.path} names={e.names} shape={e.shape}: {e.suggestion}" for e in entries[:limit]]
    if len(entries) > limit:
        lines.append(f"  ... and {len(entries) - limit} more")
    return "\n".join(lines)


def _combined_rules(entries: Sequence[Replicated]) -> str:
    """One override for them all: each entry's rule, in order, unless an earlier rule already
    names one of its dimensions (then that rule shards it too, divisibility permitting:
    the layout's divisibility check says so if not)."""
    chosen: dict[str, str] = {}
    for e in entries:
        if e.rule and not chosen.keys() & set(e.names):
            chosen[e.rule.partition("=")[0]] = e.rule
    return ",".join(chosen.values())


def report_replicated(entries: Sequence[Replicated], policy: str) -> None:
    """Act on `entries` as `parallel.rules.on_replicated` says: warn (ReplicatedParams), error
    (ConfigError), allow (nothing). An unknown policy is refused even with no entries."""
    check_policy(policy)
    if not entries or policy == "allow":
        return
    message = replication_message(entries)
    if policy == "error":
        raise ConfigError(f"parallel.rules.on_replicated=error: {message}\n(=warn or =allow lets the layout through)")
    warnings.warn(f"{message}\n(parallel.rules.on_replicated=allow silences this, =error refuses it)", ReplicatedParams,
                  stacklevel=3)


def check_policy(policy: str) -> None:
    """`policy` is one of POLICIES: report_replicated's own check (the catalogue checks the config's field)."""
    if policy not in POLICIES:
        raise ConfigError(f"parallel.rules.on_replicated={policy!r} is not a policy; use {', '.join(POLICIES)}")
