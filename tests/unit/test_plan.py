"""`jaxpar plan` (jaxpar.plan): the layouts it considers can all run, the formula estimates
order them sensibly, the roofline is the stated arithmetic, and the best plan it prints
trains as printed.

Here the estimates and the arithmetic; the compiles in child processes: tests/scenarios/test_plan.py."""

import dataclasses
import math
from types import SimpleNamespace

import pytest

from jaxpar.config import apply_overrides
from jaxpar.inspect.report import Memory, StepReport
from jaxpar.plan import MODELS, Hardware
from jaxpar.plan.step_time import roofline
from jaxpar.plan.layouts import Layout, _matmul_outputs, _stage_params, candidates, estimate
from jaxpar.config import PipelineConfig
from jaxpar.pipeline.lockstep import lockstep_cost
from jaxpar.pipeline.split import head_layers


def test_every_candidate_fills_the_devices_and_keeps_model_parallelism_in_a_host():
    model = MODELS["llama3-70b"]
    found = candidates(model, 512, 8, 512, 4096)
    assert len(found) > 100
    for lay in found:
        assert math.prod(lay.axes.values()) == 512
        assert lay.tensor * lay.context <= 8 and model.num_heads % lay.tensor == 0
        assert 512 % (lay.data * lay.fsdp * lay.microbatches) == 0
        assert lay.stage == 1 or (len(lay.layers) == lay.stage and sum(lay.layers) == model.num_layers)
        assert math.prod(lay.host_split(8).values()) == 64  # the axes span exactly the 64 hosts
        assert lay.stage == 1 or lay.zero_stage <= 1  # what the pipeline accepts
    moe = candidates(MODELS["mixtral-8x7b"], 64, 8, 64, 4096)
    assert {lay.expert for lay in moe} == {1, 2, 4, 8} and {lay.stage for lay in moe if lay.expert > 1} >= {2, 4}


def test_deepseek_v3_gets_its_own_kind_of_layout_on_2048_gpus():
    """Stages with experts split inside them, experts across hosts in whole hosts, and an
    estimate that charges the all-to-alls to the slower links when they cross hosts."""
    from jaxpar.families import presets

    model, hw = presets()["deepseek-v3"], Hardware()
    found = candidates(model, 2048, 8, 2048, 4096)
    assert any(lay.stage > 1 and lay.expert == 64 for lay in found)  # pipeline x 8 hosts of experts
    assert all(lay.expert <= 8 or lay.expert % 8 == 0 for lay in found)
    by8 = Layout(stage=2, data=128, fsdp=1, tensor=1, context=1, expert=8, zero_stage=1, remat="full", microbatches=2)
    by64 = Layout(stage=2, data=16, fsdp=1, tensor=1, context=1, expert=64, zero_stage=1, remat="full", microbatches=2)
    assert estimate(by64, model, 2048, 4096, hw)["memory"] < estimate(by8, model, 2048, 4096, hw)["memory"] / 2
    # the same layout on hosts of 64 GPUs: its all-to-alls stay on NVLink, and the step is shorter
    nvl64 = dataclasses.replace(hw, devices_per_host=64)
    assert estimate(by64, model, 2048, 4096, nvl64)["step_s"] < estimate(by64, model, 2048, 4096, hw)["step_s"]


def test_stages_need_not_divide_the_layers():
    """DeepSeek-V3's 61 layers (58 in the stack) and Llama 3 405B's 126 over 16 stages: the
    balanced split, listed in the overrides so that the printed plan trains as planned."""
    deepseek, llama = MODELS["deepseek-v3"], MODELS["llama3-405b"]
    found = [lay for lay in candidates(deepseek, 2048, 8, 2048, 4096) if lay.stage == 16]
    assert any(lay.expert == 64 for lay in found)  # PP 16 x EP 64 (issue 55, deliverable 5)
    for lay in found:
        assert lay.layers == (3,) + (4,) * 14 + (2,) and "parallel.pipeline.layers=3,4*14,2" in lay.overrides(8, 256)
    assert "layers=3,4*14,2" in found[0].describe()
    found = [lay for lay in candidates(llama, 2048, 8, 2048, 4096) if lay.stage == 16]
    assert found and "parallel.pipeline.layers=7,8*14,7" in found[0].overrides(8, 256)
    # an even split needs no list: 63 + 63, or DeepSeek's 3 leading layers and 29 + 29
    llama_even = next(lay for lay in candidates(llama, 512, 8, 512, 4096) if lay.stage == 2)
    deepseek_even = dataclasses.replace(found[0], stage=2, layers=(32, 29), leading=3)
    for lay in (llama_even, deepseek_even):
        assert not any("pipeline.layers" in o for o in lay.overrides(8, 64)) and "layers=" not in lay.describe()
    assert "parallel.pipeline.layers=31,30" in dataclasses.replace(deepseek_even, layers=(31, 30)).overrides(8, 64)


def test_every_stage_holds_what_is_outside_the_stack():
    """A stage's parameters: its stack rows, and the embedding, head, final norm and
    DeepSeek's 3 dense layers whole (every stage holds them); the experts of its rows."""
    model = MODELS["deepseek-v3"]
    outside = model.param_count() - model.num_layers * model.moe_layer_param_count()
    assert outside == pytest.approx(model.dense_param_count() + 2 * model.vocab_size * model.embed + model.embed)
    params, routed = _stage_params(model, 4)
    assert params == pytest.approx(outside + 4 * model.moe_layer_param_count())
    assert routed == 4 * 3 * model.embed * model.mlp * model.num_experts
    llama = MODELS["llama3-405b"]
    layer, embedding = llama.attention_param_count() + 3 * llama.embed * llama.mlp + 2 * llama.embed, 2 * 128256 * 16384
    assert _stage_params(llama, 8) == (pytest.approx(8 * layer + embedding + llama.embed), 0)


def test_estimates_order_memory_as_zero_and_remat_promise():
    model, hw = MODELS["llama3-8b"], Hardware()
    base = Layout(stage=1, data=8, fsdp=1, tensor=8, context=1, expert=1, zero_stage=1, remat="none", microbatches=1)
    mem = lambda **kw: estimate(base.__class__(**{**base.__dict__, **kw}), model, 64, 4096, hw)["memory"]  # noqa: E731
    assert mem(zero_stage=3) < mem() < mem(zero_stage=0)
    assert mem(remat="full") < mem(remat="dots") < mem()
    assert mem(microbatches=4) < mem()


def test_zero3_over_data_is_charged_as_one_collective_over_data_and_fsdp():
    """ZeRO-3 over data shards as fsdp does: inside a host data 8 costs what fsdp 8 costs;
    across two hosts every byte of the gathers and reductions goes at the network's speed."""
    model, hw = MODELS["llama3-8b"], Hardware()
    fsdp = Layout(stage=1, data=1, fsdp=8, tensor=1, context=1, expert=1, zero_stage=0, remat="full", microbatches=1)
    data = dataclasses.replace(fsdp, data=8, fsdp=1, zero_stage=3)
    assert estimate(data, model, 8, 4096, hw)["step_s"] == pytest.approx(estimate(fsdp, model, 8, 4096, hw)["step_s"])
    wide = dataclasses.replace(data, data=2, fsdp=8)  # 16 devices on 2 hosts, data across them
    est = estimate(wide, model, 16, 4096, hw)
    sent = 3 * 2 * model.param_count() * 15 / 16
    busy = est["compute_s"]
    assert est["step_s"] == pytest.approx(busy + sent / 50e9 - min(0.9 * sent / 50e9, busy), rel=1e-3)


def test_remat_dots_is_priced_between_the_extremes():
    """dots keeps the matmuls' outputs: no matmul runs again (none's compute), but the norms' sequence-parallel gathers do (full's), and it holds more than
    full, less than none (formulas.matmul_outputs_bytes_per_layer)."""
    from jaxpar.inspect import formulas

    model, hw = MODELS["llama3-8b"], Hardware()
    base = Layout(stage=1, data=1, fsdp=8, tensor=1, context=1, expert=1, zero_stage=0, remat="none", microbatches=1)
    est = {r: estimate(dataclasses.replace(base, remat=r), model, 8, 4096, hw) for r in ("none", "dots", "full")}
    assert est["dots"]["compute_s"] == est["none"]["compute_s"] == pytest.approx(est["full"]["compute_s"] * 3 / 4)
    assert est["full"]["memory"] < est["dots"]["memory"] < est["none"]["memory"]
    tp = dataclasses.replace(base, fsdp=1, tensor=8, data=1)
    gathers = {r: estimate(dataclasses.replace(tp, remat=r), model, 8, 4096, hw)["step_s"] for r in ("none", "dots")}
    assert gathers["dots"] > gathers["none"]
    # the kept bytes, for Llama 3 8B's layer at 4096 tokens: the stream twice (h = 4096), q and
    # attention's output (4096 each), k and v (1024 each), gate and up (14336 each), 2 bytes
    kept = 2 * 4096 * (2 * 4096 + 2 * 4096 + 2 * 1024 + 2 * 14336)
    attention, mlp = 2 * 4096 + 2 * 1024, 2 * 14336
    assert formulas.matmul_outputs_bytes_per_layer(4096, 1, 4096, attention, mlp) == kept
    assert formulas.matmul_outputs_bytes_per_layer(4096, 1, 4096, attention, mlp, 4, True) == kept / 4
    assert _matmul_outputs(model, 4096, 1, base) == kept
    # DeepSeek-V3's experts: each token's 8 x 1.25 routed outputs (7168 wide) kept once, twice
    # over expert parallelism (the all-to-alls' buffers)
    deepseek, ep = MODELS["deepseek-v3"], dataclasses.replace(base, expert=8, fsdp=1)
    assert _matmul_outputs(deepseek, 4096, 1, ep) - _matmul_outputs(deepseek, 4096, 1, base) == 2 * 4096 * 10 * 7168
    assert {lay.remat for lay in candidates(model, 8, 8, 8, 4096)} == {"full", "dots", "none"}
    assert "model.remat=dots" in dataclasses.replace(base, remat="dots").overrides(8, 1)


def test_roofline_is_the_stated_arithmetic(tiny_llama):
    config = apply_overrides(tiny_llama, ["train.compute_dtype=bfloat16", "train.microbatches=4"])
    layout = SimpleNamespace(pipeline=PipelineConfig("1f1b", 1), microbatches=4)  # the specs roofline reads
    hw = Hardware(peak_tflops=100.0, matmul_efficiency=0.5, hbm_gb_per_s=1000.0, overlap_data=0.75, overlap_model=0.0)
    memory = Memory(*([0] * 12))
    report = StepReport(mesh={"stage": 2, "data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 2}, num_hosts=1,
                        memory=memory, flops=1e13, xla_flops=1e12, collectives=[], findings=[], compile_seconds=0.0,
                        platform="cpu")
    r = roofline(report, config, layout, hw, hbm_bytes=1e9)
    assert r["compute_s"] == pytest.approx(1e13 / 50e12) and r["memory_s"] == pytest.approx(1e-3)
    # the lockstep ticks of 1F1B over 2 stages of a layer each, 4 microbatches, the head on the last
    cost, ideal = lockstep_cost("1f1b", 2, 4, 1, (1, 1), 0.0, head_layers(config.model, config.train.seq_len))
    assert r["bubble"] == pytest.approx(1 - ideal / cost) and 0.4 < r["bubble"] < 0.5
    assert r["step_s"] == pytest.approx(0.2 * cost / ideal)
    # Muon's 2e12 of those FLOPs: once a step, after the ticks, float32 at half the rate
    muon = dataclasses.replace(report, orthogonalize_flops=2e12)
    m = roofline(muon, config, layout, hw, hbm_bytes=1e9)
    assert m["step_s"] == pytest.approx(0.16 * cost / ideal + 2e12 / 25e12)
    half = roofline(muon, apply_overrides(config, ["optim.ns_dtype=bfloat16"]), layout, hw, hbm_bytes=1e9)
    assert half["step_s"] == pytest.approx(0.16 * cost / ideal + 2e12 / 50e12)


def test_small_models_print_in_their_own_units():
    """A 0.85M-parameter plan reads 853.12K params, MiB and µs, not 0.0B, 0.0Gi and 0.00s."""
    from jaxpar.units import byte_size, duration, params

    assert params(853_120) == "853.12K" and params(8.03e9) == "8.03B" and params(12) == "12"
    assert byte_size(4.26 * 2**20) == "4.26 MiB" and byte_size(512) == "512 B"
    assert duration(7e-6) == "7 µs" and duration(0.0123) == "12.3 ms" and duration(2.5) == "2.50 s"


def test_a_model_class_from_a_recipe_file_reaches_the_compile_child(tmp_path, monkeypatch):
    """A recipe file is imported under a name made from its path, which the child cannot
    import by name: the child's unpickler imports the file the parent loaded."""
    import io
    import pickle
    import sys

    from jaxpar import recipes
    from jaxpar.plan.compile_one import _Unpickler

    path = tmp_path / "my_llama.py"
    path.write_text("import dataclasses\nfrom jaxpar.models.llama import LlamaConfig\n\n\n"
                    "@dataclasses.dataclass(frozen=True)\nclass MyLlama(LlamaConfig):\n    note: str = 'mine'\n")
    module = recipes.load_file(path)
    model = module.MyLlama(note="sent")
    data = pickle.dumps(model)
    monkeypatch.delitem(sys.modules, module.__name__)  # as in a fresh child
    assert _Unpickler(io.BytesIO(data), {module.__name__: str(path)}).load().note == "sent"
    assert module.__name__ in sys.modules


def test_experts_across_hosts_are_also_planned_with_fp8_dispatch_and_two_hops():
    """DeepSeek-V3 (capacity routing, 8 groups) with EP 64 over 8 hosts: the plain layout, the
    FP8 dispatch, group capacity (two hops) and both, each cheaper in all-to-all time, and
    each trained by its overrides; experts inside a host get neither."""
    from jaxpar.families import presets

    model, hw = presets()["deepseek-v3"], Hardware()
    found = candidates(model, 2048, 8, 2048, 4096)
    wide = [lay for lay in found if lay.expert == 64 and lay.stage == 16 and lay.remat == "full" and lay.microbatches == 16]
    assert {(lay.fp8_dispatch, lay.two_hops) for lay in wide} == {(False, False), (True, False), (False, True), (True, True)}
    assert not any(lay.fp8_dispatch or lay.two_hops for lay in found if lay.host_split(8)["expert"] == 1)
    base = [lay for lay in wide if not (lay.fp8_dispatch or lay.two_hops)][0]
    step = lambda **kw: estimate(dataclasses.replace(base, **kw), model, 2048, 4096, hw)["step_s"]  # noqa: E731
    assert step() > step(fp8_dispatch=True) and step() > step(two_hops=True) > step(two_hops=True, fp8_dispatch=True)
    sets = dataclasses.replace(base, fp8_dispatch=True, two_hops=True).overrides(8, 256)
    assert "parallel.expert_dispatch_dtype=fp8" in sets and "model.group_capacity=true" in sets


def test_microbatches_pay_for_adding_their_gradients_up():
    """Over m microbatches each one's gradients are added to the float32 sum: read and
    written, 4 bytes a parameter twice, a microbatch; one microbatch adds nothing. Counted in
    the HBM traffic (DeepSeek-V3 over data 256 x tensor 8 at m = 8: over a TB a step)."""
    from jaxpar.families import presets

    model, hw = presets()["deepseek-v3"], Hardware()
    base = Layout(stage=1, data=256, fsdp=1, tensor=8, context=1, expert=1, zero_stage=1, remat="full", microbatches=1)
    at = lambda m: estimate(dataclasses.replace(base, microbatches=m), model, 2048, 4096, hw)  # noqa: E731
    assert at(1)["accumulate_bytes"] == 0
    assert at(8)["accumulate_bytes"] == 4 * at(2)["accumulate_bytes"] > 1e12
    assert at(8)["hbm_bytes"] > at(8)["accumulate_bytes"]


def test_muon_is_priced_by_its_state_iterations_and_exchange():
    """One float32 momentum a matrix (AdamW's two on the embedding, head and norms); the
    Newton-Schulz FLOPs of Llama 3 8B's matrices shared by the devices; the layout trains
    with it (jaxpar.plan.layouts.muon_cost)."""
    from jaxpar.plan.layouts import muon_cost

    model, hw = MODELS["llama3-8b"], Hardware()
    adamw = Layout(stage=1, data=8, fsdp=1, tensor=8, context=1, expert=1, zero_stage=0, remat="full", microbatches=1)
    muon = dataclasses.replace(adamw, optimizer="muon")
    cost = muon_cost(model, adamw)
    share = (model.param_count() - 2 * model.vocab_size * model.embed) / model.param_count()  # untied, norms aside
    assert cost["state_bytes"] == pytest.approx(4 * share + 8 * (1 - share), rel=1e-3)
    # 32 layers over 64 devices. The gate and up stacks are cut alike and join (64 matrices,
    # one a device), as do wk and wv: each device runs 5 matrices, not one of each of the 7
    # parameters' stacks padded to 64
    mlp = 5 * (4 * model.embed ** 2 * model.mlp + 2 * model.embed ** 3)  # one w_up: m = embed, k = mlp
    attention = 5 * 6 * model.embed ** 3  # wq, wo: embed x embed; wk and wv are narrower
    assert 2 * mlp + 2 * attention < cost["flops"] < 2 * mlp + 3 * attention
    assert cost["rate"] == 0.5  # float32 iterations, as TF32
    a, m = (estimate(lay, model, 64, 4096, hw) for lay in (adamw, muon))
    assert m["memory"] < a["memory"] and m["step_s"] > a["step_s"]
    assert "optim.name=muon" in muon.overrides(8, 8) and "optim.name" not in " ".join(adamw.overrides(8, 8))


def test_state_on_the_host_trades_device_memory_for_copies_over_pcie():
    """With the parameters, master and optimizer state resting on the host, the device holds
    the gradients and one layer fetched at a time; the step pays each use's fetch and the
    gradients' round trip (hidden as the gathers are) and the update's copies (not hidden)
    at the host link's speed (jaxpar.plan.layouts.host_traffic)."""
    from jaxpar.inspect import formulas
    from jaxpar.plan.layouts import host_traffic
    from jaxpar.xla_options import layer_params

    model, hw = MODELS["llama3-70b"], Hardware()
    resting = Layout(stage=1, data=1, fsdp=8, tensor=1, context=1, expert=1, zero_stage=0, remat="full", microbatches=1)
    host = dataclasses.replace(resting, offload=True)
    assert host in candidates(model, 8, 8, 8, 4096) and resting in candidates(model, 8, 8, 8, 4096)
    a, h = (estimate(lay, model, 8, 4096, hw) for lay in (resting, host))
    state = formulas.model_state(model.param_count(), 0, 1, 8)
    assert a["memory"] - h["memory"] == pytest.approx(state.total - state.grads - 2 * layer_params(model), rel=1e-9)
    assert a["memory"] > 80 * 2**30 > h["memory"]  # 70B trains on 8 H100s only from the host
    traffic = host_traffic(state, formulas.model_state(0, 0, 1), host)
    assert traffic["streamed"] == pytest.approx(3 * state.params + 2 * state.grads)
    assert traffic["update"] == pytest.approx(2 * (state.master + state.optimizer) + state.params)
    link = hw.host_link_gb_per_s * 1e9
    assert h["host_s"] == pytest.approx(0.1 * traffic["streamed"] / link + traffic["update"] / link)
    assert h["step_s"] > a["step_s"] + traffic["update"] / link * 0.999
    sets = host.overrides(8, 1)
    assert "parallel.zero.offload_params=true" in sets and "parallel.zero.offload_optimizer=true" in sets
    assert not any(lay.offload for lay in candidates(model, 16, 8, 16, 4096) if lay.stage > 1)  # refused with stages


def test_groups_across_a_slow_link_are_planned_with_diloco_too():
    """Two clusters joined by 1 Gb/s per GPU: every candidate has a data replica per
    cluster; data parallelism sends its gradient over that link each step, DiLoCo its
    outer exchange every H steps, unhidden (jaxpar.step.diloco.outer_bytes), with 8 bytes
    a parameter of outer state more; DiLoCo needs no ZeRO over data."""
    from jaxpar.plan.layouts import diloco_variants
    from jaxpar.specs import DilocoConfig
    from jaxpar.step.diloco import outer_bytes

    model, hw = MODELS["llama3-8b"], Hardware(group_link_gb_per_s=1 / 8)
    dp = Layout(stage=1, data=2, fsdp=8, tensor=1, context=1, expert=1, zero_stage=1, remat="full", microbatches=1)
    laid = diloco_variants([dp, dataclasses.replace(dp, stage=2, data=1)], 100)
    assert len(laid) == 3 and laid[2] == dataclasses.replace(dp, diloco=100, zero_stage=0)  # stages: none
    groups = laid[2]
    a, d = estimate(dp, model, 16, 4096, hw), estimate(groups, model, 16, 4096, hw)
    local = model.param_count() / 8
    gradient = 2 * 4 * local / 2 / hw.group_link_gb_per_s / 1e9  # the all-reduce of float32 gradients, ring of 2
    assert a["step_s"] > 0.9 * gradient and d["step_s"] < a["step_s"] / 20
    outer = outer_bytes(DilocoConfig(inner_steps=100), local, 2) / (hw.group_link_gb_per_s * 1e9)
    assert d["step_s"] >= outer and outer == pytest.approx(gradient / 100, rel=0.01)
    zero0 = estimate(dataclasses.replace(dp, zero_stage=0), model, 16, 4096, hw)["memory"]
    assert d["memory"] == pytest.approx(zero0 + 8 * local, rel=1e-6)
    assert "parallel.diloco.inner_steps=100" in groups.overrides(8, 2) and "diloco H=100" in groups.describe()



def test_each_remat_policy_has_its_fastest_estimate_compiled_first(tiny_llama, monkeypatch):
    """The estimates rank layouts within a remat policy; across policies the compile decides:
    the first compiles are the fastest estimate of each policy, then the rest in order."""
    import jax

    import jaxpar.plan as planner

    compiled, fitting = [], True

    def fake(planned, *_):
        compiled.append(planned)
        step = planned.estimate["step_s"]
        planned.memory = 1.0 if fitting else 2.0 * 2**30
        planned.prediction = dict(step_s=step, compute_s=step, exposed_comm_s=0.0, bubble=0.0, tokens_per_s_per_device=1.0,
                                  mfu=0.5)

    monkeypatch.setattr(planner, "_compile", fake)
    planned, facts = planner.plan(tiny_llama.model, jax.devices(), hbm_gb=1.0, hosts=2, seq_len=16, global_batch=16,
                                  compile_top=6, progress=False)
    key = lambda p: (p.estimate["step_s"], p.estimate["memory"])  # noqa: E731
    fastest = {}
    for lay in candidates(tiny_llama.model, 8, 4, 16, 16):
        e = estimate(lay, tiny_llama.model, 16, 16, Hardware(devices_per_host=4))
        fastest[lay.remat] = min(fastest.get(lay.remat, (math.inf,)), (e["step_s"], e["memory"]))
    assert {p.layout.remat: key(p) for p in compiled[:3]} == fastest
    assert [key(p) for p in compiled[3:]] == sorted(key(p) for p in compiled[3:]) and len(compiled) == 6
    assert [p.prediction["step_s"] for p in planned] == sorted(p.prediction["step_s"] for p in planned)
    assert "6 compiled, the fastest estimate of each remat policy first:" in planner.render(planned, facts, 1.0)
    # nothing estimated to fit: the smallest compile first, and the table says so
    compiled.clear()
    fitting = False  # what fake compiles from now on
    planned, facts = planner.plan(tiny_llama.model, jax.devices(), hbm_gb=1e-6, hosts=2, seq_len=16, global_batch=16,
                                  compile_top=1, progress=False)
    assert facts["fallback"] and "3 compiled, the smallest estimates:" in planner.render(planned, facts, 1e-6)


def test_a_policy_whose_compile_ran_large_does_not_hide_the_others(tiny_llama, monkeypatch):
    """The first layout compiled more than its estimate (here: the whole budget): the scale
    it sets skips the layouts behind it, but not another policy's fastest."""
    import jax

    import jaxpar.plan as planner

    compiled = []

    def fake(planned, *_):
        compiled.append(planned)
        planned.memory = 0.9 * 2**30 * 0.99 if len(compiled) == 1 else planned.estimate["memory"]
        planned.prediction = {"step_s": planned.estimate["step_s"]}

    monkeypatch.setattr(planner, "_compile", fake)
    planner.plan(tiny_llama.model, jax.devices(), hbm_gb=1.0, hosts=2, seq_len=16, global_batch=16, compile_top=6,
                 progress=False)
    budget, scale = 2**30 * 0.9, compiled[0].memory / compiled[0].estimate["memory"]
    assert {p.layout.remat for p in compiled[:3]} == {"full", "dots", "none"}
    assert any(p.estimate["memory"] * scale > budget for p in compiled[1:3])  # kept though the scale says not
    assert all(p.estimate["memory"] * scale <= budget for p in compiled[3:])  # the rest: skipped where it says so
