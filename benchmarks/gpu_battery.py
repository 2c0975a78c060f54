"""Every GPU measurement in one call (under 8 minutes on one H100, compiles included), one
JSON, one table, most valuable first:

  1. mfu_bf16    benchmarks/mfu.py: the 0.9B Llama, jaxpar and the PyTorch peer, bf16
     mfu_fp8     the same jaxpar side with train.matmul_dtype=fp8 (--matmul-dtype fp8)
  2. plan        the planner's step time for that run (its exact layout), beside the
                 measured step of mfu_bf16: the cost model over the program compiled for an
                 H100 without one (`jaxpar plan --target`; needs the CUDA plugin, which a
                 GPU machine has), and the roofline over a CPU compile (`jaxpar plan`)
     mfu_3b      Llama 3.2 3B's shape (--shape 3b), batch 4, every layer checkpointed on
                 both sides (jaxpar remat full, Hugging Face's gradient checkpointing)
     predicted   the runs benchmarks/results/predictions.json registered before anyone
                 measured them (jaxpar.inspect.cost over a deviceless H100 compile), timed
                 with mfu.py (jaxpar only) unless mfu_bf16 or mfu_fp8 ran them already; the
                 summary gives each registered prediction's error
  3. profile     benchmarks/profile_step.py: mfu_bf16's step traced, its top costs by
                 instruction and by kind (GEMM, attention, fusions)
  4. cudnn       benchmarks/gpu_checks.py --only cudnn: cuDNN attention against the reference
     gpu_checks  benchmarks/gpu_checks.py --only pallas,grouped,offload
  5. overlap     benchmarks/overlap.py: overlapped share of collective bytes, compiler.preset
                 none against overlap, compiled deviceless for 8 H100s (benchmarks/targets/);
                 last, as it runs nothing on the GPU. (The mock 8-GPU topology on the one GPU,
                 jax_mock_gpu_topology=1x8x1, did not finish compiling in 240 s on an H200 with
                 jax 0.11.2, twice.)

  python benchmarks/gpu_battery.py [--out benchmarks/results/gpu_battery.json]   # --budget 460 s
  python benchmarks/gpu_battery.py --quick         # mfu_bf16 (with the peer), mfu_fp8, plan: 240 s
  python benchmarks/gpu_battery.py --cpu-only      # the CPU part (automatic without a GPU)
  python benchmarks/gpu_battery.py --only mfu_bf16,plan --budget 300

Each section runs in a child process of its own (the GPU belongs to one process at a time),
under a timeout, and records its error, output tail and wall time without stopping the
others; all sections share --budget seconds, and those the budget cannot reach are recorded
as not run. A device task's whole GPU time is 15 minutes, start-up included, so the default
budget leaves room for one call of about 8 minutes; --quick measures fewer steps (10 after 3
of warm-up) of the three sections that matter most, in about 4. Without a GPU the CPU part runs: mfu.py --tiny (bf16 and fp8), the plan
prediction and overlap.py on CPU devices (whose collectives are synchronous: 0% overlap by
construction); the GPU-only sections are recorded as skipped. The targets of issue 23
(jaxpar MFU >= 0.55, jaxpar / PyTorch >= 1.2, fp8 / bf16 >= 1.3) are judged on a GPU only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.mfu, for the plan section

from benchmarks.gpu_checks import write  # noqa: E402  (the atomic JSON writer)
from benchmarks.predict import Run  # noqa: E402  (a registered row's run, from its flags)
BATCH, SEQ = 8, 2048  # mfu.py's run, which the plan section predicts
MFU_3B = ["--shape", "3b", "--remat", "full", "--batch", "4", "--loss-chunks", "8"]  # after BATCH: these win
TARGETS = {"mfu": 0.55, "jaxpar_over_pytorch": 1.2, "fp8_over_bf16": 1.3}
MIN_SECTION_S = 20  # a section with less of the budget left is not started


@dataclasses.dataclass(frozen=True)
class Section:
    name: str
    argv: list[str]  # the script and its arguments; --out FILE is appended
    timeout_s: float
    gpu_only: bool = False
    env: tuple[tuple[str, str], ...] = ()


QUICK = ("mfu_bf16", "mfu_fp8", "plan")  # --quick: these, with fewer timed steps
QUICK_BUDGET_S = 240


def sections(gpu: bool, quick: bool = False) -> list[Section]:
    """The battery, most wanted first (a spent budget cuts the last)."""
    mfu = ["benchmarks/mfu.py", *(["--batch", str(BATCH), "--seq-len", str(SEQ)] if gpu else ["--tiny"]),
           *(["--steps", "10", "--warmup", "3"] if quick else [])]
    checks = "benchmarks/gpu_checks.py"
    every = [
        Section("mfu_bf16", mfu, 300),
        Section("mfu_fp8", mfu + ["--matmul-dtype", "fp8", "--no-peer"], 180),
        # the planner compiles for CPU devices whatever the machine has
        Section("plan", [__file__, "--section", "plan"], 150, env=(("JAX_PLATFORMS", "cpu"),)),
        Section("mfu_3b", mfu + MFU_3B if gpu else mfu, 300),
        Section("predicted", [__file__, "--section", "predicted"], 280, gpu_only=True),
        Section("profile", ["benchmarks/profile_step.py", *([] if gpu else ["--tiny"])], 150),
        Section("muon", [checks, "--only", "muon"], 240, gpu_only=True),
        Section("cudnn", [checks, "--only", "cudnn"], 180, gpu_only=True),
        Section("gpu_checks", [checks, "--only", "pallas,grouped,offload"], 300, gpu_only=True),
        Section("overlap", ["benchmarks/overlap.py", "--collective-matmul", "none",
                            *(["--target", "benchmarks/targets/h100.pbtxt"] if gpu else [])], 240),
    ]
    return [x for x in every if x.name in QUICK] if quick else every


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/gpu_battery.json")
    p.add_argument("--cpu-only", action="store_true", help="run the CPU part even if a GPU is here")
    p.add_argument("--only", metavar="SECTION[,SECTION]", help="run only these sections")
    p.add_argument("--budget", type=float, help="seconds for all sections together (default 460; 240 with --quick)")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, fewer timed steps (about 4 minutes)")
    p.add_argument("--section", choices=["plan", "predicted"], help=argparse.SUPPRESS)  # one section, in a child
    return p.parse_args(argv)


def probe(cpu_only: bool) -> dict:
    """The platform JAX starts on, asked of a child: JAX in this process would keep GPU
    memory the sections need."""
    if cpu_only:
        return {"platform": "cpu", "why": "--cpu-only"}
    code = ("import json, jax; d = jax.devices()[0]; "
            "print(json.dumps({'platform': d.platform, 'device': d.device_kind, 'jax': jax.__version__}))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        return {"platform": "cpu", "why": f"probing JAX's platform failed ({type(e).__name__}); CPU part only"}


def run_section(section: Section, workdir: pathlib.Path, timeout_s: float, cpu_only: bool) -> dict:
    """Runs one section's child to its end or its timeout; its JSON (even a partial one) and
    its output's tail are kept."""
    out, log = workdir / f"{section.name}.json", workdir / f"{section.name}.log"
    argv = [sys.executable, *section.argv, "--out", str(out)]
    env = {**os.environ, **dict(section.env)}
    if cpu_only:  # keep every framework off a GPU that is there
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        # a session of its own, so a timeout also stops the child's children (mfu.py's sides)
        child = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            rc = None
    row = {"command": " ".join(argv[1:]), "wall_s": round(time.perf_counter() - t0, 1), "log": str(log),
           "output_tail": log.read_text(errors="replace").splitlines()[-25:]}
    row["result"] = read_json(out)
    if rc is None:
        row.update(status="timeout", error=f"stopped after {timeout_s:.0f} s")
    elif rc or row["result"] is None:
        row.update(status="error", error=f"exit status {rc}: " + " | ".join(row["output_tail"][-3:]))
    else:
        failed = [k for k, v in row["result"].items() if isinstance(v, dict) and "error" in v]
        row["status"] = f"partial (failed: {', '.join(failed)})" if failed else "ok"
    return row


def read_json(path: pathlib.Path) -> dict | None:
    """A child's JSON, or None: not written, or cut short by a timeout (not every script
    writes atomically)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_all(chosen: list[Section], gpu: bool, budget_s: float, workdir: pathlib.Path) -> dict:
    """Each section in turn, inside the shared budget; a failure stops none of the others."""
    deadline = time.perf_counter() + budget_s
    done = {}
    for section in chosen:
        left = deadline - time.perf_counter()
        if section.gpu_only and not gpu:
            done[section.name] = {"status": "skipped", "error": "no GPU"}
        elif left < MIN_SECTION_S:
            done[section.name] = {"status": "not run", "error": f"the battery's budget of {budget_s:.0f} s was spent"}
        else:
            print(f"{section.name}: running (timeout {min(section.timeout_s, left):.0f} s) ...", flush=True)
            done[section.name] = run_section(section, workdir, min(section.timeout_s, left), not gpu)
            print(f"{section.name}: {done[section.name]['status']} in {done[section.name]['wall_s']:.0f} s", flush=True)
    return done


def plan_section(out: str) -> int:
    """Child: the planner's prediction for mfu.py's run on one H100: that layout exactly (one
    device, no remat, one microbatch), estimated, compiled and predicted as `jaxpar plan`
    does for each candidate it compiles: with --target (the compiled H100 program's kernels,
    jaxpar.inspect.cost), and without (the roofline over a CPU compile)."""
    from benchmarks.mfu import SHAPE
    from jaxpar.models.llama import LlamaConfig
    from jaxpar.plan import RUNTIME_SHARE, Hardware
    from jaxpar.plan.compile_one import compile_layout
    from jaxpar.plan.layouts import Layout, estimate

    model, hw, hbm_gb = LlamaConfig(**SHAPE), Hardware(devices_per_host=1), 80.0
    layout = Layout(stage=1, data=1, fsdp=1, tensor=1, context=1, expert=1, zero_stage=0, remat="none", microbatches=1)
    guess = estimate(layout, model, BATCH, SEQ, hw)
    # first: a deviceless compile needs JAX's backends unstarted (attention there as on the GPU)
    cost_model = _compiled_for_h100(lambda devices: compile_layout(model, layout.overrides(1, 1), devices, SEQ, BATCH, hw,
                                                                   guess["hbm_bytes"]))
    import jax

    # as jaxpar.plan does: the CPU compiler has no cuDNN attention; the blockwise kernel stands in
    overrides = layout.overrides(1, 1) + ["parallel.attention=flash", "compiler.preset=none"]
    t0 = time.perf_counter()
    found = compile_layout(model, overrides, jax.devices()[:1], SEQ, BATCH, hw, guess["hbm_bytes"])
    doc = {"model": SHAPE, "batch": BATCH, "seq_len": SEQ, "layout": layout.describe(), "overrides": overrides,
           "hardware": hw.describe(), "estimate": guess, "compile_s": time.perf_counter() - t0, **found,
           "fits": found.get("memory", 0) <= hbm_gb * 2**30 * RUNTIME_SHARE, "hbm_gb": hbm_gb, "cost_model": cost_model}
    write(doc, pathlib.Path(out))
    print(json.dumps(doc, indent=1, default=str))
    return 0 if "prediction" in found else 1


def _compiled_for_h100(compile_for) -> dict:
    """`compile_for(devices)` on one H100 compiled for without one (`jaxpar plan --target
    benchmarks/targets/h100.pbtxt`), timed, or {"skipped": why} where the CUDA plugin is missing."""
    try:
        from jaxpar.deviceless import gpu_devices

        devices = gpu_devices(str(ROOT / "benchmarks" / "targets" / "h100.pbtxt"))[:1]
    except Exception as e:  # no jax[cuda] plugin: the roofline alone
        return {"skipped": f"no deviceless H100 compile here ({type(e).__name__}: {str(e)[:200]})"}
    t0 = time.perf_counter()
    return {**compile_for(devices), "compile_s": time.perf_counter() - t0}


PREDICTIONS = ROOT / "benchmarks" / "results" / "predictions.json"
# The registered runs the mfu sections time already, by their mfu.py flags.
TIMED_BY = {("none", 8, 2048, "compute", False, "0.9b", "", ()): ("mfu_bf16", "jaxpar"),
            ("none", 8, 2048, "fp8", False, "0.9b", "", ()): ("mfu_fp8", "jaxpar"),
            ("full", 4, 2048, "compute", False, "3b", "", ()): ("mfu_3b", "jaxpar")}


def flags_key(flags: list[str]) -> tuple:
    """(remat, batch, seq, matmul dtype, unrolled, shape, XLA options, config overrides) of
    the run mfu.py's flags describe."""
    run = Run.from_flags("", flags)
    return (run.remat, run.batch, run.seq_len, run.matmul_dtype, run.unroll_layers, run.shape, run.xla_options,
            run.overrides)


def predicted_section(out: str) -> int:
    """Child: each registered run that no mfu section times, timed by mfu.py (jaxpar only,
    10 steps after 3), one child process each, the newest registered first: the latest
    change's rows are the ones a short budget should reach."""
    registered = json.loads(PREDICTIONS.read_text())["registered"]
    doc = {}
    for name, row in reversed(registered.items()):
        if flags_key(row["mfu_flags"]) in TIMED_BY:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            argv = [sys.executable, "benchmarks/mfu.py", *row["mfu_flags"], "--no-peer", "--steps", "10", "--warmup", "3",
                    "--out", f"{tmp}/mfu.json"]
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
            found = read_json(pathlib.Path(tmp) / "mfu.json") or {}
        doc[name] = {**found.get("jaxpar", {}), **({} if done.returncode == 0 else {"error": done.stderr[-1500:]})}
        write(doc, pathlib.Path(out))
        print(name, json.dumps(doc[name])[:300], flush=True)
    return 0


# ---- the summary: pure functions of the sections' results (tests/unit/test_gpu_battery.py) ----


def result(done: dict, name: str) -> dict:
    return (done.get(name) or {}).get("result") or {}


def speed(row: dict) -> dict:
    """tokens/s and MFU of one mfu.py side, or why it has none."""
    if "tokens_per_s" in row:
        return {"tokens_per_s": row["tokens_per_s"], "mfu": row.get("mfu"), "step_s": row["step_s"]}
    return {"skipped": row.get("skipped", "not measured")}


def ratio(a: dict, b: dict) -> float | None:
    return a["tokens_per_s"] / b["tokens_per_s"] if "tokens_per_s" in a and "tokens_per_s" in b else None


def verdict(value: float | None, target: float, gpu: bool) -> str:
    if not gpu:
        return "n/a (no GPU)"
    if value is None:
        return "n/a (not measured)"
    return "ok" if value >= target else "MISSED"


def worst(rows, *suffixes: str) -> float | None:
    """The largest of the rows' fields whose names end in one of `suffixes` (None without any)."""
    values = [v for r in rows if isinstance(r, dict) for k, v in r.items() if k.endswith(suffixes) and v is not None]
    return max(values) if values else None


def summarize(done: dict, gpu: bool) -> dict:
    """The numbers issue 23 asks for, from the sections' JSON, and the targets judged."""
    bf16, fp8 = result(done, "mfu_bf16"), result(done, "mfu_fp8")
    ours, peer, eight = speed(bf16.get("jaxpar", {})), speed(bf16.get("pytorch", {})), speed(fp8.get("jaxpar", {}))
    s = {"jaxpar_bf16": ours, "pytorch": peer, "jaxpar_fp8": eight,
         "jaxpar_over_pytorch": ratio(ours, peer), "fp8_over_bf16": ratio(eight, ours)}
    big = result(done, "mfu_3b")
    big_ours, big_peer = speed(big.get("jaxpar", {})), speed(big.get("pytorch", {}))
    s["llama_3b"] = {"jaxpar": big_ours, "pytorch": big_peer, "jaxpar_over_pytorch": ratio(big_ours, big_peer)}
    values = {"mfu": ours.get("mfu"), **{k: s[k] for k in ("jaxpar_over_pytorch", "fp8_over_bf16")}}
    s["targets"] = {k: {"value": v, "target": TARGETS[k], "verdict": verdict(v, TARGETS[k], gpu)}
                    for k, v in values.items()}
    overlap = result(done, "overlap")
    s["overlap"] = {f"preset_{p}": overlap.get("variants", {}).get(f"preset={p},collective_matmul=none", {}).get(
        "overlapped_share") for p in ("none", "overlap")}
    s["overlap"]["how"] = overlap.get("how")
    s["plan"] = plan_vs_measured(result(done, "plan").get("prediction", {}), ours.get("step_s"), gpu,
                                 result(done, "plan").get("cost_model", {}).get("prediction", {}))
    s["predictions"] = registered_errors(done, predictions())
    s["cudnn"] = cudnn_summary(result(done, "cudnn").get("cudnn", []))
    checks = result(done, "gpu_checks")
    s["gpu_checks"] = {"pallas_out_error": worst(checks.get("pallas", []), "pallas_out_error"),
                       "grouped_error": worst(checks.get("grouped", []), "_error"),
                       "offload_losses_agree": offload_agrees(checks.get("offload", [])),
                       "offload_loss_difference": offload_difference(checks.get("offload", []))}
    s["muon"] = muon_summary(result(done, "muon").get("muon", []))
    prof = result(done, "profile")
    s["profile"] = {"busy_s": prof.get("device_busy_s_per_step"),
                    "by_kind": {k: v["share"] for k, v in list(prof.get("by_kind", {}).items())[:4]},
                    "top": [(t["name"], t["kind"], t["share"]) for t in prof.get("top", [])[:3]]}
    return s


def predictions() -> dict:
    return json.loads(PREDICTIONS.read_text()).get("registered", {}) if PREDICTIONS.exists() else {}


def registered_errors(done: dict, registered: dict) -> dict:
    """Each registered prediction beside the step the battery measured for its run (an mfu
    section's, or the predicted section's), and its error."""
    out = {}
    for name, row in registered.items():
        section, side = TIMED_BY.get(flags_key(row["mfu_flags"]), ("predicted", None))
        measured = (result(done, section).get(side) if side else result(done, section).get(name)) or {}
        step = measured.get("step_s")
        # the prediction for the device the battery drew, where the row has one for it
        device = next((d for d in row.get("by_device_s", {}) if d in measured.get("device", "")), None)
        predicted = row["by_device_s"][device] if device else row["predicted_s"]
        out[name] = {"predicted_s": predicted, "device": device or "H100", "registered_at": row.get("commit"),
                     "measured_s": step, "error": predicted / step - 1 if step else None}
    return out


def plan_vs_measured(prediction: dict, measured: float | None, gpu: bool, compiled: dict | None = None) -> dict:
    """The planner's step times beside mfu_bf16's: the roofline's (`prediction`) and the cost
    model's over the compiled H100 program (`compiled`, when the section could compile one);
    on a CPU that ran a toy shape, not compared."""
    measured = measured if gpu else None
    predicted, cost = prediction.get("step_s"), (compiled or {}).get("step_s")
    return {"predicted_s": predicted, "predicted_mfu": prediction.get("mfu"), "measured_s": measured,
            "predicted_over_measured": predicted / measured if predicted and measured else None,
            "cost_model_s": cost, "cost_model_over_measured": cost / measured if cost and measured else None,
            **({} if gpu else {"note": "no GPU: mfu.py ran its toy shape; nothing to compare"})}


def muon_summary(rows: list) -> dict:
    """Each optimizer's measured step and the cost model's error on it, and Muon's steps
    over AdamW's (benchmarks/gpu_checks.py's muon section)."""
    steps = {r["setting"]: r for r in rows if isinstance(r, dict) and "step_seconds" in r}
    adamw = steps.get("adamw", {}).get("step_seconds")
    return {name: {"step_s": r["step_seconds"], "predicted_error": r.get("error"),
                   "over_adamw": r["step_seconds"] / adamw if adamw else None} for name, r in steps.items()}


def cudnn_summary(rows: list) -> dict:
    """Worst errors of cuDNN's attention and of the reference in the same dtype (both against
    float32), and each case's forward+backward speedup over the reference."""
    cases = [r for r in rows if isinstance(r, dict) and "cudnn_out_error" in r]
    failed = [f"{r.get('dtype')} seq {r.get('seq')}: {r['error']}"
              for r in rows if isinstance(r, dict) and "error" in r]
    grads = lambda who: worst(cases, *(f"{who}_{g}_error" for g in ("dq", "dk", "dv")))  # noqa: E731
    return {"cases": len(cases), "failed": failed, "out_error": worst(cases, "cudnn_out_error"),
            "grad_error": grads("cudnn"), "reference_out_error": worst(cases, "reference_out_error"),
            "reference_grad_error": grads("reference"),
            "fwd_bwd_speedup": [r["reference_fwd_bwd_seconds"] / r["cudnn_fwd_bwd_seconds"] for r in cases]}


# The recipe computes in bf16, and the offloaded program is another program: XLA fuses (and
# so rounds) it differently, and on an H200 its losses left the resident run's in the 5th
# digit by step 3 (4.7e-5 relative at worst over 12 steps). A wrong update would differ by
# the loss's own steps, about 0.1 or more.
OFFLOAD_LOSS_RTOL = 1e-3


def offload_agrees(rows) -> bool | None:
    """Whether the offloaded runs' losses (optimizer state, parameters) equal the resident
    run's, to bf16's rounding (OFFLOAD_LOSS_RTOL)."""
    difference = offload_difference(rows)
    return None if difference is None else difference <= OFFLOAD_LOSS_RTOL


def offload_difference(rows) -> float | None:
    """The largest relative difference between an offloaded run's losses and the resident
    run's (None without both)."""
    by = {r.get("setting"): r.get("losses") for r in rows if isinstance(r, dict)}
    a = by.get("resident")
    offloaded = [by[k] for k in ("offload_optimizer", "offload_params") if k in by]
    if not a or not offloaded or any(not b or len(b) != len(a) for b in offloaded):  # a run that failed: no verdict
        return None
    return max(abs(x - y) / max(abs(x), 1e-12) for b in offloaded for x, y in zip(a, b))


def fmt(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def render(done: dict, s: dict, setup: dict) -> str:
    """The closing table: each section's status and time, then the numbers and targets."""
    kind = "every section" if setup["gpu"] else "CPU part only"
    lines = [f"GPU battery on {setup.get('device') or setup['platform']} ({kind}), jax {setup.get('jax', '?')}", "",
             f"{'section':11s} {'status':24s} {'wall':>6s}  note"]
    for name, row in done.items():
        wall = "-" if row.get("wall_s") is None else f"{row['wall_s']:.0f} s"
        lines.append(f"{name:11s} {row['status'][:24]:24s} {wall:>6s}  {row.get('error', '')[:75]}")
    lines += ["", f"{'speed':24s} {'tokens/s':>10s} {'MFU':>6s}"]
    for key, label in (("jaxpar_bf16", "jaxpar bf16"), ("pytorch", "pytorch bf16 autocast"),
                       ("jaxpar_fp8", "jaxpar fp8 matmuls"), ("3b/jaxpar", "3B: jaxpar bf16"),
                       ("3b/pytorch", "3B: pytorch")):
        row = s[key] if key in s else s["llama_3b"][key.split("/")[1]]
        if "skipped" in row:
            lines.append(f"{label:24s} skipped: {str(row['skipped'])[:80]}")
        else:
            lines.append(f"{label:24s} {row['tokens_per_s']:10,.0f} {fmt(row['mfu'], '.1%', 'n/a'):>6s}")
    lines += ["", f"{'target':24s} {'value':>10s} {'wanted':>6s}  verdict"]
    for key, t in s["targets"].items():
        lines.append(f"{key:24s} {fmt(t['value']):>10s} {'>=' + format(t['target'], 'g'):>6s}  {t['verdict']}")
    o, p, c, g = s["overlap"], s["plan"], s["cudnn"], s["gpu_checks"]
    speedups = ", ".join(f"{x:.1f}x" for x in c["fwd_bwd_speedup"]) or "-"
    lines += [
        "",
        f"overlapped share  preset none {fmt(o['preset_none'], '.1%')}, overlap {fmt(o['preset_overlap'], '.1%')}"
        f" ({o['how'] or 'not measured'})",
        f"plan (1 H100)     cost model {fmt(p.get('cost_model_s'), '.3f')} s a step"
        f" ({fmt(p.get('cost_model_over_measured'))} of measured), roofline {fmt(p['predicted_s'], '.3f')} s"
        f" ({fmt(p['predicted_over_measured'])}), measured {fmt(p['measured_s'], '.3f')} s"
        + (f" ({p['note']})" if "note" in p else ""),
        f"cudnn attention   {c['cases']} cases ({len(c['failed'])} failed); worst error"
        f" out {fmt(c['out_error'], '.1e')}, grads {fmt(c['grad_error'], '.1e')}"
        f" (reference in the same dtype: {fmt(c['reference_out_error'], '.1e')},"
        f" {fmt(c['reference_grad_error'], '.1e')}); fwd+bwd speedup {speedups}",
        f"gpu_checks        pallas out error {fmt(g['pallas_out_error'], '.1e')}, grouped error"
        f" {fmt(g['grouped_error'], '.1e')}, offload losses agree {fmt(g['offload_losses_agree'], '')}"
        f" (worst relative difference {fmt(g['offload_loss_difference'], '.1e')})",
        "predictions       " + ("; ".join(f"{k} {fmt(v['predicted_s'], '.3f')} s vs {fmt(v['measured_s'], '.3f')}"
                                       f" ({fmt(v['error'], '+.1%')})" for k, v in s["predictions"].items()) or "-"),
        "muon (0.9B, dots) " + ("; ".join(f"{k} {fmt(v['step_s'], '.3f')} s ({fmt(v['over_adamw'], '.2f')}x AdamW,"
                                        f" predicted {fmt(v['predicted_error'], '+.1%')})"
                                        for k, v in s["muon"].items()) or "-"),
        f"profile           device busy {fmt(s['profile']['busy_s'], '.3f')} s a step: "
        + (", ".join(f"{k} {v:.0%}" for k, v in s["profile"]["by_kind"].items()) or "-"),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.section == "plan":
        return plan_section(args.out)
    if args.section == "predicted":
        return predicted_section(args.out)
    from jaxpar.device_memory import share_gpu_memory

    share_gpu_memory()  # every section's process inherits it: the planner's 90%, not JAX's 75%
    setup = probe(args.cpu_only)
    setup.update(gpu=setup["platform"] == "gpu", python=platform.python_version(), date=time.strftime("%Y-%m-%d %H:%M"))
    print(f"platform: {setup['platform']} ({setup.get('device') or setup.get('why', '')}); "
          f"{'every section' if setup['gpu'] else 'the CPU part only'}", flush=True)
    args.budget = args.budget or (QUICK_BUDGET_S if args.quick else 460)
    chosen = sections(setup["gpu"], args.quick)
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {x.name for x in chosen}
        if unknown:
            raise SystemExit(f"--only: unknown section {','.join(sorted(unknown))}; use some of "
                             f"{','.join(x.name for x in chosen)}")
        chosen = [x for x in chosen if x.name in wanted]
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="gpu_battery-"))  # children's JSON and logs, kept for reading
    t0 = time.perf_counter()
    done = run_all(chosen, setup["gpu"], args.budget, workdir)
    setup.update(total_s=round(time.perf_counter() - t0, 1), budget_s=args.budget, quick=args.quick, logs=str(workdir),
                 section_s={name: row.get("wall_s") for name, row in done.items()})
    summary = summarize(done, setup["gpu"])
    write({"setup": setup, "summary": summary, "sections": done},
          ROOT / args.out if not os.path.isabs(args.out) else pathlib.Path(args.out))
    print("\n" + render(done, summary, setup))
    print(f"\nwrote {args.out} in {setup['total_s']:.0f} s (children's logs in {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
