"""The GPU battery's summary (benchmarks/gpu_battery.py): ratios, targets and the table from
a made-up set of section results; nothing runs (the battery itself needs minutes)."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("jaxpar_benchmarks_gpu_battery", ROOT / "benchmarks" / "gpu_battery.py")
battery = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = battery  # dataclasses look their module up there
_spec.loader.exec_module(battery)


def side(tokens_per_s, mfu):
    return {"tokens_per_s": tokens_per_s, "mfu": mfu, "step_s": 16384 / tokens_per_s, "device": "NVIDIA H100 80GB HBM3"}


def attention_row(dtype, out, grad, ref_s, cudnn_s):
    errors = {f"{who}_{g}_error": grad if g != "out" else out for who in ("cudnn", "reference")
              for g in ("out", "dq", "dk", "dv")}
    return {"seq": 2048, "dtype": dtype, **errors, "reference_fwd_bwd_seconds": ref_s, "cudnn_fwd_bwd_seconds": cudnn_s}


def results():
    """What the sections' JSON files hold, trimmed to the fields the summary reads."""
    ok = lambda doc: {"status": "ok", "wall_s": 10.0, "result": doc}  # noqa: E731
    return {
        "mfu_bf16": ok({"jaxpar": side(96000, 0.56), "pytorch": side(75000, 0.44)}),
        "mfu_fp8": ok({"jaxpar": side(115200, 0.67), "pytorch": {"skipped": "--no-peer"}}),
        "mfu_3b": ok({"jaxpar": side(24000, 0.52), "pytorch": side(20000, 0.43)}),
        "plan": ok({"prediction": {"step_s": 0.12, "mfu": 0.78}, "cost_model": {"prediction": {"step_s": 0.17}}}),
        "cudnn": ok({"cudnn": [attention_row("bfloat16", 4e-3, 8e-3, 0.02, 0.004),
                               attention_row("float16", 1e-3, 2e-3, 0.01, 0.002), {"packed": True, "skipped": "no"}]}),
        "overlap": ok({"how": "mock", "variants": {
            "preset=none,collective_matmul=none": {"overlapped_share": 0.6},
            "preset=overlap,collective_matmul=none": {"overlapped_share": 0.8}}}),
        "gpu_checks": {"status": "timeout", "wall_s": 300.0, "error": "stopped after 300 s", "result": {
            "offload": [{"setting": "resident", "losses": [3.0, 2.5]},
                        {"setting": "offload_optimizer", "losses": [3.0, 2.5001]},
                        {"setting": "offload_params", "losses": [3.0, 2.49995]}]}},
        "muon": ok({"muon": [{"setting": "adamw", "step_seconds": 0.20, "error": 0.05},
                             {"setting": "muon", "step_seconds": 0.25, "error": -0.1},
                             {"setting": "muon_bf16", "step_seconds": 0.22, "error": None}]}),
    }


def test_targets_ratios_and_table_on_a_gpu():
    done = results()
    s = battery.summarize(done, gpu=True)
    assert abs(s["jaxpar_over_pytorch"] - 1.28) < 1e-9 and abs(s["fp8_over_bf16"] - 1.2) < 1e-9
    assert {k: t["verdict"] for k, t in s["targets"].items()} == {
        "mfu": "ok", "jaxpar_over_pytorch": "ok", "fp8_over_bf16": "MISSED"}
    assert abs(s["llama_3b"]["jaxpar_over_pytorch"] - 1.2) < 1e-9  # the bigger row, beside its own peer
    assert abs(s["plan"]["predicted_over_measured"] - 0.12 / (16384 / 96000)) < 1e-9
    assert abs(s["plan"]["cost_model_over_measured"] - 0.17 / (16384 / 96000)) < 1e-9  # the compiled program's
    assert s["overlap"]["preset_none"] == 0.6 and s["overlap"]["preset_overlap"] == 0.8
    assert s["cudnn"]["cases"] == 2 and s["cudnn"]["grad_error"] == 8e-3 and s["cudnn"]["fwd_bwd_speedup"] == [5.0, 5.0]
    assert s["gpu_checks"]["offload_losses_agree"] and abs(s["gpu_checks"]["offload_loss_difference"] - 4e-5) < 1e-9
    assert s["gpu_checks"]["pallas_out_error"] is None and s["gpu_checks"]["grouped_error"] is None
    off = [{"setting": "resident", "losses": [3.0, 2.5]}, {"setting": "offload_optimizer", "losses": [3.0, 2.4]}]
    assert battery.offload_agrees(off) is False  # a wrong update is far outside bf16's rounding
    params_off = [{"setting": "resident", "losses": [3.0, 2.5]}, {"setting": "offload_params", "losses": [3.0, 2.4]}]
    assert battery.offload_agrees(params_off) is False  # the parameters' offload is judged too
    assert s["muon"]["muon"]["over_adamw"] == 1.25 and s["muon"]["muon_bf16"]["predicted_error"] is None
    table = battery.render(done, s, {"platform": "gpu", "gpu": True, "device": "H100", "jax": "0.11.2"})
    assert "fp8_over_bf16" in table and "MISSED" in table and "stopped after 300 s" in table
    assert "muon 0.250 s (1.25x AdamW, predicted -10.0%)" in table
    assert "cost model 0.170 s a step (1.00 of measured), roofline 0.120 s (0.70)" in table, table
    assert "skipped" not in table.split("target")[0].split("speed")[1]  # all three speeds measured


def test_without_a_gpu_nothing_is_judged():
    done = results()
    done["mfu_bf16"]["result"]["pytorch"] = {"skipped": "not installed: torch"}
    for name in ("cudnn", "gpu_checks"):
        done[name] = {"status": "skipped", "error": "no GPU"}
    s = battery.summarize(done, gpu=False)
    assert s["jaxpar_over_pytorch"] is None and s["pytorch"] == {"skipped": "not installed: torch"}
    assert {t["verdict"] for t in s["targets"].values()} == {"n/a (no GPU)"}
    assert s["plan"]["measured_s"] is None and s["plan"]["predicted_s"] == 0.12
    table = battery.render(done, s, {"platform": "cpu", "gpu": False})
    assert "CPU part only" in table and "not installed: torch" in table and "no GPU" in table


def test_a_failed_section_leaves_the_rest():
    done = results()
    done["mfu_bf16"] = {"status": "error", "wall_s": 5.0, "error": "exit status 1: boom", "result": None}
    s = battery.summarize(done, gpu=True)
    assert s["targets"]["mfu"]["verdict"] == "n/a (not measured)" and s["fp8_over_bf16"] is None
    assert s["cudnn"]["cases"] == 2 and "boom" in battery.render(done, s, {"platform": "gpu", "gpu": True})


def test_a_profile_is_classed_by_instruction_and_kernel_name():
    spec = importlib.util.spec_from_file_location("jaxpar_benchmarks_profile_step", ROOT / "benchmarks" / "profile_step.py")
    prof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof)
    hlo = """ENTRY %main {
  %gemm_fusion_dot.23 = bf16[8,2048]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.23.comp
  ROOT %loop_add_fusion = f32[8]{0} fusion(%c), kind=kLoop, calls=%fused_add
}"""
    names = prof.instructions(hlo)
    assert set(names) == {"gemm_fusion_dot.23", "loop_add_fusion"}
    # nanoseconds over 2 traced steps: XLA's kernels carry their instruction's name ('.' -> '_'),
    # cuBLAS's and cuDNN's are classed by their own
    total = {"gemm_fusion_dot_23": 6e6, "loop_add_fusion": 2e6, "nvjet_sm90_tst_128x160": 8e6,
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop": 2e6, "memcpy128": 2e6}
    doc = prof.summarize(total, names, steps=2, top=3)
    assert abs(doc["device_busy_s_per_step"] - 0.010) < 1e-12 and doc["events_timed"] == 5
    assert {k: round(v["s"], 6) for k, v in doc["by_kind"].items()} == {
        "matmul": 0.007, "fusion (kLoop)": 0.001, "attention (cuDNN)": 0.001, "copy": 0.001}
    assert [t["name"] for t in doc["top"]] == ["nvjet_sm90_tst_128x160", "gemm_fusion_dot_23", "loop_add_fusion"]
    assert doc["top"][1]["hlo"].startswith("%gemm_fusion_dot.23") and doc["top"][0]["hlo"] == ""


def test_quick_runs_the_three_most_valuable_sections_with_fewer_steps():
    quick, every = battery.sections(gpu=True, quick=True), battery.sections(gpu=True)
    assert [x.name for x in quick] == list(battery.QUICK) == [x.name for x in every][:3]
    for x in quick[:2]:  # mfu_bf16, mfu_fp8
        at = x.argv.index("--steps")
        assert x.argv[at:at + 4] == ["--steps", "10", "--warmup", "3"], x.argv
    assert not any("--steps" in x.argv for x in every)


def test_each_registered_prediction_meets_the_step_the_battery_measured():
    registered = {"fp8_none_b8": {"predicted_s": 0.25, "commit": "abc", "mfu_flags": [
                      "--remat", "none", "--batch", "8", "--seq-len", "2048", "--matmul-dtype", "fp8"]},
                  "bf16_full_b8": {"predicted_s": 0.2, "commit": "abc", "mfu_flags": [
                      "--remat", "full", "--batch", "8", "--seq-len", "2048", "--matmul-dtype", "compute"]},
                  "bf16_none_seq4096_b4": {"predicted_s": 0.3, "mfu_flags": [
                      "--remat", "none", "--batch", "4", "--seq-len", "4096", "--matmul-dtype", "compute"]},
                  # mfu_bf16's flags but unrolled: a run of its own, not mfu_bf16's
                  "bf16_none_b8_unrolled": {"predicted_s": 0.2, "mfu_flags": [
                      "--remat", "none", "--batch", "8", "--seq-len", "2048", "--matmul-dtype", "compute",
                      "--unroll-layers"]}}
    done = {**results(), "predicted": {"status": "ok", "result": {"bf16_full_b8": {"step_s": 0.25}}}}
    # a row predicted for both devices is judged against the one the battery drew (H100 here)
    both = {"fp8_none_b8": {**registered["fp8_none_b8"], "by_device_s": {"H100": 0.26, "H200": 0.2}}}
    judged = battery.registered_errors(done, both)["fp8_none_b8"]
    assert judged["predicted_s"] == 0.26 and judged["device"] == "H100"
    errors = battery.registered_errors(done, registered)
    assert abs(errors["fp8_none_b8"]["error"] - (0.25 / (16384 / 115200) - 1)) < 1e-12  # timed by mfu_fp8
    assert abs(errors["bf16_full_b8"]["error"] - (0.2 / 0.25 - 1)) < 1e-12
    assert errors["bf16_none_seq4096_b4"]["error"] is None and errors["fp8_none_b8"]["registered_at"] == "abc"
    assert errors["bf16_none_b8_unrolled"]["measured_s"] is None
