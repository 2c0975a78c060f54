"""Mistakes in a user's model config (jaxpar.model's contract) are refused before compile,
each in one line naming the member, where they used to end in a traceback from the part
that read it (or, for a sequence past a learned position table, in a NaN loss); and errors
about a model name the field the user sets, not jaxpar's alias for it."""

import dataclasses
import pathlib

import pytest
from flax import nnx

from jaxpar import recipes
from jaxpar.checks import validate
from jaxpar.config import Config, TrainConfig, apply_overrides
from jaxpar.errors import ConfigError
from jaxpar.model import ATTENTION, STAGES
from jaxpar.models.llama import LlamaConfig

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@dataclasses.dataclass(frozen=True)
class Renamed:
    """A user's decoder in its own words: jaxpar's names are properties over its fields."""

    depth: int = 2
    n_heads: int = 4
    width: int = 32

    task = "lm"
    vocab_size = 128
    capabilities = frozenset({STAGES, ATTENTION})
    num_layers = property(lambda self: self.depth)
    num_heads = property(lambda self: self.n_heads)
    num_kv_heads = property(lambda self: self.n_heads)
    head_dim = property(lambda self: self.width // self.n_heads)  # two fields: no one field to name

    def build(self, rngs):
        return LlamaConfig(vocab_size=128, embed=self.width, num_layers=self.depth, num_heads=self.n_heads,
                           num_kv_heads=self.n_heads, head_dim=self.width // self.n_heads).build(rngs)

    def param_count(self):
        return 1

    def flops_per_token(self, seq_len):
        return 1.0


def variant(**members):
    """Renamed with class members replaced, as a user's one-line mistake."""
    return dataclasses.dataclass(frozen=True)(type("MyRenamed", (Renamed,), members))()


def refusal(model, *overrides: str, devices: int = 8) -> str:
    config = Config(model=model, train=TrainConfig(steps=3, global_batch=16, seq_len=16, compute_dtype="float32"))
    with pytest.raises(ConfigError) as info:
        validate(apply_overrides(config, list(overrides)), devices, "cpu")
    return f"{info.value.rule}: {info.value}"


class Plain:  # the contract's four members, on a class that is no dataclass
    task, vocab_size = "lm", 128
    build, param_count, flops_per_token = Renamed.build, Renamed.param_count, Renamed.flops_per_token


class NoStack(nnx.Module):  # a module without the pipeline's pieces
    def __init__(self, rngs):
        pass


CASES = {
    "mesh_divides field": (variant(mesh_divides={"tensor": ("n_head",)}), ["mesh.tensor=4"],
                           ("model-contract: model MyRenamed's mesh_divides['tensor'] names 'n_head', which it lacks "
                            "(did you mean 'n_heads'?); name integer fields of the config, such as depth")),
    "mesh_divides axis": (variant(mesh_divides={"tensr": ("n_heads",)}), [],
                          ("model-contract: model MyRenamed's mesh_divides names mesh axis 'tensr' (did you mean "
                           "'tensor'?); use one of stage, data")),
    "stages without pieces": (variant(build=lambda self, rngs: NoStack(rngs)), ["mesh.stage=2"],
                              ("model-contract: model MyRenamed declares the 'stages' capability, but its module "
                               "NoStack lacks layers, embed, apply_layers, output (jaxpar.model.PipelineStages")),
    "stages without num_layers": (variant(num_layers=None), ["train.loss_chunks=2"],
                                  ("model-contract: model MyRenamed declares the 'stages' capability but has no "
                                   "num_layers")),
    "lm without vocab_size": (variant(vocab_size=None), [],
                              "model-contract: model MyRenamed: task='lm' reads model.vocab_size (the token ids"),
    "classify without inputs": (variant(task="classify", num_classes=4), [],
                                ("model-contract: model MyRenamed: task='classify' reads model.in_features or "
                                 "model.input_shape (each example's inputs), which the config lacks")),
    "classify without classes": (variant(task="classify", in_features=16), [],
                                 "model-contract: model MyRenamed: task='classify' reads model.num_classes"),
    "not a dataclass": (Plain(), [], "model-contract: model Plain is not a frozen dataclass"),
    "not frozen": (dataclasses.dataclass(type("Loose", (Plain,), {}))(), [],
                   "model-contract: model Loose is not a frozen dataclass"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_contract_mistakes_are_one_line(name):
    model, overrides, start = CASES[name]
    assert refusal(model, *overrides).startswith(start)


def test_stages_pieces_are_asked_only_of_a_pipelined_run():
    """The module is built (abstractly) to ask it only where a pipeline or the chunked loss
    calls the pieces; a model whose module lacks them trains without them."""
    assert validate(Config(model=variant(build=lambda self, rngs: NoStack(rngs))), 8, "cpu")["data"] == 8


def test_a_sequence_past_the_position_table_is_refused():
    """examples/gpt2.py (n_positions=64) with train.seq_len=128 compiled, then trained on NaN."""
    config = recipes.load(str(EXAMPLES / "gpt2.py"))
    assert validate(config, 8, "cpu")["tensor"] == 2  # its own 64 tokens fit
    with pytest.raises(ConfigError) as info:
        validate(apply_overrides(config, ["train.seq_len=128"]), 8, "cpu")
    assert info.value.rule == "model-contract"
    assert str(info.value) == ("train.seq_len=128 is longer than the 64 positions model GPT2Config covers "
                               "(model.n_positions=64); use train.seq_len <= 64, or a larger model.n_positions")


def test_errors_name_the_field_an_alias_reads():
    assert refusal(Renamed(), "mesh.stage=4") == (
        "pipeline-layers-split: model.depth=2 does not split evenly into mesh.stage x parallel.pipeline.chunks = "
        "4 x 1 = 4 chunks; use parallel.pipeline.balance=balanced (here parallel.pipeline.layers=0,1*2,0), "
        "model.depth a multiple of 4, or mesh.stage in [2]")
    assert "(model.n_heads=4 / mesh.tensor=2)" in refusal(
        Renamed(), "mesh.tensor=2", "mesh.context=4", "parallel.context.impl=ulysses")


def test_an_alias_no_field_holds_is_marked_as_one_set_cannot_change():
    from jaxpar.model import field_name

    model = variant(num_layers=3)
    assert field_name(model, "num_layers", 3) == ("the model's num_layers=3 (a class attribute of MyRenamed, "
                                                  "not a field --set can change)")
    assert field_name(model, "head_dim") == ("the model's head_dim (a property of MyRenamed, "
                                             "not a field --set can change)")
    assert field_name(LlamaConfig(), "num_layers", 2) == "model.num_layers=2"
