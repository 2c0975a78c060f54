"""Predictions for machines of many GPUs, registered before any of them runs: DeepSeek-V3 on
2,048 H100s (the planner's best compiled layout, and DeepSeek's own PP 16 x EP 64 x ZeRO-1),
and an analogue of each on 2 hosts x 8 H100s that a 16-GPU machine could measure. Each is the
step XLA compiles for those GPUs without them (deviceless), timed by jaxpar's cost model
(jaxpar.inspect.cost) and, under a pipeline, stretched by its lockstep ticks as `jaxpar plan
--target` does (jaxpar.plan.compile_one.compiled_prediction), with the commit it was made at
and the command that measures it.

  <venv with jax[cuda13]>/bin/python benchmarks/predict_cluster.py [--only NAME] [--redo]

They go to benchmarks/results/predictions.json under "cluster" (the GPU battery, one GPU,
reads "registered" only). A prediction already there is kept as it was (the point is to have
made it first); --redo replaces them (say why in the commit).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from expert_overlap import WIDE  # noqa: E402  (DeepSeek's layer width, 2 MoE layers after a dense one)

OUT = ROOT / "benchmarks" / "results" / "predictions.json"
TARGET = "benchmarks/targets/h100.pbtxt"
AT_SCALE = ["train.seq_len=4096", "train.global_batch=2048", "parallel.attention=reference"]


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    recipe: str
    devices: int
    overrides: tuple[str, ...]
    why: str


# The 16-GPU cells take benchmarks/expert_overlap.py's layer and layout (expert 8 over the 2
# hosts x data 2) with the settings that predicted the shortest step without a second compile.
SMALL = tuple(o for o in WIDE if not o.startswith(("mesh.", "parallel.zero")))


def stage_a_host(schedule: str, microbatches: int, *more: str) -> tuple[str, ...]:
    """DeepSeek's kind of layout on 16 GPUs: a stage a host, experts inside it, ZeRO-1."""
    return (*SMALL, "mesh.stage=2", "mesh.hosts.stage=2", "mesh.expert=8", "mesh.data=1", "parallel.zero.stage=1",
            f"parallel.pipeline.schedule={schedule}", "parallel.pipeline.layers=2,1", f"train.microbatches={microbatches}",
            *more)


def deepseek_layout(schedule: str, microbatches: int, *more: str) -> tuple[str, ...]:
    """DeepSeek-V3's own layout: PP 16 x EP 64 (over 8 hosts) x ZeRO-1 over data 2, full remat."""
    return ("mesh.stage=16", "mesh.hosts.stage=16", "mesh.expert=64", "mesh.hosts.expert=8", "mesh.data=2",
            "mesh.hosts.data=2", "parallel.zero.stage=1", f"parallel.pipeline.schedule={schedule}",
            "parallel.pipeline.layers=3,4*14,2", f"train.microbatches={microbatches}", "model.remat=full", *more)


# DeepSeek's batch (15,360 sequences of 4,096: its report's) with two hops and FP8 dispatch
DEEPSEEK_BATCH = ("model.group_capacity=true", "parallel.expert_dispatch_dtype=fp8", "train.seq_len=4096",
                  "train.global_batch=15360")


def plan_layout(schedule: str) -> tuple[str, ...]:
    """The planner's best layout for 2,048 H100s: PP 16 x data 16 x tensor 8, no remat, m = 64."""
    return ("mesh.stage=16", "mesh.data=16", "mesh.tensor=8", "mesh.hosts.data=16", "mesh.hosts.stage=16",
            "parallel.zero.stage=1", "model.remat=none", "train.microbatches=64", "parallel.tensor.sequence_parallel=true",
            f"parallel.pipeline.schedule={schedule}", "parallel.pipeline.layers=3,4*14,2", "train.seq_len=4096",
            "train.global_batch=2048")


RUNS = (
    Cluster("deepseek_layer_16gpu_best", "deepseek", 16,
            (*WIDE, "parallel.attention=reference", "parallel.expert_dispatch_dtype=fp8", "model.group_capacity=true"),
            "the best 16-GPU analogue: experts over both hosts, FP8 dispatch, two hops"),
    Cluster("deepseek_layer_16gpu_pp_ep", "deepseek", 16, stage_a_host("1f1b", 2, "parallel.attention=reference"),
            "DeepSeek's kind of layout on 16 GPUs: a stage a host, experts inside it, ZeRO-1"),
    Cluster("deepseek_v3_2048_pp16_ep64", "deepseek-v3", 2048, deepseek_layout("1f1b", 16, *AT_SCALE),
            "DeepSeek-V3's own layout: PP 16 x EP 64 (over 8 hosts) x ZeRO-1 over data 2"),
    Cluster("deepseek_v3_2048_plan_best", "deepseek-v3", 2048, plan_layout("1f1b"),
            "the best layout `jaxpar plan --model deepseek-v3 --devices 2048 --hbm-gb 80 --compile-top 1 --target "
            "benchmarks/targets/h100.pbtxt` compiled (commit 99e7bba)"),
    # After the overlapped schedule, cuDNN attention inside stages and the experts' combine:
    # attention as `auto` runs it on GPUs (cuDNN's), not the reference the cells above compiled.
    Cluster("deepseek_layer_16gpu_pp_ep_overlap", "deepseek", 16, stage_a_host("1f1b-overlap", 4),
            "DeepSeek's kind of layout on 16 GPUs, each forward beside a backward (1f1b-overlap), 4 microbatches"),
    Cluster("deepseek_v3_2048_pp16_ep64_overlap", "deepseek-v3", 2048,
            deepseek_layout("1f1b-overlap", 120, *DEEPSEEK_BATCH),
            "DeepSeek-V3's layout and batch (15,360 sequences: its report's), each forward beside a backward, two "
            "hops, FP8 dispatch"),
    Cluster("deepseek_v3_2048_plan_overlap", "deepseek-v3", 2048, plan_layout("1f1b-overlap"),
            "the planner's best formula estimate with the overlapped schedule among its candidates (48% MFU by "
            "formula), compiled"),
    # The same two layouts after the executor went manual over `expert` (commit 683abd7): the
    # weights every expert-parallel device holds are summed over it once a step.
    Cluster("deepseek_layer_16gpu_pp_ep_by_expert", "deepseek", 16, stage_a_host("1f1b-overlap", 4),
            "deepseek_layer_16gpu_pp_ep_overlap with the executor manual over expert"),
    Cluster("deepseek_v3_2048_pp16_ep64_by_expert", "deepseek-v3", 2048,
            deepseek_layout("1f1b-overlap", 120, *DEEPSEEK_BATCH),
            "deepseek_v3_2048_pp16_ep64_overlap with the executor manual over expert"),
    # ... with the latency-hiding scheduler's memory limit raised (docs/xla_options.md): at
    # XLA's 95% of HBM it leaves the all-to-alls synchronous beside a step near that limit
    Cluster("deepseek_v3_2048_pp16_ep64_scheduler_memory", "deepseek-v3", 2048,
            deepseek_layout("1f1b-overlap", 120, *DEEPSEEK_BATCH, "model.remat=selective",
                            "compiler.options=xla_gpu_memory_limit_slop_factor=400"),
            "deepseek_v3_2048_pp16_ep64_by_expert with selective remat and the scheduler's memory limit raised"),
)


def predict(run: Cluster, devices) -> dict:
    from jaxpar.inspect import inspect_step
    from jaxpar.plan.compile_one import compiled_prediction
    from jaxpar.recipes import resolve_config
    from jaxpar.train import build

    config = resolve_config(run.recipe, list(run.overrides), run.devices)
    t0 = time.perf_counter()
    trainer = build(config, devices)
    report = inspect_step(trainer)
    step = compiled_prediction(report, trainer.config, trainer.layout)  # as `jaxpar plan --target` predicts it
    return {"predicted_s": step["step_s"], "predicted_mfu": step["mfu"], "bubble": step["bubble"],
            "by_kind_s": report.predicted["by_kind"], "all_to_all_cover": report.predicted["all_to_all_cover"]["share"],
            "peak_gib": report.memory.peak / 2**30, "devices": run.devices, "hosts": config.mesh.hosts.num_hosts,
            "recipe": run.recipe, "overrides": list(run.overrides), "why": run.why,
            "measure": f"jaxpar train {run.recipe} " + " ".join(f"--set {o}" for o in run.overrides),
            "compile_s": round(time.perf_counter() - t0, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", default=[], help="a run's name (repeatable)")
    p.add_argument("--redo", action="store_true", help="replace registered predictions too")
    args = p.parse_args()
    done = json.loads(OUT.read_text()).get("cluster", {})
    runs = [r for r in RUNS if (not args.only or r.name in args.only) and (args.redo or r.name not in done)]
    counts = sorted({r.devices for r in runs})
    if len(counts) > 1:  # a process per device count: the deviceless backend starts once a process
        for n in counts:
            names = [f"--only={r.name}" for r in runs if r.devices == n]
            subprocess.run([sys.executable, __file__, *names, *(["--redo"] if args.redo else [])], cwd=ROOT, check=True)
        return 0
    if not runs:
        return 0
    import jax

    from jaxpar.deviceless import gpu_devices

    devices = gpu_devices(str(ROOT / TARGET), f"1x1x{counts[0]}")
    doc = json.loads(OUT.read_text())
    cluster = doc.setdefault("cluster", {})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for run in runs:
        row = predict(run, devices)
        cluster[run.name] = {**row, "commit": commit, "jax": jax.__version__, "date": datetime.date.today().isoformat()}
        print(f"{run.name:<30} {row['predicted_s']:8.3f} s  MFU {row['predicted_mfu']:6.1%}  peak {row['peak_gib']:6.1f} GiB"
              f"  ({row['compile_s']:.0f} s)", flush=True)
        OUT.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
