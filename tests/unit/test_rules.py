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
        parse_table(text, "parallel.rules.storage")


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


def test_key_value_heads_the_tensor_split_does_not_divide_rest_whole_and_are_repeated_at_use():
    """Gemma 3 1B's attention on mesh.tensor=4: 4 query heads, 1 key/value head. The kv
    weight rests whole over tensor (fsdp still splits it), is repeated 4 times once gathered
    and split over tensor: each device computes with one copy of the head. Its gradient is
    the sum of the copies'. Query head i reads kv head i // (heads / kv) before and after."""
    from jaxpar.config import Config, TrainConfig, apply_overrides
    from jaxpar.models.llama import LlamaConfig
    from jaxpar.sharding import use_layout
    from jaxpar.sharding.annotate import gather_param
    from jaxpar.sharding.rules import kv_heads_repeat
    from jaxpar.step.layout import kv_repeats, layout_for

    assert [kv_heads_repeat(kv, 4) for kv in (1, 2, 4, 8)] == [4, 2, 1, 1]
    assert kv_heads_repeat(2, 2, context=2) == 2 and kv_heads_repeat(3, 2) == 2  # lcm(kv, tensor x Ulysses) / kv
    config = Config(model=LlamaConfig(vocab_size=64, embed=16, num_layers=1, num_heads=4, num_kv_heads=1, head_dim=8,
                                      mlp=32), train=TrainConfig(global_batch=8, seq_len=8, compute_dtype="float32"))
    config = apply_overrides(config, ["mesh.fsdp=2", "mesh.tensor=4"])
    assert kv_repeats(config, {"stage": 1, "data": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 4}) == (("kv_heads", 4),)
    layout = layout_for(config, jax.devices(), {"stage": 1, "data": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 4})
    names = ("embed", "kv_heads", "head_dim")
    assert layout.param_spec(names, (16, 1, 8)) == P("fsdp", None, None)  # whole over tensor
    w = jax.random.normal(jax.random.key(0), (16, 1, 8))
    stored = jax.device_put(w, jax.sharding.NamedSharding(layout.mesh, layout.param_spec(names, w.shape)))

    def used(w):
        with use_layout(layout):
            return gather_param(w, names, layout)

    value = jax.jit(used)(stored)
    assert value.shape == (16, 4, 8) and value.sharding.spec == P(None, "tensor")
    assert {s.data.shape for s in value.addressable_shards} == {(16, 1, 8)}  # one head a device
    assert (jax.device_get(value) == jax.numpy.repeat(w, 4, axis=1)).all()
    grad = jax.jit(jax.grad(lambda w: (used(w) * jax.numpy.arange(4.0)[None, :, None]).sum()))(stored)
    assert jax.numpy.allclose(grad, 6.0)  # the copies' gradients added: 0 + 1 + 2 + 3
    assert kv_repeats(apply_overrides(config, ["model.num_kv_heads=4"]), layout.mesh.shape) == ()
