"""A token file's id outside the vocabulary is refused naming the field that sets the
vocabulary, as --set knows it: vocab_size for jaxpar's models, the field a config of one's
own keeps it in (its vocab_size a property that returns it), or, where no field holds it,
the property, marked as none --set can change."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxpar.config import apply_overrides
from jaxpar.data.sources import make_source
from jaxpar.errors import ConfigError
from jaxpar.train import build


@dataclasses.dataclass(frozen=True)
class OwnNames:
    """Only what make_source reads of a model: its task and vocab_size."""

    n_vocab: int = 128
    task = "lm"
    vocab_size = property(lambda self: self.n_vocab)


@dataclasses.dataclass(frozen=True)
class Computed(OwnNames):
    half: int = 64
    vocab_size = property(lambda self: 2 * self.half)


@pytest.mark.parametrize("model, named", [
    (None, "model.vocab_size=128; set model.vocab_size above the largest id"),
    (OwnNames(), "model.n_vocab=128; set model.n_vocab above the largest id"),
    (Computed(), ("the model's vocab_size=128 (a property of Computed, not a field --set can change); give the model "
                  "a larger vocabulary")),
], ids=["jaxpar's", "own field", "computed"])
def test_an_id_outside_the_vocabulary_names_the_field_that_sets_it(tmp_path, tiny_llama, model, named):
    path = tmp_path / "big.npy"
    np.save(path, np.full(100, 500, np.int32))
    config = apply_overrides(tiny_llama, ["data.source=tokens", f"data.path={path}"])
    batch = build(config).batch  # the same batch for every model of 128 ids
    config = config if model is None else dataclasses.replace(config, model=model)
    with pytest.raises(ConfigError) as info:
        make_source(batch, config)
    assert str(info.value) == f"data.path={str(path)!r} holds token id 500 (at position 0) but {named}, or re-tokenize"
