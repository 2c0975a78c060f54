"""One entry of the configuration catalogue, and the decorator that registers one."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

# What a rule's check receives besides the config (its second argument):
#   devices  the device count; the rule returns the resolved mesh axis sizes (mesh only)
#   sizes    the resolved mesh axis sizes, {'stage': 1, 'data': 8, ...}
#   platform the devices' backend ('cpu', 'gpu', ...); skipped when validate is given none
NEEDS = ("devices", "sizes", "platform")
BASES = ("llama", "moe", "deepseek", "mlp")


@dataclasses.dataclass(frozen=True)
class Rule:
    """A check with what the docs and the tests need to know about it.

    `example` is a list of `--set` overrides that, applied to the base config `base` on
    `devices` devices of `platform`, break exactly this rule; `also` holds one more such
    list for each further message of a rule that wraps several (the mesh resolution, the
    rule tables). A rule only one backend breaks (the GPU compiler's refusals, where the CPU
    runs the config as the tests do) gives that `platform`.
    """

    id: str
    fields: tuple[str, ...]
    summary: str
    example: tuple[str, ...]
    check: Callable[[Any, Any], Any]
    needs: str = "sizes"
    base: str = "llama"
    devices: int = 8
    also: tuple[tuple[str, ...], ...] = ()
    platform: str = "cpu"

    @property
    def examples(self) -> tuple[tuple[str, ...], ...]:
        return (self.example, *self.also)


def collector(into: list[Rule]) -> Callable[..., Callable]:
    """`rule = collector(RULES)`, then `@rule(id, fields=..., summary=..., example=...)` on a
    check appends it to RULES in the order of the module: the order the checks run in."""

    def rule(
        id: str,
        *,
        fields: Sequence[str],
        summary: str,
        example: Sequence[str],
        needs: str = "sizes",
        base: str = "llama",
        devices: int = 8,
        also: Sequence[Sequence[str]] = (),
        platform: str = "cpu",
    ) -> Callable:
        if needs not in NEEDS or base not in BASES:
            raise ValueError(f"rule {id!r}: needs={needs!r}, base={base!r}; use needs in {NEEDS}, base in {BASES}")

        def register(check: Callable) -> Callable:
            extra = tuple(map(tuple, also))
            into.append(Rule(id, tuple(fields), summary, tuple(example), check, needs, base, devices, extra, platform))
            return check

        return register

    return rule
