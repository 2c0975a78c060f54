"""DiLoCo and streaming DiLoCo (parallel.diloco) against data parallelism and PowerSGD, on CPU
virtual devices: what crosses between the groups, what it does to learning, and when it pays.

  1. learning (training): the tiny Hugging Face Llama (tests/golden/llama_tied) fine-tuned on
     the shipped text (tests/golden/corpus.txt) for --steps steps over 2 groups (mesh.data=2,
     one simulated host each, fsdp 2 x tensor 2 inside, as benchmarks/compression.py): data
     parallel, PowerSGD rank 4, DiLoCo with H = 10 and 50, and streaming DiLoCo (H = 50 in 2
     fragments, each exchange beside an inner step, int8 with error feedback). Per method the
     steps to each of LEVELS (the training loss, mean of 5 steps), '-' where never reached,
     and a PNG of the curves.
  2. bytes between the groups (compiled): the bytes a device sends across hosts per step in
     the compiled program (jaxpar.inspect, ring model), beside the formula. DiLoCo's exchange
     sits in its fragments' branches, weighed by how often each runs (once every H steps;
     jaxpar.step.diloco.branch_shares), beside jaxpar.step.diloco.outer_bytes.
  3. when it pays: the time to each loss level at 1, 10, 100 and 400 Gb/s between groups:
     the steps of section 1 x (compute + the bytes of section 2 over the link), nothing
     overlapped, with two computes: the tiny model's step as measured here (median CPU step
     time of the data-parallel run), and Llama-2-7B's shape on 2 groups of 8 GPUs, compute
     from the H200 battery's measured throughput (benchmarks/results/gpu_battery_h200_jax0.11.2.json)
     and its bytes by the same formulas. The steps to a level are the tiny run's at both.

  python benchmarks/diloco.py [--steps 300] [--out benchmarks/results/diloco.json]
  python benchmarks/diloco.py --target benchmarks/targets/h100.pbtxt   # the schedule, below

  --target FILE: instead, compile streaming DiLoCo's step (2 fragments, H = 4) of a 0.5B Llama
  for 2 hosts x 4 GPUs that FILE describes, deviceless (a venv with jax[cuda13]:
  docs/xla_options.md), with the exchange after the inner step (delay 0) and beside it
  (delay 1), float32 and int8; from the scheduled HLO, the share of the outer collectives'
  bytes XLA issued asynchronously with compute between start and done, and of their transfer
  time the compute beside them covers (jaxpar.inspect.cost); writes
  benchmarks/results/diloco_schedule.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compression import (FINETUNE, SCHEDULE_MODEL, SMOOTH, TWO_HOSTS, draw, schedule_setup,  # noqa: E402
                                    steps_to)
from benchmarks.gpu_checks import write  # noqa: E402  (the atomic JSON writer)

METHODS = {
    "data parallel": [],
    "powersgd r4": ["parallel.compression.method=powersgd", "parallel.compression.powersgd_rank=4"],
    "diloco H=10": ["parallel.diloco.inner_steps=10"],
    "diloco H=50": ["parallel.diloco.inner_steps=50"],
    "streaming H=50": ["parallel.diloco.inner_steps=50", "parallel.diloco.fragments=2", "parallel.diloco.delay=1",
                       "parallel.diloco.compression=int8"],
}
LEVELS = (3.0, 2.0, 1.5, 1.0, 0.5)
BANDWIDTHS_GBIT = (1, 10, 100, 400)
SCALE = dict(vocab_size=32000, embed=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, mlp=11008)
SCALE_TOKENS_PER_GPU = 8192  # 2 x 4096 tokens per GPU a step
BATTERY = "benchmarks/results/gpu_battery_h200_jax0.11.2.json"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="benchmarks/results/diloco.json")
    p.add_argument("--png", default="benchmarks/results/diloco.png")
    p.add_argument("--target", help="GpuTargetConfig file: only the deviceless schedule (see above)")
    return p.parse_args()


def schedule(target: str, out: pathlib.Path) -> None:
    """The deviceless GPU compile (--target): streaming DiLoCo, delay 0 and 1, float32 and int8."""
    devices, base = schedule_setup(target)
    import jax

    from jaxpar.config import apply_overrides
    from jaxpar.inspect import inspect_step
    from jaxpar.inspect.explain import explain
    from jaxpar.train import build as build_on

    rows = []
    print(f"{'delay':>5} {'outer':<6} {'bytes/step':>11} {'async':>6} {'overlapped':>10} {'covered':>8} {'step':>9}")
    for delay in (0, 1):
        for compression in ("none", "int8"):
            config = apply_overrides(base, ["mesh.data=2", "mesh.hosts.data=2", "mesh.fsdp=4",
                                            "parallel.diloco.inner_steps=4", "parallel.diloco.fragments=2",
                                            f"parallel.diloco.delay={delay}",
                                            f"parallel.diloco.compression={compression}"])
            trainer = build_on(config, devices)
            report = inspect_step(trainer)
            doc = explain(trainer, report)
            sched, covered = doc["outer_schedule"], report.predicted["outer_cover"]
            row = dict(delay=delay, compression=compression, bytes_per_step=doc["outer_traffic"]["measured"],
                       formula=doc["outer_traffic"]["formula"], async_share=sched["async_share"],
                       overlapped_share=sched["overlapped_share"], covered=covered,
                       predicted_step_s=report.predicted["seconds"])
            rows.append(row)
            print(f"{delay:>5} {compression:<6} {row['bytes_per_step']:>11,.0f} {row['async_share']:>6.0%} "
                  f"{row['overlapped_share']:>10.0%} {covered['share']:>8.0%} {row['predicted_step_s'] * 1e3:>7.1f}ms",
                  flush=True)
    write(dict(how=f"deviceless compile for 1x2x4 x {devices[0].device_kind} ({target})", jax=jax.__version__,
               model=SCHEDULE_MODEL, layout="mesh.data=2 (one group per host) x fsdp=4, bf16, batch 16 x 1024; "
               "parallel.diloco.inner_steps=4 fragments=2", rows=rows,
               command="python benchmarks/diloco.py --target " + target), out)
    print(f"wrote {out}")


def configs(steps: int) -> dict:
    from jaxpar.recipes import resolve_config

    return {name: resolve_config(f"hf:{ROOT}/tests/golden/llama_tied",
                                 [*TWO_HOSTS, *FINETUNE, *overrides, f"train.steps={steps}"], 8)
            for name, overrides in METHODS.items()}


def learn(config) -> tuple[list[float], list[float]]:
    """(losses, step times after the first) of one run."""
    import jax

    from jaxpar.loop.run import run
    from jaxpar.train import build

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = run(build(config, jax.devices()[:8]), progress=True)
    return [h["loss"] for h in history], [h["step_time_s"] for h in history[1:]]


def group_bytes(config) -> dict:
    """Bytes per device per step across hosts: compiled (DiLoCo's branches over H) and by
    formula."""
    import jax

    from jaxpar.inspect import inspect_step
    from jaxpar.step.diloco import outer_bytes
    from jaxpar.train import build

    trainer = build(config, jax.devices()[:8])
    report = inspect_step(trainer)
    spec, groups = config.parallel.diloco, config.mesh.data
    compiled = report.cross_host_bytes()  # DiLoCo's branches weighed by how often they run
    if spec.inner_steps:
        formula = outer_bytes(spec, _local_elements(trainer), groups)
    elif trainer.compressor is not None:
        formula = trainer.compressor.cross_host_bytes()["compressed"]
    else:
        formula = 2 * 4 * _local_elements(trainer) * (groups - 1) / groups  # a float32 all-reduce, ZeRO-0
    return {"compiled": compiled, "formula": formula}


def _local_elements(trainer) -> float:
    """The elements of the weights one device holds inside its group."""
    import math

    import jax

    return sum(math.prod(s.shard_shape(x.shape)) for x, s in
               zip(jax.tree.leaves(jax.eval_shape(lambda: trainer.master_params(trainer.init()))),
                   jax.tree.leaves(trainer.shardings.optimizer)))


def scale_bytes(name: str) -> float:
    """Per GPU per step across groups at SCALE, 2 groups of fsdp 8, by the formulas above."""
    from jaxpar.config import Config, apply_overrides
    from jaxpar.models.llama import LlamaConfig
    from jaxpar.step.diloco import outer_bytes

    psi = LlamaConfig(**SCALE).param_count() / 8  # fsdp 8 inside a group
    config = apply_overrides(Config(), METHODS[name])
    spec = config.parallel.diloco
    if spec.inner_steps:
        return outer_bytes(spec, psi, 2)
    if config.parallel.compression.method == "powersgd":
        rank, d, f, layers = 4, SCALE["embed"], SCALE["mlp"], SCALE["num_layers"]
        factors = layers * rank * (4 * (d + d) + 3 * (d + f))  # q, k, v, o, and the MLP's three
        return 2 * 4 * factors / 8 * (2 - 1) / 2
    return 2 * 4 * psi * (2 - 1) / 2


def main() -> None:
    args = parse_args()
    if args.target:
        return schedule(args.target, ROOT / "benchmarks/results/diloco_schedule.json")
    from jaxpar.mesh import force_cpu_devices

    force_cpu_devices(8)
    import jax

    runs = configs(args.steps)
    curves, times, moved = {}, {}, {}
    for name, config in runs.items():
        t0 = time.time()
        curves[name], step_times = learn(config)
        times[name] = statistics.median(step_times)
        moved[name] = group_bytes(config)
        print(f"{name}: {args.steps} steps in {time.time() - t0:.0f} s", file=sys.stderr)
    reached = {n: {str(level): steps_to(c, level) for level in LEVELS} for n, c in curves.items()}
    compute = times["data parallel"]
    battery = json.loads((ROOT / BATTERY).read_text())["summary"]["jaxpar_bf16"]
    scale_compute = 6 * __import__("jaxpar.models.llama", fromlist=["LlamaConfig"]).LlamaConfig(**SCALE).param_count() \
        * SCALE_TOKENS_PER_GPU / (battery["mfu"] * 989e12)

    print(f"\ntiny HF Llama on the shipped text, 2 groups x (fsdp 2 x tensor 2), {args.steps} steps: steps to a loss "
          f"(mean of {SMOOTH}), and bytes per device per step between the groups")
    print(f"{'method':<16} " + " ".join(f"{'<= ' + str(level):>8}" for level in LEVELS)
          + f" {'final':>7} {'bytes/step':>11} {'formula':>9} {'CPU step':>9}")
    for name, curve in curves.items():
        print(f"{name:<16} " + " ".join(f"{reached[name][str(level)] or '-':>8}" for level in LEVELS)
              + f" {sum(curve[-SMOOTH:]) / SMOOTH:>7.3f} {moved[name]['compiled']:>11,.0f} "
                f"{moved[name]['formula']:>9,.0f} {times[name] * 1e3:>7.1f}ms")

    rows = []
    for where, step_compute, bytes_of in (("tiny (CPU compute)", compute, lambda n: moved[n]["compiled"]),
                                          ("Llama-2-7B, 2 x 8 GPUs", scale_compute, scale_bytes)):
        for name in curves:
            for gbit in BANDWIDTHS_GBIT:
                step = step_compute + bytes_of(name) / (gbit / 8 * 1e9)
                rows.append(dict(shape=where, method=name, gbit=gbit, step_s=step, compute_s=step_compute,
                                 bytes_per_step=bytes_of(name),
                                 to_level={str(lv): (reached[name][str(lv)] * step if reached[name][str(lv)] else None)
                                           for lv in LEVELS}))
    for level in (str(LEVELS[2]), str(LEVELS[-1])):
        print(f"\nwhen it pays: time to loss {level} (the tiny run's steps x (compute + bytes / link)), nothing "
              "overlapped")
        print(f"{'shape':<24} {'method':<16} " + " ".join(f"{str(g) + ' Gb/s':>12}" for g in BANDWIDTHS_GBIT))
        for where in ("tiny (CPU compute)", "Llama-2-7B, 2 x 8 GPUs"):
            for name in curves:
                cells = [r["to_level"][level] for r in rows if r["shape"] == where and r["method"] == name]
                print(f"{where:<24} {name:<16} " + " ".join(f"{c:>11.1f}s" if c else f"{'-':>12}" for c in cells))

    drawn = draw(curves, args.png, f"tiny HF Llama on the shipped text, 2 groups ({args.steps} steps)")
    payload = dict(layout=TWO_HOSTS, platform=platform.platform(), jax=jax.__version__, methods=METHODS,
                   loss=dict(run="hf:tests/golden/llama_tied " + " ".join(FINETUNE).replace(f"{ROOT}/", ""),
                             steps=args.steps, levels=LEVELS, smooth=SMOOTH, steps_to_level=reached, curves=curves),
                   bytes_between_groups=moved, cpu_step_s=times,
                   when_it_pays=dict(scale=SCALE, scale_tokens_per_gpu=SCALE_TOKENS_PER_GPU, battery=BATTERY,
                                     scale_compute_s=scale_compute, rows=rows),
                   png=args.png if drawn else None, command="python benchmarks/diloco.py " + " ".join(sys.argv[1:]))
    write(payload, pathlib.Path(args.out))
    print(f"wrote {args.out}" + (f" and {args.png}" if drawn else ""))


if __name__ == "__main__":
    main()
