"""Every choice field against the values its Literal allows (jaxpar.choices): one rule for all
of them, so a new choice field is checked by being typed. `--set` refuses a bad choice as it
parses, with this rule's message; the rule catches the configs built in Python."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.choices import RULE, check_choice, choice_fields
from jaxpar.config import Config, flatten

RULES: list[Rule] = []
rule = collector(RULES)


@rule(
    RULE,
    fields=list(choice_fields(Config)),
    summary="Each choice field holds one of the values its Literal type (jaxpar.choices) allows.",
    example=["parallel.zero.stage=4"],
    also=[["train.on_nonfinite=ignore"]],
)
def choice_values(config, sizes) -> None:
    values = flatten(config)
    for key, allowed in choice_fields(config).items():
        check_choice(key, values[key], allowed)
