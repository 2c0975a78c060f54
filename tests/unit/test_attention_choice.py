"""parallel.attention: which attention runs over an unsharded sequence.

`flash` (jaxpar's blockwise kernel) equals the reference attention, values and gradients,
fp32 to 1e-5, with packed segments, and trains a sharded Llama to the single-device run's
numbers. `cudnn` (cuDNN's fused kernel through jax.nn.dot_product_attention) runs on GPUs
only: here its choice is tested (auto picks it exactly where it applies, and an explicit
request where it cannot run is refused before compile), not its numbers.

Its sharded Llama run is tests/equivalence/test_attention_choice.py.
"""

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.checks.backend import cudnn_attention_problem
from jaxpar.config import apply_overrides
from jaxpar.errors import ConfigError
from jaxpar.mesh import MeshConfig, make_mesh
from jaxpar.config import ContextConfig
from jaxpar.sharding import Layout, attend, default_rules, use_layout
from jaxpar.testing import tree_error
from jaxpar.train import build
from jaxpar.step.layout import attention as _attention


def test_flash_equals_reference_with_packed_segments():
    mesh = make_mesh(MeshConfig(data=1), jax.devices()[:1])
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 24, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 24, 2, 8)), jnp.float32) for _ in range(2))
    segments = jnp.asarray(np.repeat([[0, 1, 2], [0, 0, 1]], 8, axis=1), jnp.int32)

    def loss(impl):
        # Tiles of 8 over 24 tokens: segments cross tile boundaries.
        layout = Layout(mesh, default_rules(mesh.shape, False), context=ContextConfig(block=8), attention=impl)

        def f(q, k, v):
            with use_layout(layout):
                return jnp.sum(jnp.sin(attend(q, k, v, segments)))

        return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    assert tree_error(loss("flash"), loss("reference")) < 1e-5


def test_the_fused_kernel_runs_on_each_devices_heads_inside_a_pipeline_stage(monkeypatch):
    """cuDNN's kernel is called inside a shard_map manual over every axis, so its custom
    partitioning (which fails inside the pipeline executor's shard_map, manual over the stage
    axis only) never runs. Here in a shard_map manual over `stage`, with the batch over `data`
    and the heads (4 query, 2 key/value) over `tensor`; JAX's "xla" implementation stands in
    for cuDNN's, which needs a GPU: values and gradients equal the reference, fp32 to 1e-5."""
    import functools

    from jax.sharding import PartitionSpec as P

    attend_module = sys.modules["jaxpar.sharding.attend"]  # the module; jaxpar.sharding.attend is its function
    mesh = make_mesh(MeshConfig(stage=2, data=2, tensor=2), jax.devices()[:8])
    monkeypatch.setattr(attend_module, "fused_attention",
                        functools.partial(attend_module.fused_attention, implementation="xla"))
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 4, 16, 4, 8)), jnp.float32)  # [stage, B, S, H, K]
    k, v = (jnp.asarray(rng.standard_normal((2, 4, 16, 2, 8)), jnp.float32) for _ in range(2))

    def loss(impl):
        layout = Layout(mesh, default_rules(mesh.shape, False), attention=impl)

        def stage(q, k, v):  # one stage's share, as the executor runs it
            with use_layout(layout):
                return jnp.sum(jnp.sin(attend(q[0], k[0], v[0])))[None]

        staged = jax.shard_map(stage, mesh=mesh, in_specs=P("stage"), out_specs=P("stage"), axis_names={"stage"},
                               check_vma=False)
        return jax.value_and_grad(lambda *a: jnp.sum(staged(*a)), argnums=(0, 1, 2))(q, k, v)

    assert tree_error(jax.jit(lambda: loss("cudnn"))(), jax.jit(lambda: loss("reference"))()) < 1e-5


def device(platform="gpu", capability="9.0", version="cuda 12080"):
    """What _attention reads of a jax.Device."""
    return types.SimpleNamespace(platform=platform, compute_capability=capability, device_kind=f"{platform} {capability}",
                                 client=types.SimpleNamespace(platform_version=version))


@pytest.mark.parametrize(
    "overrides, where, want",
    [
        ([], device(), "cudnn"),
        ([], device("cpu", None), "reference"),
        # on GPUs where cuDNN's does not apply, the blockwise kernel: no [S, S] scores held
        ([], device(capability="7.0"), "flash"),  # V100: cuDNN's fused attention needs 8.0
        ([], device(version="rocm 6.2"), "flash"),
        (["data.eos_id=0"], device(), "flash"),  # packed documents: segment ids
        (["train.compute_dtype=float32"], device(), "flash"),
        (["model.head_dim=264"], device(), "flash"),
        (["model.head_dim=192"], device(), "cudnn"),  # DeepSeek-V3's query heads: up to 256 on a Hopper GPU
        (["model.head_dim=192"], device(capability="8.0"), "flash"),  # an A100: up to 128
        (["parallel.attention=flash"], device(), "flash"),
    ],
)
def test_auto_picks_cudnn_where_it_applies(tiny_llama, overrides, where, want, monkeypatch):
    monkeypatch.setattr("jaxpar.checks.backend._runs_on_gpu", lambda: True)  # as in a process on that GPU
    config = apply_overrides(tiny_llama, ["train.compute_dtype=bfloat16"] + overrides)
    assert _attention(config, where) == want
    assert _attention(config, where, context=2) == "reference"  # context-parallel kernels run instead


def test_cudnn_heads_up_to_256_need_a_hopper_that_jax_asks(tiny_llama, monkeypatch):
    """JAX allows cuDNN heads up to 256 only if the GPU it asks is a Hopper: with no GPU
    backend and no deviceless target, 128, so auto picks flash for DeepSeek's 192 rather than
    an attention JAX refuses at trace time; compiling for H100s without them
    (jaxpar.deviceless), the target answers, and cuDNN it is."""
    config = apply_overrides(tiny_llama, ["train.compute_dtype=bfloat16", "model.head_dim=192"])
    assert _attention(config, device()) == "flash"
    assert _attention(apply_overrides(config, ["model.head_dim=128"]), device()) == "cudnn"
    monkeypatch.setattr(sys.modules["jaxpar.deviceless"], "_TARGET", ["9.0"])
    assert _attention(config, device()) == "cudnn"


def test_cudnn_is_refused_off_gpus_before_compile(tiny_llama):
    config = apply_overrides(tiny_llama, ["parallel.attention=cudnn"])
    with pytest.raises(ConfigError, match=r"parallel.attention=cudnn: cuDNN attention runs on GPUs, but the devices are cpu"):
        build(config)
    assert cudnn_attention_problem(apply_overrides(config, ["train.compute_dtype=bfloat16"]), "gpu", device()) is None
