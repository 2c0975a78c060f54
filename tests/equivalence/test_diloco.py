"""DiLoCo and streaming DiLoCo over mesh.data (parallel.diloco, jaxpar.step.diloco).

- With H = 1, an outer SGD step of lr 1 without momentum and inner SGD, it is data
  parallelism: data x fsdp equal to the same layout without DiLoCo (fp32: losses, first
  gradients, parameters after 3 steps, 1e-5).
- For H > 1 it equals its plain reference, the groups run one after another on one device
  with numpy's outer step (jaxpar.testing.diloco_reference), 1e-5 over 6 steps: DiLoCo with
  AdamW under data x fsdp x tensor; streaming DiLoCo (2 fragments, the exchange beside the
  step, mix 0.5) there too; Mixtral's experts inside each group; Muon inside each group
  (its matrices' work shared by a group's devices only).
- int8: the rounding the outer exchange applies equals its plain reference; training with
  it stays within 1e-3 of float32 and its exchange moves int8.
- A fragment plan covers every weight once; a resumed run repeats the losses bitwise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import Config, TrainConfig, apply_overrides
from jaxpar.models.llama import LlamaConfig
from jaxpar.testing import check, compare, diloco_reference, run_layout

SGD = ["optim.name=sgd", "optim.b1=0", "optim.lr=0.5", "optim.warmup_steps=0", "optim.clip_norm=0"]
PLAIN_OUTER = ["parallel.diloco.outer_lr=1", "parallel.diloco.outer_momentum=0", "parallel.diloco.nesterov=false"]


def _deep() -> Config:
    """4 layers, so two fragments each stride two."""
    return apply_overrides(Config(
        model=LlamaConfig(vocab_size=128, embed=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, mlp=64),
        train=TrainConfig(steps=6, global_batch=16, seq_len=16, compute_dtype="float32")), ["optim.lr=0.01"])


def test_one_inner_step_of_sgd_with_a_plain_outer_step_is_data_parallelism(tiny_llama):
    layout = apply_overrides(tiny_llama, SGD + ["mesh.data=4", "mesh.fsdp=2", "mesh.tensor=1"])
    diloco = run_layout(apply_overrides(layout, ["parallel.diloco.inner_steps=1", *PLAIN_OUTER]))
    check(compare(diloco, run_layout(layout)), 1e-5, where="H=1 against data parallelism")


CASES = {  # (recipe or None for the 4-layer Llama, overrides)
    "diloco_data2_fsdp2_tensor2": (None, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                          "parallel.diloco.inner_steps=2"]),
    "streaming_delay1_mix": (None, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.diloco.inner_steps=4",
                                    "parallel.diloco.fragments=2", "parallel.diloco.delay=1",
                                    "parallel.diloco.mix=0.5"]),
    "moe_data2_expert4": ("moe", ["mesh.data=2", "mesh.expert=4", "parallel.diloco.inner_steps=2"]),
    "muon_data2_fsdp4": (None, ["mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1", "optim.name=muon", "optim.lr=0.02",
                                "parallel.diloco.inner_steps=3", "parallel.diloco.nesterov=false"]),
}


@pytest.mark.parametrize("name", CASES)
def test_diloco_equals_its_groups_run_one_after_another(name):
    from jaxpar.recipes import resolve_config

    recipe, overrides = CASES[name]
    if recipe is None:
        config = apply_overrides(_deep(), overrides)
    else:
        config = resolve_config(recipe, ["train.compute_dtype=float32", "parallel.tensor.sequence_parallel=false",
                                         *overrides], 8)
    check(compare(run_layout(config, steps=6), diloco_reference(config, steps=6)), 1e-5, where=name)


def test_int8_rounding_is_the_kernels_reference():
    from jaxpar.kernels.quantized import reduce_scatter_rounding, reduce_scatter_rounding_reference
    from jaxpar.mesh import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(data=4, fsdp=2, tensor=1), jax.devices()[:8])
    x = jax.random.normal(jax.random.key(0), (4, 16, 24)) * jnp.arange(1, 25)  # per-replica values, blocks of scales
    x = jax.device_put(x, NamedSharding(mesh, P("data", "fsdp", None)))
    got = reduce_scatter_rounding(x, mesh, "data", P("fsdp", None), P("fsdp", "data"), 32)
    want = reduce_scatter_rounding_reference(x, mesh, P("fsdp", "data"), 32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert 0 < float(jnp.max(jnp.abs(got - x))) < 0.01 * float(jnp.max(jnp.abs(x)))


def test_int8_outer_exchange_moves_int8_and_stays_near_float32():
    from jaxpar.train import build

    config = apply_overrides(_deep(), ["mesh.data=4", "mesh.fsdp=2", "mesh.tensor=1", "parallel.diloco.inner_steps=2"])
    int8 = apply_overrides(config, ["parallel.diloco.compression=int8"])
    exact, rounded = run_layout(config, steps=6), run_layout(int8, steps=6)
    assert 0 < compare(rounded, exact).param_error < 1e-3
    trainer = build(int8)
    text = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).as_text()
    assert "xi8>" in text and "all_to_all" in text  # the outer reduce-scatter's int8 all-to-all
    residual = trainer.abstract_state().outer.residual["layers"]["mlp"]["w_up"]
    assert residual.shape[0] == 4 and residual.sharding.spec[0] == "data"  # each group's own


def test_fragments_cover_every_weight_once():
    from jaxpar.step.diloco import NONE, WHOLE, fragment_elements, fragment_plan
    from jaxpar.train import build

    trainer = build(apply_overrides(_deep(), ["mesh.data=8", "mesh.tensor=1"]))
    shapes = jax.eval_shape(lambda: trainer.master_params(trainer.init()))
    plans = fragment_plan(trainer.param_names, shapes, 3)
    layers = [p["layers"]["mlp"]["w_up"] for p in plans]
    assert [sel.index for sel in layers if sel != NONE] == [(0, 3), (1,), (2,)]  # strided
    whole = [sum(s == WHOLE for s in jax.tree.leaves(p, is_leaf=lambda x: isinstance(x, str))) for p in plans]
    assert sum(whole) == 3  # embedding, head, final norm: each whole in one fragment
    sizes = [fragment_elements(p, shapes) for p in plans]
    assert sum(sizes) == sum(x.size for x in jax.tree.leaves(shapes))


def test_a_resumed_run_repeats_the_losses_bitwise(tmp_path):
    from jaxpar.loop.run import run
    from jaxpar.train import build

    config = apply_overrides(_deep(), ["mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1", "parallel.diloco.inner_steps=3",
                                       "parallel.diloco.fragments=3", "parallel.diloco.delay=0",
                                       "parallel.diloco.compression=int8", "train.steps=5"])
    whole = run(build(config), progress=False)
    saving = apply_overrides(config, [f"checkpoint.dir={tmp_path}", "checkpoint.every=1"])
    trainer = build(saving)
    first = run(trainer, steps=2, progress=False)  # "killed" after step 2: momentum, anchor, residuals saved
    rest = run(trainer, progress=False)
    assert [r["loss"] for r in first + rest] == [r["loss"] for r in whole]
    assert [r["outer_sync"] for r in whole] == [1.0] * 5  # a fragment each step


def test_explain_shows_the_outer_state_and_exchange_beside_their_formulas():
    """Streaming DiLoCo over 4 groups, int8: the outer state (anchor, momentum, residual) and
    the exchange per step (its fragments' branches over H) at their formulas; no gradient
    reduction over data."""
    from jaxpar.inspect import inspect_step
    from jaxpar.inspect.explain import explain
    from jaxpar.train import build

    config = apply_overrides(_deep(), ["mesh.data=4", "mesh.fsdp=2", "mesh.tensor=1", "parallel.diloco.inner_steps=4",
                                       "parallel.diloco.fragments=2", "parallel.diloco.delay=1",
                                       "parallel.diloco.compression=int8"])
    trainer = build(config)
    doc = explain(trainer, inspect_step(trainer))
    memory = {r["name"]: r for r in doc["memory"]}
    assert abs(memory["DiLoCo outer state"]["ratio"] - 1) < 0.01 and abs(memory["model state"]["ratio"] - 1) < 0.01
    assert abs(doc["outer_traffic"]["ratio"] - 1) < 0.01 and doc["outer_schedule"]["collectives"] > 0
    assert "over data: none" in doc["gradient_traffic_formula"] and abs(doc["gradient_traffic"]["ratio"] - 1) < 0.05


def test_topk_outer_exchange_at_fraction_one_is_lossless_and_explain_prices_its_pairs():
    from jaxpar.inspect import inspect_step
    from jaxpar.inspect.explain import explain
    from jaxpar.train import build

    config = apply_overrides(_deep(), ["mesh.data=4", "mesh.fsdp=2", "mesh.tensor=1", "parallel.diloco.inner_steps=2"])
    every = apply_overrides(config, ["parallel.diloco.compression=topk", "parallel.diloco.topk_fraction=1"])
    check(compare(run_layout(every, steps=4), run_layout(config, steps=4)), 1e-5, where="top-k of every entry")
    tenth = build(apply_overrides(config, ["parallel.diloco.compression=topk", "parallel.diloco.topk_fraction=0.1"]))
    doc = explain(tenth, inspect_step(tenth))
    assert abs(doc["outer_traffic"]["ratio"] - 1) < 0.05, doc["outer_traffic"]
