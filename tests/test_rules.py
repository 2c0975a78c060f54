import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.mesh import MeshConfig, make_mesh
from jaxpar.sharding import Layout, Rules, default_rules, param_names, parse_table, shardings_for


def test_storage_shards_embed_over_fsdp_compute_gathers_it():
    rules = default_rules({"data": 2, "fsdp": 2, "tensor": 2}, sequence_parallel=True)
    assert rules.spec(("embed", "mlp"), "storage") == P("fsdp", "tensor")
    assert rules.spec(("embed", "mlp"), "compute") == P(None, "tensor")
    assert rules.spec(("batch", "norm_seq", "embed"), "compute") == P(("data", "fsdp"), "tensor", None)
    assert rules.spec(("batch", "seq", "embed"), "compute") == P(("data", "fsdp"), None, None)


def test_axes_of_size_one_and_sequence_parallel_off():
    rules = default_rules({"data": 8}, sequence_parallel=False)
    assert rules.spec(("batch", "norm_seq", "embed"), "compute") == P("data", None, None)
    assert rules.spec(("embed", "heads", "head_dim"), "storage") == P(None, None, None)


def test_a_mesh_axis_is_used_once_per_array():
    rules = Rules.of({}, {"heads": ("tensor",), "kv_heads": ("tensor",)})
    assert rules.spec(("heads", "kv_heads"), "compute") == P("tensor", None)


def test_user_overrides_replace_entries():
    rules = default_rules({"fsdp": 4, "tensor": 2}, False).with_overrides(storage=parse_table("mlp=fsdp+tensor,embed=", "x"))
    assert rules.spec(("embed", "mlp"), "storage") == P(None, ("fsdp", "tensor"))


@pytest.mark.parametrize("text, message", [("embed", "is not 'logical=axis"), ("embed=gpu", "unknown mesh axis 'gpu'")])
def test_bad_rule_text(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_table(text, "parallel.storage_rules")


class Tiny(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.ones, ("embed", "mlp"))
        self.w = nnx.Param(init(rngs.params(), (6, 8)))
        self.b = nnx.Param(nnx.initializers.zeros(rngs.params(), (8,)))


def test_nnx_annotations_become_named_shardings():
    with nnx.use_eager_sharding(False):
        state = nnx.state(nnx.eval_shape(lambda: Tiny(nnx.Rngs(0))))
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    layout = Layout(mesh, default_rules(mesh.shape, False))
    names = param_names(state)
    shardings = shardings_for(names, nnx.to_pure_dict(state), layout)
    assert shardings["w"].spec == P("fsdp", "tensor")
    assert shardings["b"].spec == P(None)  # unannotated: replicated
    layout4 = Layout(make_mesh(MeshConfig(fsdp=4, tensor=2)), default_rules({"fsdp": 4, "tensor": 2}, False))
    with pytest.raises(ConfigError, match=r"\['w'\]: dimension 0 \('embed'\) has size 6, which mesh fsdp=4 does not divide"):
        shardings_for(names, nnx.to_pure_dict(state), layout4)


def test_constrain_is_identity_without_layout_and_shards_with_one():
    from jaxpar.sharding import constrain, use_layout

    x = jax.numpy.ones((8, 4))
    assert constrain(x, ("batch", "embed")) is x
    mesh = make_mesh(MeshConfig(data=8))
    with use_layout(Layout(mesh, default_rules(mesh.shape, False))):
        y = jax.jit(lambda a: constrain(a * 2, ("batch", "embed")))(x)
    assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("data", None)), 2)
