"""parallel.attention: which attention runs over an unsharded sequence.

`flash` (jaxpar's blockwise kernel) equals the reference attention, values and gradients,
fp32 to 1e-5, with packed segments, and trains a sharded Llama to the single-device run's
numbers. `cudnn` (cuDNN's fused kernel through jax.nn.dot_product_attention) runs on GPUs
only: here its choice is tested (auto picks it exactly where it applies, and an explicit
request where it cannot run is refused before compile), not its numbers.

Its sharded Llama run is tests/equivalence/test_attention_choice.py.
"""

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
    if want == "cudnn":  # cuDNN's custom partitioning fails inside the pipeline's shard_map
        assert _attention(config, where, stage=2) == "flash"


def test_a_deviceless_compile_keeps_cudnn_to_the_head_dims_jax_allows_it(tiny_llama):
    """Compiling for H100s from the CPU backend (jaxpar.deviceless), JAX's own check sees no
    Hopper and allows cuDNN heads up to 128 only: auto picks flash for DeepSeek's 192, rather
    than an attention JAX refuses at trace time."""
    config = apply_overrides(tiny_llama, ["train.compute_dtype=bfloat16", "model.head_dim=192"])
    assert _attention(config, device()) == "flash"
    assert _attention(apply_overrides(config, ["model.head_dim=128"]), device()) == "cudnn"


def test_cudnn_is_refused_off_gpus_before_compile(tiny_llama):
    config = apply_overrides(tiny_llama, ["parallel.attention=cudnn"])
    with pytest.raises(ConfigError, match=r"parallel.attention=cudnn: cuDNN attention runs on GPUs, but the devices are cpu"):
        build(config)
    assert cudnn_attention_problem(apply_overrides(config, ["train.compute_dtype=bfloat16"]), "gpu", device()) is None
