"""`jaxpar plan` (jaxpar.plan): the layouts it considers can all run, the formula estimates
order them sensibly, the roofline is the stated arithmetic, and the best plan it prints
trains as printed."""

import math

import pytest

from jaxpar.config import apply_overrides
from jaxpar.inspect.report import Memory, StepReport
from jaxpar.plan import MODELS, Hardware, plan, render, roofline
from jaxpar.plan.layouts import Layout, candidates, estimate


def test_every_candidate_fills_the_devices_and_keeps_model_parallelism_in_a_host():
    model = MODELS["llama3-70b"]
    found = candidates(model, 512, 8, 512, 4096)
    assert len(found) > 100
    for lay in found:
        assert math.prod(lay.axes.values()) == 512
        assert lay.tensor * lay.context * lay.expert <= 8 and model.num_heads % lay.tensor == 0
        assert model.num_layers % lay.stage == 0 and 512 % (lay.data * lay.fsdp * lay.microbatches) == 0
        assert math.prod(lay.host_split(8).values()) == 64  # the axes span exactly the 64 hosts
        assert lay.stage == 1 or lay.zero_stage <= 1  # what the pipeline accepts
    moe = candidates(MODELS["mixtral-8x7b"], 64, 8, 64, 4096)
    assert {lay.expert for lay in moe} == {1, 2, 4, 8} and all(lay.stage == 1 for lay in moe)


def test_estimates_order_memory_as_zero_and_remat_promise():
    model, hw = MODELS["llama3-8b"], Hardware()
    base = Layout(stage=1, data=8, fsdp=1, tensor=8, context=1, expert=1, zero_stage=1, remat="none", microbatches=1)
    mem = lambda **kw: estimate(base.__class__(**{**base.__dict__, **kw}), model, 64, 4096, hw)["memory"]  # noqa: E731
    assert mem(zero_stage=3) < mem() < mem(zero_stage=0)
    assert mem(remat="full") < mem()
    assert mem(microbatches=4) < mem()


def test_roofline_is_the_stated_arithmetic(tiny_llama):
    config = apply_overrides(tiny_llama, ["train.compute_dtype=bfloat16", "train.microbatches=4"])
    hw = Hardware(peak_tflops=100.0, matmul_efficiency=0.5, hbm_gb_per_s=1000.0, overlap_data=0.75, overlap_model=0.0)
    memory = Memory(*([0] * 12))
    report = StepReport(mesh={"stage": 2, "data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 2}, num_hosts=1,
                        memory=memory, flops=1e13, xla_flops=1e12, collectives=[], findings=[], compile_seconds=0.0,
                        platform="cpu")
    r = roofline(report, config, hw, hbm_bytes=1e9)
    assert r["compute_s"] == pytest.approx(1e13 / 50e12) and r["memory_s"] == pytest.approx(1e-3)
    assert r["bubble"] == pytest.approx(1 / 5)  # (p - 1) / (m + p - 1)
    assert r["step_s"] == pytest.approx(0.2 / 0.8)


def test_plan_compiles_the_best_layouts_and_its_overrides_train(tiny_llama):
    """A tiny Llama on 8 devices as 2 hosts of 4: the fastest estimates are compiled, the
    best fits and its --set list trains."""
    import jax

    from jaxpar.train import build
    from jaxpar.train.loop import run

    planned, facts = plan(tiny_llama.model, jax.devices(), hbm_gb=1.0, hosts=2, seq_len=16, global_batch=16,
                          compile_top=2, progress=False)
    assert facts["compiled"] == 2 and facts["candidates"] > 20
    best = planned[0]
    assert best.compiled and 0 < best.memory <= facts["budget_bytes"]
    assert 0 < best.prediction["mfu"] < 1
    text = render(planned, facts, 1.0)
    assert "best: predicted" in text and "--set " + " --set ".join(best.overrides) in text
    config = apply_overrides(tiny_llama, best.overrides + ["train.steps=1", "train.global_batch=16"])
    history = run(build(config), progress=False)
    assert len(history) == 1 and math.isfinite(history[0]["loss"])


def test_small_models_print_in_their_own_units():
    """A 0.85M-parameter plan reads 853.12K params, MiB and µs, not 0.0B, 0.0Gi and 0.00s."""
    from jaxpar.units import byte_size, duration, params

    assert params(853_120) == "853.12K" and params(8.03e9) == "8.03B" and params(12) == "12"
    assert byte_size(4.26 * 2**20) == "4.26 MiB" and byte_size(512) == "512 B"
    assert duration(7e-6) == "7 µs" and duration(0.0123) == "12.3 ms" and duration(2.5) == "2.50 s"
