"""Silent replication is found before compile: a model with its own logical names on a mesh
that shards parameters is reported (jaxpar.sharding.replicated); jaxpar's own models under
their recipes are not. Layouts only, nothing compiles."""

import warnings

import jax
import pytest
from flax import nnx

from jaxpar import recipes
from jaxpar.config import Config
from jaxpar.errors import ConfigError
from jaxpar.mesh import MeshConfig, make_mesh
from jaxpar.model import axis_names
from jaxpar.models.llama import LlamaConfig
from jaxpar.sharding import Layout, default_rules, param_names, parse_table
from jaxpar.sharding.replicated import (
    ReplicatedParams,
    replicated_params,
    replication_message,
    report_replicated,
)


class OwnNames(nnx.Module):
    """A user's model: its own logical names, tok/dm/ff, that no default rule knows."""

    def __init__(self, rngs: nnx.Rngs):
        def param(names, shape):
            return nnx.Param(nnx.with_partitioning(nnx.initializers.normal(0.02), names)(rngs.params(), shape))

        self.embed = param(("tok", "dm"), (128, 32))
        self.up = param(("dm", "ff"), (32, 64))
        self.down = param(("ff", "dm"), (64, 32))
        self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, ("dm",))(rngs.params(), (32,)))
        self.stacked_scale = param(("layers", "dm"), (2, 32))  # a vector per layer


def abstract(make):
    """(names, shapes) of a model's parameters, without allocating them."""
    with nnx.use_eager_sharding(False):
        _, state = nnx.split(nnx.eval_shape(make))
    return param_names(state), nnx.to_pure_dict(state)


def layout(mesh: MeshConfig, storage: str = "", aliases=None) -> Layout:
    mesh_ = make_mesh(mesh, jax.devices())
    rules = default_rules(mesh_.shape, False).with_aliases(aliases or {})
    return Layout(mesh_, rules.with_overrides(storage=parse_table(storage, "parallel.rules.storage")))


def recipe_layout(config: Config) -> Layout:
    """The layout `build` makes for a config (its rules part: aliases and overrides)."""
    mesh = make_mesh(config.mesh, jax.devices())
    rules = default_rules(mesh.shape, config.parallel.tensor.sequence_parallel).with_aliases(axis_names(config.model))
    rules = rules.with_overrides(storage=parse_table(config.parallel.rules.storage, "parallel.rules.storage"))
    return Layout(mesh, rules)


FSDP2_TP4 = MeshConfig(data=1, fsdp=2, tensor=4)


def own_entries(**kw):
    return replicated_params(*abstract(lambda: OwnNames(nnx.Rngs(0))), layout(FSDP2_TP4, **kw))


def test_own_names_are_reported_with_a_rule_that_would_shard_them():
    entries = own_entries()
    assert [e.path for e in entries] == ["down", "embed", "up"]  # not the vectors, stacked or not
    by_path = {e.path: e for e in entries}
    assert by_path["embed"].names == ("tok", "dm") and by_path["embed"].shape == (128, 32)
    # the largest dimension, onto fsdp (which divides it) first
    assert by_path["embed"].rule == "tok=fsdp"
    assert by_path["up"].rule == "ff=fsdp" and by_path["down"].rule == "ff=fsdp"
    assert "parallel.rules.storage='ff=fsdp'" in by_path["up"].suggestion
    assert "axis_names" in by_path["up"].suggestion


def test_rule_overrides_or_axis_names_leave_nothing_to_report():
    assert own_entries(storage="dm=fsdp") == []
    assert own_entries(storage="ff=tensor,tok=fsdp") == []
    assert own_entries(aliases={"tok": "vocab", "dm": "embed", "ff": "mlp"}) == []


def test_a_misspelt_name_is_refused_not_left_whole():
    """A model's axis_names onto no jaxpar name, a storage rule for a name no parameter
    carries, and a parameter with fewer names than dimensions would each leave weights whole
    on every device, silently: each is refused with the name (jaxpar.step.param_checks)."""
    from jaxpar.specs import RulesConfig
    from jaxpar.step.param_checks import check_params

    with pytest.raises(ConfigError, match=r"axis_names maps 'ff' to 'mpl', which is no jaxpar logical name "
                                          r"\(did you mean 'mlp'\?\)"):
        layout(FSDP2_TP4, aliases={"dm": "embed", "ff": "mpl"})
    names, shapes = abstract(lambda: OwnNames(nnx.Rngs(0)))
    quiet = RulesConfig(on_replicated="allow")
    check_params(names, shapes, layout(FSDP2_TP4), RulesConfig(storage="ff=tensor,mlp=fsdp", on_replicated="allow"))
    with pytest.raises(ConfigError, match=r"parallel.rules.storage='tk=fsdp': no parameter carries the logical name "
                                          r"'tk' \(did you mean 'tok'\?\); the parameters' names are dm, ff, layers, tok"):
        check_params(names, shapes, layout(FSDP2_TP4), RulesConfig(storage="tk=fsdp"))

    class Short(nnx.Module):
        def __init__(self, rngs):
            self.head = nnx.Param(nnx.with_partitioning(nnx.initializers.zeros, ("dm",))(rngs.params(), (32, 128)))

    with pytest.raises(ConfigError, match=r"parameter head has shape \(32, 128\) but 1 logical name\(s\) \('dm',\)"):
        check_params(*abstract(lambda: Short(nnx.Rngs(0))), layout(FSDP2_TP4), quiet)


def test_a_mesh_that_shards_no_parameter_reports_nothing():
    names, shapes = abstract(lambda: OwnNames(nnx.Rngs(0)))
    assert replicated_params(names, shapes, layout(MeshConfig(data=8))) == []
    assert replicated_params(names, shapes, layout(MeshConfig(data=2, context=4))) == []


def test_a_rule_is_suggested_only_onto_an_axis_that_divides_the_dimension():
    class Odd(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.zeros, ("rows", "cols"))
            self.w = nnx.Param(init(rngs.params(), (6, 4)))  # 6: fsdp=4 no; 4: fsdp=4 yes

    entries = replicated_params(*abstract(lambda: Odd(nnx.Rngs(0))), layout(MeshConfig(data=2, fsdp=4)))
    assert [(e.path, e.rule) for e in entries] == [("w", "cols=fsdp")]


def test_unannotated_matrices_are_reported():
    entries = replicated_params(*abstract(lambda: nnx.Linear(16, 8, rngs=nnx.Rngs(0))), layout(FSDP2_TP4))
    assert [(e.path, e.names, e.rule) for e in entries] == [("kernel", (None, None), "")]
    assert "nnx.with_partitioning" in entries[0].suggestion


def test_llama_on_fsdp_and_tensor_reports_nothing():
    model = LlamaConfig(vocab_size=128, embed=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, mlp=64)
    names, shapes = abstract(lambda: model.build(nnx.Rngs(0)))
    assert replicated_params(names, shapes, layout(MeshConfig(data=2, fsdp=2, tensor=2))) == []
    # tensor only: [layers, embed] norm scales and embed-only dimensions rest whole by design
    assert replicated_params(names, shapes, layout(MeshConfig(data=4, tensor=2))) == []


@pytest.mark.parametrize("name", recipes.names())
def test_shipped_recipes_report_nothing(name):
    config = recipes.load(name)
    names, shapes = abstract(lambda: config.model.build(nnx.Rngs(0)))
    assert replicated_params(names, shapes, recipe_layout(config)) == []


def test_message_names_the_first_parameters_and_counts_the_rest():
    entries = own_entries()
    message = replication_message(entries, limit=2)
    first, *rest = message.splitlines()
    assert first.startswith("3 parameter(s) (8,192 values)")
    # one override for all: `up` needs no rule of its own once ff=fsdp is there
    assert "parallel.rules.storage='tok=fsdp,ff=fsdp'" in first
    assert rest[0].startswith("  embed names=('tok', 'dm') shape=(128, 32)")  # largest first
    assert rest[-1] == "  ... and 1 more"


def test_warn_policy_warns():
    with pytest.warns(ReplicatedParams, match="3 parameter"):
        report_replicated(own_entries(), "warn")


def test_error_policy_refuses_naming_the_parameters():
    with pytest.raises(ConfigError, match=r"^parallel\.rules\.on_replicated=error: 3 parameter") as info:
        report_replicated(own_entries(), "error")
    assert all(path in str(info.value) for path in ("embed", "up", "down"))


def test_allow_policy_and_no_entries_say_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report_replicated(own_entries(), "allow")
        report_replicated([], "warn")
        report_replicated([], "error")


def test_an_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"parallel\.rules\.on_replicated='loud'.*warn, error, allow"):
        report_replicated([], "loud")


def test_the_config_default_is_a_policy():
    report_replicated([], Config(model=LlamaConfig()).parallel.rules.on_replicated)
