"""The configuration catalogue: every check that runs before compile, one small rule each.

A rule has a stable id, the fields it concerns, a one-sentence summary, and an example
(`--set` overrides that break it on a small base config); `python -m jaxpar.checks
--markdown` writes docs/config_checks.md from them. `validate` runs the rules in catalogue
order, which matters where one relies on another having passed (the context rules divide
heads by the tensor degree the layout rules checked); the first that fails raises its
ConfigError with `.rule` set to its id.
"""

from __future__ import annotations

from typing import Any

from jaxpar.checks import (backend, checkpoint, choices, data, devices, diloco, distributed, layout, lora, model,
                           optim, pipeline, train, zero)
from jaxpar.checks.rule import BASES, Rule
from jaxpar.errors import ConfigError

CATALOGUE: tuple[Rule, ...] = (
    *devices.RULES,  # first: it resolves the axis sizes the others read
    *choices.RULES,  # then every choice field, which the rules across fields take as valid
    *model.RULES,
    *train.RULES,
    *zero.RULES,
    *diloco.RULES,
    *optim.RULES,
    *checkpoint.RULES,
    *distributed.RULES,
    *data.RULES,
    *layout.RULES,
    *pipeline.RULES,
    *lora.RULES,
    *backend.RULES,
)


def validate(config: Any, num_devices: int, platform: str | None = None) -> dict[str, int]:
    """Run every rule on `config` for `num_devices` devices (and the backend rules when
    `platform`, e.g. 'cpu' or 'gpu', is given); returns the resolved mesh axis sizes."""
    sizes: dict[str, int] = {}
    for rule in CATALOGUE:
        if rule.needs == "devices":
            sizes = _run(rule, config, num_devices)
        elif rule.needs == "sizes":
            _run(rule, config, sizes)
        elif platform is not None:
            _run(rule, config, platform)
    return sizes


def _run(rule: Rule, config: Any, given: Any) -> Any:
    try:
        return rule.check(config, given)
    except ConfigError as e:
        e.rule = rule.id  # which rule refused: for the tests, and for tools that explain it
        raise


def base_config(name: str) -> Any:
    """The small configs the rules' examples break: a tiny Llama (as tests/conftest.py's
    tiny_llama), the same as a 4-expert MoE, or as DeepSeek (a dense layer first, then 2 MoE
    ones), or a small MLP classifier; 8 devices."""
    from jaxpar.config import Config, TrainConfig
    from jaxpar.models.llama import LlamaConfig
    from jaxpar.models.mlp import MLPConfig
    from jaxpar.models.deepseek import DeepSeekConfig
    from jaxpar.models.moe import MoEConfig

    dims = dict(vocab_size=128, embed=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, mlp=64)
    models = {
        "llama": lambda: LlamaConfig(**dims),
        "moe": lambda: MoEConfig(**dims, num_experts=4, top_k=2),
        "deepseek": lambda: DeepSeekConfig(**dims, num_experts=4, top_k=2, expert_groups=2, top_groups=1, dense_layers=1),
        "mlp": lambda: MLPConfig(in_features=16, hidden=32, num_classes=4),
    }
    if name not in models:
        raise ConfigError(f"base config {name!r}; use one of {', '.join(BASES)}")
    return Config(model=models[name](), train=TrainConfig(steps=3, global_batch=16, seq_len=16, compute_dtype="float32"))


def example_config(rule: Rule, example: tuple[str, ...] | None = None) -> Any:
    """`rule`'s base config with one of its examples (default: the first) applied."""
    from jaxpar.config import apply_overrides

    return apply_overrides(base_config(rule.base), list(rule.example if example is None else example))


def by_id(rule_id: str) -> Rule:
    for rule in CATALOGUE:
        if rule.id == rule_id:
            return rule
    raise KeyError(f"no rule {rule_id!r}; jaxpar.checks.CATALOGUE lists them")


__all__ = ["CATALOGUE", "Rule", "base_config", "by_id", "example_config", "validate"]
