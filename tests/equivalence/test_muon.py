"""Muon (jaxpar.step.muon) and its Newton-Schulz kernel (jaxpar.kernels.newton_schulz).

- The kernel: the iteration orthogonalises; on a stack it agrees with optax's
  `orthogonalize_via_newton_schulz` (1e-5); sharded (pieces of matrices over devices,
  replicas, stacks the devices do not divide) it equals the one-device stack (1e-5).
- The update rule equals its definition (the module docstring, written out in numpy here)
  and optax's `contrib.muon` where the two definitions meet (no Nesterov), 1e-5 after three
  steps.
- Parameters cut alike are orthogonalised as one stack, each equal to its reference; the
  bfloat16 iteration (optim.ns_dtype) sharded equals its one-device reference and moves bfloat16.
- Training under data x ZeRO-1, fsdp x tensor, expert x data (MoE) and 1F1B stages x data
  equals one device (fp32; losses, first-step gradients and parameters after three steps
  within 1e-5).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import _muon as optax_muon

from jaxpar.config import Config, OptimConfig, TrainConfig, apply_overrides
from jaxpar.inspect import inspect_step
from jaxpar.inspect.explain import explain
from jaxpar.kernels.newton_schulz import (Iteration, MatrixAxes, newton_schulz, orthogonalize, orthogonalize_sharded,
                                         orthogonalize_together, share_key)
from jaxpar.models.llama import LlamaConfig
from jaxpar.models.moe import MoEConfig
from jaxpar.sharding import ParamNames
from jaxpar.step.muon import Matrix, find_matrices, matrix_axes, muon
from jaxpar.testing import check, compare, reference_run, run_layout
from jaxpar.train import build

MUON = ["optim.name=muon", "optim.lr=0.02", "optim.warmup_steps=0"]


def _draw(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def test_newton_schulz_orthogonalises_either_orientation():
    x = _draw((16, 40))
    singular = np.linalg.svd(np.asarray(newton_schulz(x)), compute_uv=False)
    assert 0.6 < singular.min() and singular.max() < 1.3, singular  # Jordan's coefficients: near 1, not at it
    np.testing.assert_allclose(newton_schulz(x.T), newton_schulz(x).T, atol=1e-6)


def test_a_stack_agrees_with_optax():
    x = _draw((3, 16, 4, 8))  # layers, embed, heads, head_dim: each layer's 16 x 32 matrix
    ours = orthogonalize(x, MatrixAxes((0,), (1,), (2, 3)))
    theirs = optax_muon.orthogonalize_via_newton_schulz(
        x, jnp.asarray(optax_muon._DEFAULT_NS_COEFFS), 5, eps=1e-7,
        dimension_numbers=optax_muon.MuonDimensionNumbers((1,), (2, 3)))
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize("spec", [
    P(None, "fsdp", "tensor"),  # a matrix in four pieces; data idle (a replica)
    P(None, ("data", "fsdp"), "tensor"),  # two axes on one dim
    P(None, None, None, "tensor"),  # pieces on the last output dim; data and fsdp idle
    P(),  # whole on every device: the eight share the stack
])
def test_sharded_stack_equals_one_device(spec):
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    x, axes = _draw((3, 16, 4, 8), seed=1), MatrixAxes((0,), (1,), (2, 3))  # 3 matrices: padded to the 8 devices
    placed = jax.device_put(x, NamedSharding(mesh, spec))
    out = jax.jit(lambda x: orthogonalize_sharded(x, axes, spec, mesh))(placed)
    assert out.sharding.spec == placed.sharding.spec
    np.testing.assert_allclose(out, orthogonalize(x, axes), atol=1e-5)


def _mesh():
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)


def test_parameters_cut_alike_are_orthogonalised_together():
    """Two stacks of 3 and 2 matrices cut alike join one stack (one set of all-to-alls, one
    padding) and each equals its one-device reference; a stack cut otherwise has another key."""
    mesh, spec, axes = _mesh(), P(None, "fsdp", "tensor"), MatrixAxes((0,), (1,), (2, 3))
    xs = [_draw((3, 16, 4, 8), seed=1), _draw((2, 16, 4, 8), seed=2)]
    key = share_key((3, 16, 4, 8), axes, spec, mesh)
    assert key == share_key((2, 16, 4, 8), axes, spec, mesh)
    swapped = P(None, "tensor", "fsdp")  # the same piece shape, made whole by other all-to-alls
    assert key[1] == share_key((3, 16, 4, 8), axes, swapped, mesh)[1] and key != share_key((3, 16, 4, 8), axes,
                                                                                            swapped, mesh)
    assert key != share_key((3, 16, 4, 8), axes, spec, mesh, held=("data",))  # DiLoCo's groups: not replicas
    with pytest.raises(ValueError, match="cut differently"):
        orthogonalize_together(xs, [axes, axes], [spec, swapped], mesh)
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in xs]
    together = jax.jit(lambda a, b: orthogonalize_together([a, b], [axes, axes], [spec, spec], mesh))
    for out, x in zip(together(*placed), xs):
        np.testing.assert_allclose(out, orthogonalize(x, axes), atol=1e-5)
    apart = jax.jit(lambda a, b: [orthogonalize_sharded(x, axes, spec, mesh) for x in (a, b)])
    count = lambda f: f.lower(*placed).compile().as_text().count(" all-to-all(")  # noqa: E731
    assert count(together) == 4 and count(apart) == 8  # fsdp and tensor, there and back


def test_bfloat16_iterations_equal_their_reference_and_travel_in_bfloat16():
    """optim.ns_dtype=bfloat16: sharded equals the one-device bfloat16 reference, the pieces
    move as bfloat16, and the result stays near the float32 iteration's."""
    mesh, spec, axes = _mesh(), P(None, "fsdp", "tensor"), MatrixAxes((0,), (1,), (2, 3))
    x, half = _draw((3, 16, 4, 8), seed=1), Iteration(dtype="bfloat16")
    run = jax.jit(lambda x: orthogonalize_sharded(x, axes, spec, mesh, half))
    placed = jax.device_put(x, NamedSharding(mesh, spec))
    out, want = run(placed), orthogonalize(x, axes, half)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, atol=1e-6)
    # as lowered: XLA:CPU widens bfloat16 collectives to float32 when it compiles; a GPU's do not
    exchanges = [line for line in run.lower(placed).as_text().splitlines() if "all_to_all" in line]
    assert len(exchanges) == 4 and all("bf16" in line and "f32" not in line for line in exchanges), exchanges
    assert 1e-4 < float(jnp.abs(want - orthogonalize(x, axes)).max()) < 0.05  # rounded, not another answer


# ------------------------------------------------------------------ the update rule

NAMES = {"w": ("embed", "mlp"), "stack": ("layers", "heads", "head_dim", "embed"), "norm": ("embed",)}
SHAPES = {"w": (8, 16), "stack": (2, 4, 3, 8), "norm": (8,)}


def _tree_matrices():
    names = {k: ParamNames(v) for k, v in NAMES.items()}
    return find_matrices(LlamaConfig(), names)


def _run(tx, steps=3):
    params = {k: _draw(s, seed=i) for i, (k, s) in enumerate(SHAPES.items())}
    state, update = tx.init(params), jax.jit(tx.update)
    for t in range(steps):
        grads = {k: _draw(s, seed=10 * t + i + 3) for i, (k, s) in enumerate(SHAPES.items())}
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _definition(optim, steps=3):
    """The module docstring's rule, one matrix at a time in numpy; AdamW (optax's) on the norm."""
    params = {k: np.asarray(_draw(s, seed=i), np.float64) for i, (k, s) in enumerate(SHAPES.items())}
    momentum = {k: np.zeros(s) for k, s in SHAPES.items()}
    adam = optax.adamw(optim.lr, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay)
    adam_state = adam.init(jnp.asarray(params["norm"], jnp.float32))
    sides = {"w": ((0,), (1,)), "stack": ((1, 2), (3,))}  # rows, cols after the stack dim
    orthogonal, adam_update = jax.jit(newton_schulz), jax.jit(adam.update)
    for t in range(steps):
        grads = {k: np.asarray(_draw(s, seed=10 * t + i + 3), np.float64) for i, (k, s) in enumerate(SHAPES.items())}
        for k in ("w", "stack"):
            momentum[k] = optim.momentum * momentum[k] + grads[k]
            u = grads[k] + optim.momentum * momentum[k] if optim.nesterov else momentum[k]
            u = u.reshape((-1, *u.shape[-len(sides[k][0]) - 1:])) if k == "stack" else u[None]
            rows, cols = int(np.prod(u.shape[1:1 + len(sides[k][0])])), int(np.prod(u.shape[1 + len(sides[k][0]):]))
            scale = optim.muon_rms * max(rows, cols) ** 0.5 if optim.muon_scale == "rms" else max(1, cols / rows) ** 0.5
            o = np.stack([np.asarray(orthogonal(jnp.asarray(m.reshape(rows, cols), jnp.float32))) for m in u])
            params[k] = params[k] - optim.lr * (scale * o.reshape(params[k].shape) + optim.weight_decay * params[k])
        updates, adam_state = adam_update(jnp.asarray(grads["norm"], jnp.float32), adam_state,
                                          jnp.asarray(params["norm"], jnp.float32))
        params["norm"] = params["norm"] + np.asarray(updates, np.float64)
    return params


@pytest.mark.parametrize("settings", [dict(), dict(nesterov=False, muon_scale="shape")])
def test_the_rule_is_its_definition(settings):
    optim = OptimConfig(name="muon", lr=0.05, weight_decay=0.1, **settings)
    ours = _run(muon(optim.lr, optim, _tree_matrices()))
    want = _definition(optim)
    for k in SHAPES:
        np.testing.assert_allclose(ours[k], want[k], atol=1e-5, err_msg=k)


@pytest.mark.parametrize("scale", ["rms", "shape"])
def test_without_nesterov_it_is_optax_muon(scale):
    """optax averages its momentum and corrects its bias: proportional to ours, which the
    Newton-Schulz normalisation cancels; AdamW on the rest at the same settings."""
    optim = OptimConfig(name="muon", lr=0.05, weight_decay=0.1, nesterov=False, muon_scale=scale)
    dims = {"w": optax_muon.MuonDimensionNumbers(0, 1), "stack": optax_muon.MuonDimensionNumbers((1, 2), 3), "norm": None}
    theirs = optax.contrib.muon(optim.lr, beta=optim.momentum, eps=optim.eps, weight_decay=optim.weight_decay,
                                nesterov=False, adam_b1=optim.b1, adam_b2=optim.b2,
                                adam_weight_decay=optim.weight_decay, muon_weight_dimension_numbers=dims,
                                consistent_rms=optim.muon_rms if scale == "rms" else None)
    ours, want = _run(muon(optim.lr, optim, _tree_matrices())), _run(theirs)
    for k in SHAPES:
        np.testing.assert_allclose(ours[k], want[k], atol=1e-5, err_msg=k)


def test_which_parameters_are_matrices():
    stack = ("layers", "experts")
    assert matrix_axes(("layers", "embed", "heads", "head_dim"), stack) == MatrixAxes((0,), (1,), (2, 3))
    assert matrix_axes(("layers", "heads", "head_dim", "embed"), stack) == MatrixAxes((0,), (1, 2), (3,))
    assert matrix_axes(("layers", "experts", "embed", "expert_mlp"), stack) == MatrixAxes((0, 1), (2,), (3,))
    assert matrix_axes(("layers", "embed", None), stack) == MatrixAxes((0,), (1,), (2,))  # a router
    assert matrix_axes(("vocab", "embed"), stack) is None  # the embedding and the head: AdamW
    assert matrix_axes(("layers", "embed"), stack) is None  # a norm's stack
    # the model's own: Qwen2-style biases (heads x head_dim) are no matrices
    names = {"layers": {"attn": {"bq": ParamNames(("layers", "heads", "head_dim")),
                                 "wq": ParamNames(("layers", "embed", "heads", "head_dim"))}}}
    assert set(find_matrices(LlamaConfig(qkv_bias=True), names)) == {"layers.attn.wq"}
    assert isinstance(find_matrices(LlamaConfig(), names)["layers.attn.wq"], Matrix)


# ------------------------------------------------------------------ training under layouts

def _llama(layers=2) -> Config:
    return apply_overrides(Config(
        model=LlamaConfig(vocab_size=128, embed=32, num_layers=layers, num_heads=4, num_kv_heads=4, head_dim=8, mlp=64),
        train=TrainConfig(steps=3, global_batch=16, seq_len=16, compute_dtype="float32")), MUON)


def _moe() -> Config:
    return apply_overrides(Config(
        model=MoEConfig(vocab_size=128, embed=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, mlp=32,
                        num_experts=8, top_k=2, capacity_factor=1.0),
        train=TrainConfig(steps=3, global_batch=16, seq_len=16, compute_dtype="float32")), MUON)


LAYOUTS = {
    "data8_zero1": (_llama, ["mesh.data=8", "parallel.zero.stage=1"]),
    "data2_fsdp2_tensor2": (_llama, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    "expert4_data2": (_moe, ["mesh.data=2", "mesh.expert=4"]),
    "1f1b_stage2_data2_tensor2_zero1": (lambda: _llama(4), ["mesh.stage=2", "mesh.data=2", "mesh.tensor=2",
                                                            "parallel.zero.stage=1", "train.microbatches=4"]),
}


def test_explain_counts_the_orthogonalisation():
    """fsdp x tensor pieces of each matrix, data replicas: the all-to-alls and gathers and the
    Newton-Schulz FLOPs equal their formulas (jaxpar.inspect.optimizer), and the step's
    matmul row counts the latter beside the model's."""
    trainer = build(apply_overrides(_llama(), ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]))
    doc = explain(trainer, inspect_step(trainer))
    assert doc["muon_matrices"] == 7
    for key in ("muon_traffic", "muon_flops"):
        assert doc[key]["measured"] > 0 and doc[key]["ratio"] == pytest.approx(1.0, abs=1e-3), (key, doc[key])
    assert doc["flops"]["ratio"] == pytest.approx(1.0, abs=0.02)
    assert doc["gradient_traffic"]["ratio"] == pytest.approx(1.0, abs=0.05)  # Muon's own collectives are not counted there


@pytest.mark.parametrize("name", LAYOUTS)
def test_muon_under_a_layout_equals_one_device(reference, name):
    make, layout = LAYOUTS[name]
    base = apply_overrides(make(), [o for o in layout if o.startswith("train.")])
    check(compare(run_layout(apply_overrides(base, layout)), reference(base)), 1e-5, where=name)


def test_the_bfloat16_iteration_under_fsdp_and_tensor_equals_one_device_to_its_rounding():
    """optim.ns_dtype=bfloat16 on both sides. The sharded gradients differ from one device's
    by float32 rounding (1e-6), which can move an input of the iteration across a bfloat16
    rounding boundary, and 5 bfloat16 iterations carry that on: the parameters after 3
    steps agree to 1e-2 (measured 1.6e-3), the losses to 1e-4. A piece put back in the wrong
    place would be off by the size of the update itself."""
    base = apply_overrides(_llama(), ["optim.ns_dtype=bfloat16"])
    c = compare(run_layout(apply_overrides(base, ["mesh.fsdp=4", "mesh.tensor=2"])), reference_run(base))
    check(c, 1e-4, param_rtol=1e-2, where="fsdp4_tensor2_ns_bf16")

