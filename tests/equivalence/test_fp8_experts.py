"""FP8 experts (train.matmul_dtype=fp8, jaxpar.kernels.experts.fp8) and the FP8 dispatch
(parallel.expert_dispatch_dtype=fp8, jaxpar.kernels.experts.payload).

- The kernel against its plain reference (each product's blocks quantized and dequantized
  in float32, one float32 matmul): values and both gradients within 1e-6 relative, for
  capacity buffers and grouped rows, DeepSeek's tiles and one scale per row and column.
  And the tiles are real: a row with a huge tile and a tiny one keeps the tiny one under
  1 x b tiles and loses it under one scale per row.
- The payload: once quantized, the matmul's quantization gives the same values again; its
  gradient goes straight through.
- Training, expert x data, capacity and dropless, FP8 experts (tiles of 16, so the
  contraction spans two) and FP8 dispatch, against one device running the same FP8 (fp32
  compute): 1e-4, as tests/equivalence/test_fp8.py states why, and 3e-4 for the parameters
  after three AdamW steps, which divide by the gradients' root mean square (measured:
  losses 4.6e-7 / 1.8e-7, gradients 7.9e-7 / 2.5e-6, parameters 1.2e-7 / 1.1e-4, capacity /
  dropless).
- The compiled step: the experts' matmuls read f8 operands; the dispatch moves uint8,
  the formula's elements once per layer, with a float32 scale per 16, while the combine
  and the backward pass's exchanges stay float32.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxpar.config import apply_overrides
from jaxpar.inspect import formulas
from jaxpar.inspect.hlo import collectives, dot_types
from jaxpar.kernels.experts.fp8 import expert_matmul, reference_expert_matmul, tile
from jaxpar.kernels.experts.payload import dispatched
from jaxpar.kernels.fp8 import FORWARD, dequantize_blocks, quantize_blocks
from jaxpar.testing import check, compare, run_layout
from jaxpar.train import build

from .test_moe_training import tiny_moe  # noqa: F401  (the fixture)


def _rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _problem(grouped: bool):
    kx, kw, kg, ks = jax.random.split(jax.random.key(0), 4)
    e, c, k, n = 4, 64, 256, 256
    x = jax.random.normal(kx, (e, c, k)) * jnp.exp(jax.random.normal(ks, (e, c, 1)))
    w = 0.05 * jax.random.normal(kw, (e, k, n))
    if not grouped:
        return x, w, None, jax.random.normal(kg, (e, c, n))
    sizes = jnp.array([40, 100, 0, 60])  # an empty expert, and rows past the groups
    return x.reshape(e * c, k)[:220], w, sizes, jax.random.normal(kg, (220, n))


@pytest.mark.parametrize("block", [128, 0])
@pytest.mark.parametrize("grouped", [False, True])
def test_kernel_equals_reference_values_and_gradients(grouped, block):
    x, w, sizes, g = _problem(grouped)

    @jax.jit
    def value_and_grads(x, w, sizes, g):
        out = []
        for fn in (expert_matmul, reference_expert_matmul):
            y, vjp = jax.vjp(lambda x, w: fn(x, w, sizes, block), x, w)
            out.append((y, vjp(g)))
        plain = jnp.einsum("eck,ekn->ecn", x, w) if sizes is None else jax.lax.ragged_dot(x, w, sizes)
        return out, plain

    ((y, grads), (y_ref, grads_ref)), plain = value_and_grads(x, w, sizes, g)
    assert y.shape == y_ref.shape and _rel(y, y_ref) < 1e-6
    for got, want in zip(grads, grads_ref):
        assert got.shape == want.shape and _rel(got, want) < 1e-6
    assert 1e-3 < _rel(y, plain) < 0.1  # FP8: about 2^-4 an element, averaged down over the contraction
    if sizes is not None:
        assert float(jnp.abs(y[200:]).max()) == 0.0  # rows past the groups


def test_tiles_keep_what_one_scale_a_row_loses():
    """A row whose first 128 elements are 2^20 times its last 128: with one scale for the
    row, the small tile falls below e4m3's smallest subnormal (2^-9 of the scale's range)."""
    x = jnp.concatenate([jnp.full((1, 2, 128), 2.0**20), jnp.linspace(1.0, 2.0, 256).reshape(1, 2, 128)], axis=-1)
    w = jnp.eye(256)[None]
    tiles, rows = jax.jit(lambda x, w: (expert_matmul(x, w, block=128)[..., 128:], expert_matmul(x, w, block=0)[..., 128:]))(x, w)
    assert _rel(tiles, x[..., 128:]) < 0.07
    assert float(jnp.abs(rows).max()) == 0.0


def test_tiles_take_the_common_divisor():
    assert [tile(7168, 128), tile(2048, 128), tile(64, 128), tile(96, 128), tile(96, 0)] == [128, 128, 64, 32, 96]


def test_fp8_payload_requantizes_to_itself_and_passes_gradients_straight():
    x = jax.random.normal(jax.random.key(1), (6, 256)) * jnp.exp(3 * jax.random.normal(jax.random.key(2), (6, 1)))
    g = jax.random.normal(jax.random.key(3), x.shape)

    @jax.jit
    def sent_again_and_back(x, g):
        sent, vjp = jax.vjp(lambda v: dispatched(v, lambda u: u[::-1], dtype="fp8"), x)
        return sent, dequantize_blocks(*quantize_blocks(sent, (1, 128), FORWARD)), vjp(g)[0]

    sent, again, back = sent_again_and_back(x, g)
    assert bool(jnp.all(again == sent)) and 0 < _rel(sent, x[::-1]) < 0.07
    assert bool(jnp.all(back == g[::-1]))


FP8 = ["train.matmul_dtype=fp8", "train.fp8_expert_block=16", "parallel.expert_dispatch_dtype=fp8"]


@pytest.mark.parametrize("routing", ["capacity", "dropless"])
def test_fp8_experts_and_dispatch_equal_one_device(tiny_moe, reference, routing):  # noqa: F811
    config = apply_overrides(tiny_moe, [f"model.routing={routing}", *FP8])
    run = run_layout(apply_overrides(config, ["mesh.data=2", "mesh.expert=4"]))
    check(compare(run, reference(config)), rtol=1e-4, param_rtol=3e-4, where=routing)
    # and FP8 did change the arithmetic
    assert compare(run, reference(apply_overrides(tiny_moe, [f"model.routing={routing}"]))).grad_error > 1e-3


def test_compiled_step_multiplies_experts_in_fp8_and_dispatches_bytes(tiny_moe):  # noqa: F811
    """Capacity routing over expert 4 x data 2. The (scanned) layer's matmuls read FP8: the
    four attention projections and the three expert matmuls, forward e4m3 x e4m3 and both
    backward products with the e5m2 gradient (the experts' in the compute dtype would leave
    4 of each). Per layer, the forward dispatch moves the formula's elements as uint8 and
    1/16 of them as float32 scales; the combine and the two backward exchanges move the
    formula's elements each in float32."""
    config = apply_overrides(tiny_moe, [*FP8, "mesh.data=2", "mesh.expert=4", "train.seq_len=32"])
    trainer = build(config)
    lowered = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch())
    types = dot_types(lowered.as_text(dialect="hlo"))
    assert {k: v for k, v in types.items() if "f8" in k} == {
        "f8e4m3fn x f8e4m3fn": 7, "f8e4m3fn x f8e5m2": 7, "f8e5m2 x f8e4m3fn": 7}, types
    colls = [c for c in collectives(lowered.compile().as_text(), trainer.mesh) if c.kind == "all-to-all"
             and c.axes == ("expert",)]
    elements = lambda dtype, size: sum(c.buffer_bytes * c.trip_count / size for c in colls if c.dtype == dtype)  # noqa: E731
    m = config.model
    formula = m.num_layers * formulas.expert_traffic_elements(config.train.global_batch // 8 * config.train.seq_len,
                                                              m.top_k, m.embed, m.capacity_factor)
    assert elements("u8", 1) / formula == pytest.approx(1.0, abs=0.05)
    assert elements("f32", 4) / formula == pytest.approx(3 + 1 / 16, abs=0.05)
