"""The configuration catalogue (jaxpar.checks): every rule is broken by its own example and
by nothing else first, the base configs pass every rule, and the docs page is current."""

import dataclasses
import pathlib

import pytest

from jaxpar.checks import CATALOGUE, base_config, by_id, example_config, validate
from jaxpar.checks.docs import COMMAND, markdown
from jaxpar.checks.rule import BASES
from jaxpar.config import Config, flatten
from jaxpar.errors import ConfigError

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "config_checks.md"
EXAMPLES = [(rule, example) for rule in CATALOGUE for example in rule.examples]


@pytest.mark.parametrize(
    "rule, example", EXAMPLES, ids=[f"{r.id}:{' '.join(e)}" for r, e in EXAMPLES]
)
def test_example_breaks_its_rule(rule, example):
    with pytest.raises(ConfigError) as info:
        validate(example_config(rule, example), rule.devices, "cpu")
    assert info.value.rule == rule.id, f"{' '.join(example)} was refused by {info.value.rule}: {info.value}"
    assert any(f in str(info.value) for f in rule.fields), f"{info.value} names none of {rule.fields}"


@pytest.mark.parametrize("name", BASES)
def test_base_configs_pass_every_rule(name):
    sizes = validate(base_config(name), 8, "cpu")
    assert sizes["data"] == 8


def test_rules_are_unique_and_complete():
    ids = [rule.id for rule in CATALOGUE]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    keys = {k for name in BASES for k in flatten(base_config(name))}
    sections = {f.name for f in dataclasses.fields(Config)} | {"mesh.hosts"}
    for rule in CATALOGUE:
        assert rule.example and rule.summary and rule.fields, rule.id
        assert set(rule.fields) <= keys | sections, (rule.id, set(rule.fields) - keys - sections)
        assert by_id(rule.id) is rule
    assert CATALOGUE[0].needs == "devices" and all(r.needs != "devices" for r in CATALOGUE[1:])


def test_validate_keeps_its_signature_and_skips_platform_rules_without_one():
    from jaxpar.config import validate as config_validate

    config = example_config(by_id("ragged-exchange-needs-gpu"))
    assert config_validate(config, 8) == validate(config, 8)  # no platform: the backend rules do not run
    with pytest.raises(ConfigError, match="ragged_all_to_all") as info:
        config_validate(config, 8, "cpu")
    assert info.value.rule == "ragged-exchange-needs-gpu"


def test_docs_page_is_current():
    assert COMMAND in DOCS.read_text().splitlines()[2]
    assert DOCS.read_text() == markdown(), f"docs/config_checks.md is stale; regenerate it: {COMMAND}"
