"""The distributed section: the timeouts of a multi-process run."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError

RULES: list[Rule] = []
rule = collector(RULES)

TIMEOUTS = ("heartbeat_timeout_s", "join_timeout_s")


@rule(
    "distributed-timeouts-positive",
    fields=[f"distributed.{f}" for f in TIMEOUTS],
    summary="The heartbeat and join timeouts of a multi-process run are positive numbers of seconds.",
    example=["distributed.heartbeat_timeout_s=0"],
    also=[["distributed.join_timeout_s=0"]],
)
def distributed_timeouts_positive(config, sizes) -> None:
    for field in TIMEOUTS:
        if getattr(config.distributed, field) < 1:
            raise ConfigError(
                f"distributed.{field}={getattr(config.distributed, field)} must be a positive number of seconds; e.g. 60"
            )
