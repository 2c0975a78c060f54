"""jaxpar.inspect.rows: explain's document is its providers' rows in turn. Each provider is
registered once, no two write the same entry, and a provider whose strategy is off gives
neither rows nor lines (a plain data-parallel step: no context, experts, compression or
stages)."""

import pytest

from jaxpar.config import Config, TrainConfig
from jaxpar.inspect import inspect_step
from jaxpar.inspect.explain import explain, render
from jaxpar.inspect.facts import facts_of
from jaxpar.inspect.rows import PROVIDERS
from jaxpar.models.llama import LlamaConfig
from jaxpar.train import build

OFF_ON_DATA_PARALLEL = ("context parallel attention", "expert all-to-alls", "gradient compression", "pipeline traffic",
                        "pipeline schedule", "Muon's orthogonalisation")


@pytest.fixture(scope="module")
def data_parallel():
    """(trainer, report) of a tiny Llama over data=8."""
    config = Config(model=LlamaConfig(vocab_size=128, embed=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, mlp=64),
                    train=TrainConfig(global_batch=16, seq_len=16, compute_dtype="float32"))
    trainer = build(config)
    return trainer, inspect_step(trainer)


def test_every_provider_is_registered_once():
    assert len({p.name for p in PROVIDERS}) == len(PROVIDERS)
    assert len({p.rows for p in PROVIDERS}) == len({p.lines for p in PROVIDERS}) == len(PROVIDERS)


def test_the_document_is_the_providers_rows_none_written_twice(data_parallel):
    trainer, report = data_parallel
    facts = facts_of(trainer, report)
    keys = [key for provider in PROVIDERS for key in provider.rows(facts)]
    assert len(keys) == len(set(keys))
    doc = explain(trainer, report)
    assert list(doc) == keys
    assert render(doc).splitlines() == [line for provider in PROVIDERS for line in provider.lines(doc)]


def test_a_strategy_that_is_off_gives_no_rows_and_no_lines(data_parallel):
    facts = facts_of(*data_parallel)
    off = {p.name: p for p in PROVIDERS if p.name in OFF_ON_DATA_PARALLEL}
    assert set(off) == set(OFF_ON_DATA_PARALLEL)
    doc = explain(*data_parallel)
    for name, provider in off.items():
        assert provider.rows(facts) == {}, name
        assert provider.lines(doc) == [], name
