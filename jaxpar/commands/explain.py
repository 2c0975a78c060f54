"""`jaxpar explain RECIPE`: compile a recipe's step on abstract inputs and account for its
memory, FLOPs and traffic against the formulas (jaxpar.inspect.explain)."""

from __future__ import annotations

import os
import sys

from jaxpar.commands.common import RECIPE_HELP, add_overrides
from jaxpar.errors import ConfigError


def add_parser(sub) -> None:
    explain = sub.add_parser("explain", help="compile a recipe's step and account for its memory and traffic")
    explain.add_argument("recipe", help=RECIPE_HELP)
    add_overrides(explain, "parallel.zero.stage=3")
    explain.add_argument("--devices", type=int, metavar="N",
                         help="compile for N virtual CPU devices (up to 512), or N GPUs with --target; default: the "
                         "accelerators present, else 8 CPU devices as `train` uses")
    explain.add_argument("--target", metavar="FILE",
                         help="compile for GPUs this GpuTargetConfig describes (benchmarks/targets/h100.pbtxt), "
                         "without one (needs pip install 'jax[cuda13]'), and predict the step's time on them")
    explain.add_argument("--cost-profile", metavar="PATH",
                         help="with --target: compile twice, the second time scheduled by jaxpar's cost model: the first "
                         "program's kernel and collective times written to PATH as XLA's latency profile, which the "
                         "GPU's scheduler then reads (train with compiler.options="
                         "xla_gpu_pgle_profile_file_or_directory_path=PATH to use it); the table is the second program's")
    explain.add_argument("--json", action="store_true", help="print JSON instead of the table")
    explain.add_argument("--png", metavar="PATH", help="with mesh.stage > 1: also draw the pipeline schedule as a PNG")


def run(args) -> int:
    """Nothing runs and nothing is allocated: the step is lowered on abstract inputs."""
    from jaxpar.mesh import force_cpu_devices

    if args.devices is not None:
        if not 1 <= args.devices <= 512:
            raise ConfigError(f"--devices={args.devices}; use 1 to 512 virtual CPU devices")
        os.environ["JAX_PLATFORMS"] = "cpu"  # must precede JAX's backend start
    if args.target:  # deviceless GPUs, one host of them
        from jaxpar.deviceless import gpu_devices

        devices = gpu_devices(args.target, f"1x1x{args.devices or 1}")
    else:  # without --devices, 8 as `train` uses: only the CPU backend reads it; accelerators win
        force_cpu_devices(8 if args.devices is None else args.devices)
    import json

    import jax

    from jaxpar.inspect import inspect_step
    from jaxpar.inspect.explain import explain as explain_step
    from jaxpar.inspect.explain import render
    from jaxpar.recipes import resolve_config
    from jaxpar.step.trainer import build

    from jaxpar.loop.metrics import prepare_file

    if args.png:
        prepare_file(args.png, f"--png={args.png!r}", "schedule.png")
    devices = devices if args.target else jax.devices()
    if args.cost_profile:
        if devices[0].platform != "gpu":
            raise ConfigError(f"--cost-profile={args.cost_profile!r} writes the costs of a program compiled for GPUs, but "
                              f"the devices are {devices[0].platform}; add --target (e.g. benchmarks/targets/h100.pbtxt)")
        prepare_file(args.cost_profile, f"--cost-profile={args.cost_profile!r}", "costs.pbtxt")
    config = resolve_config(args.recipe, args.overrides, len(devices))
    trainer = build(config, devices)
    if args.png and trainer.pipeline is None:
        raise ConfigError("--png draws the pipeline schedule, but mesh.stage=1; set mesh.stage>1")
    report = inspect_step(trainer, with_latency_profile=bool(args.cost_profile))
    if args.cost_profile:
        trainer, report = _scheduled_by_costs(config, devices, report, args.cost_profile)
    doc = explain_step(trainer, report)
    print(json.dumps(doc, indent=1) if args.json else render(doc))
    if args.png:
        from jaxpar.pipeline import build_schedule
        from jaxpar.pipeline.picture import save_png

        schedule, t = trainer.layout.pipeline.schedule, trainer.pipeline.timeline
        timeline = build_schedule(schedule, t.p, t.m, t.v)
        title = f"{args.recipe}: {schedule}, p={t.p}, m={t.m}, v={t.v}"
        print(f"wrote {save_png(timeline, args.png, title)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _scheduled_by_costs(config, devices, report, path: str):
    """(trainer, report) of the step compiled again with the first compile's costs as XLA's
    latency profile, written to `path`."""
    import dataclasses
    import pathlib

    from jaxpar.inspect import inspect_step
    from jaxpar.step.trainer import build

    target = pathlib.Path(path).absolute()
    target.write_text(report.latency_profile)
    option = f"xla_gpu_pgle_profile_file_or_directory_path={target}"
    given = config.compiler.options
    compiler = dataclasses.replace(config.compiler, options=f"{given},{option}" if given else option)
    trainer = build(dataclasses.replace(config, compiler=compiler), devices)
    return trainer, inspect_step(trainer)
