"""The optim section: the optimizer's numbers."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError

RULES: list[Rule] = []
rule = collector(RULES)


# optim field -> (what holds, as a test of the value; what to say)
OPTIM_RANGES = {
    "lr": (lambda x: 0 < x < float("inf"), "a positive learning rate, e.g. 3e-4"),
    "warmup_steps": (lambda x: x >= 0, ">= 0 (0: no warm-up)"),
    "decay_steps": (lambda x: x >= 0, ">= 0 (0: decay over train.steps)"),
    "min_lr_ratio": (lambda x: 0 <= x <= 1, "between 0 and 1 (the final learning rate over the peak)"),
    "b1": (lambda x: 0 <= x < 1, "in [0, 1), e.g. 0.9"),
    "b2": (lambda x: 0 <= x < 1, "in [0, 1), e.g. 0.95"),
    "eps": (lambda x: 0 < x < float("inf"), "> 0, e.g. 1e-8"),
    "weight_decay": (lambda x: x >= 0, ">= 0 (0: none)"),
    "clip_norm": (lambda x: x >= 0, ">= 0 (0: no clipping)"),
}


@rule(
    "optimizer-values",
    fields=[f"optim.{f}" for f in OPTIM_RANGES],
    summary="The optimizer's numbers make sense: a positive learning rate, non-negative steps, decay and clipping, "
    "betas in [0, 1), a positive eps, a final learning-rate ratio in [0, 1].",
    example=["optim.lr=-1"],
    also=[["optim.lr=0"], ["optim.b2=1"], ["optim.warmup_steps=-5"], ["optim.min_lr_ratio=2"]],
)
def optimizer_values(config, sizes) -> None:
    for field, (holds, what) in OPTIM_RANGES.items():
        value = getattr(config.optim, field)
        if not holds(value):
            raise ConfigError(f"optim.{field}={value} makes no sense; use {what}")
