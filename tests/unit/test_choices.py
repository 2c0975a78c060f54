"""Typed choices (jaxpar.choices): every Literal-typed field of a config is checked, by the
catalogue's one rule for a config built in Python and by `--set` as it parses, with one
message; the tables that dispatch on a choice hold one entry per value. The cases come from
the types, so a new choice field is covered by being typed."""

import dataclasses
from typing import get_args

import pytest

from jaxpar.checks import base_config, validate
from jaxpar.checks.rule import BASES
from jaxpar.choices import RULE, ContextImpl, ExpertExchange, Optimizer, choice_fields
from jaxpar.commands import main
from jaxpar.config import Config, apply_overrides
from jaxpar.errors import ConfigError

CASES = [(base, key, allowed) for base in BASES for key, allowed in choice_fields(base_config(base)).items()]


def bad(allowed: tuple):
    """A value of the choice's type that it does not allow."""
    return max(allowed) + 1 if isinstance(allowed[0], int) else "no-such-choice"


def message(key: str, value, allowed: tuple) -> str:
    return f"{key}={value!r}; use one of {', '.join(map(str, allowed))}"


def replaced(node, key: str, value):
    """`node` with the field at dotted `key` set to `value`, past any parser."""
    name, _, rest = key.partition(".")
    return dataclasses.replace(node, **{name: replaced(getattr(node, name), rest, value) if rest else value})


def test_the_config_types_its_choice_fields():
    keys = choice_fields(Config)
    assert {"parallel.zero.stage", "parallel.expert_exchange", "train.compute_dtype", "data.order"} <= set(keys)
    assert keys["parallel.zero.stage"] == (0, 1, 2, 3)


@pytest.mark.parametrize("base, key, allowed", CASES, ids=[f"{k}@{b}" for b, k, _ in CASES])
def test_the_catalogue_refuses_a_bad_choice(base, key, allowed):
    with pytest.raises(ConfigError) as info:
        validate(replaced(base_config(base), key, bad(allowed)), 8, "cpu")
    assert info.value.rule == RULE and str(info.value) == message(key, bad(allowed), allowed)


def test_a_choice_of_another_type_is_refused():
    """True == 1, but it is no ZeRO stage."""
    with pytest.raises(ConfigError, match=r"^parallel\.zero\.stage=True; use one of 0, 1, 2, 3$"):
        validate(replaced(base_config("llama"), "parallel.zero.stage", True), 8, "cpu")


@pytest.mark.parametrize("key, allowed", choice_fields(Config).items(), ids=list(choice_fields(Config)))
def test_set_refuses_a_bad_choice_with_the_rules_message(key, allowed):
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), [f"{key}={bad(allowed)}"])
    assert info.value.rule == RULE and str(info.value) == message(key, bad(allowed), allowed)


def test_set_parses_a_choice_as_its_type():
    config = apply_overrides(Config(), ["parallel.zero.stage=2", "parallel.attention=flash"])
    assert (config.parallel.zero.stage, config.parallel.attention) == (2, "flash")
    assert type(config.parallel.zero.stage) is int
    with pytest.raises(ConfigError, match=r"^parallel\.zero\.stage='two'; use one of 0, 1, 2, 3$"):
        apply_overrides(Config(), ["parallel.zero.stage=two"])


def test_the_command_line_refuses_a_bad_choice_in_one_line(capsys):
    assert main(["train", "llama", "--set", "parallel.zero.stage=5"]) == 2
    assert "parallel.zero.stage=5; use one of 0, 1, 2, 3" in capsys.readouterr().err


def test_tables_that_dispatch_on_a_choice_hold_one_entry_per_value():
    from jaxpar.kernels.attention.context import KERNELS
    from jaxpar.step.optim import OPTIMIZERS

    assert set(KERNELS) == set(get_args(ContextImpl)) and set(OPTIMIZERS) == set(get_args(Optimizer))


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_every_expert_exchange_resolves_to_one_the_kernel_runs(platform):
    from jaxpar.kernels.experts import EXCHANGES
    from jaxpar.step.layout import expert_exchange

    for choice in get_args(ExpertExchange):
        assert expert_exchange(apply_overrides(Config(), [f"parallel.expert_exchange={choice}"]), platform) in EXCHANGES
