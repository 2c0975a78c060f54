"""`jaxpar train RECIPE [--set key=value ...]`, `jaxpar launch --nproc N -- train RECIPE ...`,
`jaxpar explain RECIPE`, `jaxpar plan --model NAME --devices N --hbm-gb G`, `jaxpar schedule NAME`,
`jaxpar recipes`, and, each in its own module (COMMANDS), `jaxpar sample CHECKPOINT --prompt TEXT`,
`jaxpar export CHECKPOINT OUT` (to Hugging Face's format) and `jaxpar tokenize PATH --out FILE`. RECIPE is a shipped name, a path to a .py file defining `recipe() -> Config`, or
`package.module[:function]` (jaxpar.recipes.load).

Device set-up comes first: JAX reads the CPU device count once, when its backends start.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from jaxpar.errors import ConfigError, JaxparWarning, Preempted, TrainingStopped

PREEMPTED_EXIT = 143  # as if SIGTERM had ended the process: schedulers requeue on it
RECIPE_HELP = ("a shipped recipe (see `jaxpar recipes`), a path to a .py file defining recipe() -> Config "
               "(path.py:function names another), or package.module[:function] importable from here")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxpar", description="JAX SPMD training on a named mesh.")
    sub = p.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a recipe")
    train.add_argument("recipe", help=RECIPE_HELP)
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. --set mesh.fsdp=2 (repeatable)")
    train.add_argument("--cpu-devices", type=int, default=8, metavar="N",
                       help="virtual CPU devices when no accelerator is present (default 8)")
    train.add_argument("--metrics-file", metavar="PATH", help="write one JSON object per step")
    train.add_argument("--tensorboard", metavar="DIR",
                       help="also write each step's metrics as TensorBoard scalars into DIR "
                       "(pip install 'jaxpar[tensorboard]')")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--print-config", action="store_true", help="print every config key and exit")
    explain = sub.add_parser("explain", help="compile a recipe's step and account for its memory and traffic")
    explain.add_argument("recipe", help=RECIPE_HELP)
    explain.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config field, e.g. --set parallel.zero_stage=3 (repeatable)")
    explain.add_argument("--devices", type=int, metavar="N",
                         help="compile for N virtual CPU devices (up to 512); default: the accelerators present, "
                         "else 8 CPU devices as `train` uses")
    explain.add_argument("--json", action="store_true", help="print JSON instead of the table")
    explain.add_argument("--png", metavar="PATH", help="with mesh.stage > 1: also draw the pipeline schedule as a PNG")
    schedule = sub.add_parser("schedule", help="draw a pipeline schedule and measure its bubble")
    schedule.add_argument("name", help="gpipe, 1f1b, interleaved or zb-h1")
    schedule.add_argument("--stages", type=int, default=4, metavar="P", help="pipeline stages (default 4)")
    schedule.add_argument("--microbatches", type=int, default=8, metavar="M", help="microbatches (default 8)")
    schedule.add_argument("--chunks", type=int, default=1, metavar="V", help="virtual stages per device (interleaved)")
    schedule.add_argument("--png", metavar="PATH", help="also write the picture as a PNG")
    plan = sub.add_parser("plan", help="rank layouts for a cluster by compiled memory and a roofline step time")
    plan.add_argument("--model", required=True, metavar="NAME",
                      help="llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, or a recipe as `train` takes it: "
                      "a shipped name, a path to a .py file, or package.module[:function]")
    plan.add_argument("--devices", type=int, required=True, metavar="N", help="GPUs in the cluster (compiled for as CPU devices)")
    plan.add_argument("--hbm-gb", type=float, required=True, metavar="G", help="memory per GPU in GiB, e.g. 80")
    plan.add_argument("--hosts", type=int, metavar="H", help="hosts (default: N / 8, 8 GPUs per host)")
    plan.add_argument("--seq-len", type=int, metavar="S", help="tokens per sequence (default: the recipe's, else 4096)")
    plan.add_argument("--global-batch", type=int, metavar="B", help="sequences per step (default: N)")
    plan.add_argument("--compile-top", type=int, default=4, metavar="K", help="compile the K fastest estimates (default 4)")
    plan.add_argument("--compile-timeout", type=float, default=600.0, metavar="S",
                      help="seconds each layout's compile may take before it is stopped and marked failed (default 600)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of the table")
    launch = sub.add_parser("launch", help="run `train` (or `export`) in several local processes joined by jax.distributed")
    launch.add_argument("--nproc", type=int, required=True, metavar="N", help="processes to start")
    launch.add_argument("--cpu-devices-per-proc", type=int, metavar="K",
                        help="virtual CPU devices per process when no accelerator is present (default 8 // N, at least 1)")
    launch.add_argument("--bind", default="127.0.0.1", metavar="ADDR",
                        help="address the coordinator listens on (default 127.0.0.1: this machine only)")
    launch.add_argument("--grace", type=float, default=180.0, metavar="S",
                        help="seconds the other processes get to stop on their own after one fails (default 180)")
    launch.add_argument("--verbose", action="store_true",
                        help="show the libraries' own logging too (XLA's and gRPC's C++ log, Gloo's connection lines, "
                        "every process's messages as a process dies); by default they are left out and a message "
                        "several processes print alike is shown once")
    launch.add_argument("command_line", nargs=argparse.REMAINDER,
                        help="-- train RECIPE [train options], or -- export CHECKPOINT OUT [export options]")
    sub.add_parser("recipes", help="list the shipped recipes")
    from jaxpar import sample_command
    from jaxpar.data import tokenize_command
    from jaxpar.hf import command as export_command

    sample_command.add_parser(sub)
    export_command.add_parser(sub)
    tokenize_command.add_parser(sub)
    return p


# Commands whose module holds their arguments and their run(args) (each raises ConfigError).
COMMANDS = {"sample": "jaxpar.sample_command", "export": "jaxpar.hf.command", "tokenize": "jaxpar.data.tokenize_command"}


def resolve_config(recipe: str, overrides: list[str], num_devices: int):
    """The recipe with overrides applied. A recipe's mesh is the layout it was written for:
    naming any mesh.* axis replaces it (unnamed axes are 1, data fills with -1), and on a
    single device every layout collapses to the single-device run. The paths a checkpoint
    records for `sample` and `export` to read back are made absolute (RECORDED_PATHS)."""
    from jaxpar import recipes
    from jaxpar.config import with_overrides

    return with_absolute_paths(with_overrides(recipes.load(recipe), overrides, num_devices))


# Paths `jaxpar sample` and `jaxpar export` read from a run's checkpoint, from any folder.
RECORDED_PATHS = (("data", "tokenizer"), ("checkpoint", "init_from"))


def with_absolute_paths(config):
    """`config` with each of RECORDED_PATHS that is set made absolute, against the current folder."""
    import dataclasses
    import pathlib

    for section, field in RECORDED_PATHS:
        part = getattr(config, section)
        value = getattr(part, field)
        if value and not pathlib.Path(value).is_absolute():
            absolute = str(pathlib.Path(value).absolute())
            config = dataclasses.replace(config, **{section: dataclasses.replace(part, **{field: absolute})})
    return config


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    warnings.formatwarning = _one_line_warning
    if args.command == "recipes":
        from jaxpar import recipes

        print("\n".join(recipes.names()))
        print(f"(or {recipes.FORMS}, e.g. jaxpar train ./my_recipe.py or jaxpar train my_recipes.small:recipe)")
        return 0
    if args.command == "schedule":
        return schedule(args)
    try:
        if args.command == "launch":
            from jaxpar.launch import launch

            command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
            per_proc = max(1, 8 // max(1, args.nproc)) if args.cpu_devices_per_proc is None else args.cpu_devices_per_proc
            return launch(args.nproc, command, per_proc, args.bind, args.grace, args.verbose)
        if args.command == "plan":
            return plan(args)
        if args.command in COMMANDS:
            import importlib

            return importlib.import_module(COMMANDS[args.command]).run(args)
        return explain(args) if args.command == "explain" else train(args)
    except (ConfigError, TrainingStopped) as e:
        return report_error(e)


def _one_line_warning(message, category, filename, lineno, line=None, _python=warnings.formatwarning) -> str:
    """jaxpar's own warnings as one line; everyone else's as Python formats them."""
    if issubclass(category, JaxparWarning):
        return f"jaxpar: warning: {message}\n"
    return _python(message, category, filename, lineno, line)


def report_error(e: Exception) -> int:
    """Print the one-line message of an error jaxpar expects, and return the exit status."""
    if isinstance(e, ConfigError):
        print(f"jaxpar: error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, TrainingStopped):
        print(f"jaxpar: training stopped: {e}", file=sys.stderr)
        return 1
    import traceback

    traceback.print_exception(e)
    return 1


def train(args) -> int:
    """Alone, or one of several processes when the environment names a cluster
    (jaxpar.distributed): then every process runs this same function, and process 0 alone
    prints, shows progress and writes the metrics file."""
    if args.cpu_devices < 1:
        raise ConfigError(f"--cpu-devices={args.cpu_devices} must be at least 1")
    from jaxpar import distributed
    from jaxpar.mesh import force_cpu_devices

    force_cpu_devices(args.cpu_devices)  # only the CPU backend reads it; accelerators win if present
    return in_cluster(lambda: _train(args), lambda: _distributed_settings(args))


def in_cluster(body, settings) -> int:
    """body() alone, or, when the environment names a cluster (jaxpar.distributed), as one of
    its processes: joined first with `settings()` (a DistributedConfig, checked before it is
    used), watched by the heartbeat, and ended without JAX's shutdown barrier on an error
    (the other processes are not coming to it)."""
    from jaxpar import distributed

    cluster = distributed.from_environment()
    if cluster is None:
        return body()
    from jaxpar.launch import follow_launcher

    follow_launcher()  # started by `jaxpar launch`: stop when it dies
    config = settings()
    distributed.join(cluster, config.heartbeat_timeout_s, config.join_timeout_s)
    watchdog = distributed.Watchdog(config.heartbeat_timeout_s).start()
    try:
        code = body()
    except BaseException as e:
        watchdog.stop(f"{type(e).__name__}: {e}")
        code = report_error(e) if isinstance(e, Exception) else 130
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # not through JAX's shutdown barrier: the other processes are not coming to it
    watchdog.stop()
    return code


def _distributed_settings(args):
    from jaxpar import recipes

    return distributed_settings(recipes.load(args.recipe), args.overrides)


def distributed_settings(config, overrides: list[str]):
    """`config`'s distributed.* settings with the overrides that name them, checked."""
    from jaxpar.checks import by_id
    from jaxpar.config import apply_overrides

    config = apply_overrides(config, [o for o in overrides if o.startswith("distributed.")])
    by_id("distributed-timeouts-positive").check(config, None)
    return config.distributed


def _train(args) -> int:
    import jax

    from jaxpar.config import flatten
    from jaxpar.mesh import describe
    from jaxpar.train import build
    from jaxpar.train.loop import run

    devices = jax.devices()
    config = resolve_config(args.recipe, args.overrides, len(devices))
    leader = jax.process_index() == 0
    if args.print_config:
        if leader:
            print("\n".join(f"{key}={value}" for key, value in flatten(config).items()))
        return 0
    trainer = build(config, devices)  # validates before anything compiles
    from jaxpar.model import ATTENTION, supports

    model = config.model
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    matmul = trainer.layout.collective_matmul
    # Which attention an unsharded sequence runs (a sharded one runs parallel.context_impl).
    has_attention = supports(model, ATTENTION) and trainer.mesh.shape["context"] == 1
    if leader:
        print(
            f"{args.recipe}: {type(model).__name__} {model.param_count() / 1e6:.2f}M params | "
            f"mesh {describe(trainer.mesh)} on {len(devices)} {devices[0].platform} devices{processes} | "
            f"{'sequence parallel | ' if config.parallel.sequence_parallel else ''}"
            f"{f'collective matmul {matmul} | ' if matmul != 'none' else ''}"
            f"{f'pipeline {config.parallel.pipeline_schedule} | ' if trainer.pipeline is not None else ''}"
            f"{f'attention {trainer.layout.attention} | ' if has_attention else ''}"
            f"compute {config.train.compute_dtype}"
            f"{', fp8 matmuls' if config.train.matmul_dtype == 'fp8' else ''} | "
            f"batch {config.train.global_batch} x {config.train.microbatches} microbatches",
            flush=True,
        )
    try:
        history = run(trainer, metrics_file=args.metrics_file if leader else None, progress=leader and not args.no_progress,
                      tensorboard_dir=args.tensorboard if leader else None)
    except Preempted as e:  # every process stops at the same step: not a failure of one
        if leader:
            print(f"jaxpar: {e}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT
    if history and leader:
        first, last = history[0], history[-1]
        held_out = f", held-out loss {last['eval_loss']:.4f}" if "eval_loss" in last else ""
        print(f"loss {first['loss']:.4f} -> {last['loss']:.4f} over {len(history)} steps{held_out}")
    return 0


def explain(args) -> int:
    """Nothing runs and nothing is allocated: the step is lowered on abstract inputs."""
    from jaxpar.mesh import force_cpu_devices

    if args.devices is not None:
        if not 1 <= args.devices <= 512:
            raise ConfigError(f"--devices={args.devices}; use 1 to 512 virtual CPU devices")
        os.environ["JAX_PLATFORMS"] = "cpu"  # must precede JAX's backend start
    # Without --devices, 8 as `train` uses: only the CPU backend reads it; accelerators win.
    force_cpu_devices(8 if args.devices is None else args.devices)
    import json

    import jax

    from jaxpar.inspect import inspect_step
    from jaxpar.inspect.explain import explain as explain_step
    from jaxpar.inspect.explain import render
    from jaxpar.train import build

    if args.png:
        from jaxpar.train.metrics import prepare_file

        prepare_file(args.png, f"--png={args.png!r}", "schedule.png")
    devices = jax.devices()
    trainer = build(resolve_config(args.recipe, args.overrides, len(devices)), devices)
    if args.png and trainer.pipeline is None:
        raise ConfigError("--png draws the pipeline schedule, but mesh.stage=1; set mesh.stage>1")
    doc = explain_step(trainer, inspect_step(trainer))
    print(json.dumps(doc, indent=1) if args.json else render(doc))
    if args.png:
        from jaxpar.pipeline import build_schedule
        from jaxpar.pipeline.picture import save_png

        parallel, t = trainer.config.parallel, trainer.pipeline.timeline
        timeline = build_schedule(parallel.pipeline_schedule, t.p, t.m, t.v)
        title = f"{args.recipe}: {parallel.pipeline_schedule}, p={t.p}, m={t.m}, v={t.v}"
        print(f"wrote {save_png(timeline, args.png, title)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def plan(args) -> int:
    """Compiles on `--devices` virtual CPU devices: nothing runs, nothing is allocated."""
    from jaxpar.mesh import force_cpu_devices

    for flag, value in (("--devices", args.devices), ("--hbm-gb", args.hbm_gb), ("--compile-top", args.compile_top),
                        ("--hosts", args.hosts), ("--seq-len", args.seq_len), ("--global-batch", args.global_batch),
                        ("--compile-timeout", args.compile_timeout)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag}={value} must be positive")
    if args.devices > 4096:
        raise ConfigError(f"--devices={args.devices}; plan for at most 4096 devices")
    os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts its backends
    force_cpu_devices(args.devices)
    import dataclasses
    import json

    import jax

    from jaxpar.plan import plan as make_plan
    from jaxpar.plan import render, resolve_model

    model, recipe = resolve_model(args.model)
    seq_len = args.seq_len or (recipe.train.seq_len if recipe else 4096)
    hosts = args.hosts or max(1, args.devices // 8)
    from jaxpar.units import params

    planned, facts = make_plan(model, jax.devices(), args.hbm_gb, hosts, seq_len, args.global_batch or args.devices,
                               args.compile_top, progress=not args.json, compile_timeout_s=args.compile_timeout)
    if args.json:
        rows = [{"layout": p.layout.describe(), "overrides": p.overrides, "estimate": p.estimate, "memory": p.memory,
                 "prediction": p.prediction, "refused": p.refused, "failed": p.failed} for p in planned]
        print(json.dumps({**facts, "hardware": dataclasses.asdict(facts["hardware"]), "ranked": rows}, indent=1))
    else:
        print(f"{args.model}: {type(model).__name__} {params(model.param_count())} params | {args.devices} devices "
              f"on {hosts} hosts | batch {args.global_batch or args.devices} x seq {seq_len} | bf16")
        print(render(planned, facts, args.hbm_gb))
    return 0


def schedule(args) -> int:
    """The timeline a schedule gives, its bubble beside the published one, and the
    activations in flight on the first stage."""
    from jaxpar.pipeline import build_schedule, bubble_fraction, peak_in_flight, render
    from jaxpar.pipeline.schedule import published_bubble

    p, m, v = args.stages, args.microbatches, args.chunks
    try:
        if args.png:
            from jaxpar.train.metrics import prepare_file

            prepare_file(args.png, f"--png={args.png!r}", "schedule.png")
        timeline = build_schedule(args.name, p, m, v)
    except ValueError as e:
        print(f"jaxpar: error: {e}", file=sys.stderr)
        return 2
    print(render(timeline))
    print("forwards: microbatch digits; backwards: lower-case letters (a = 0); weight gradients: upper case; idle: .")
    print(f"bubble {bubble_fraction(timeline):.4f} (published {published_bubble(args.name, p, m, v):.4f}); "
          f"{peak_in_flight(timeline)} microbatch chunks of activations in flight on stage 0")
    if args.png:
        from jaxpar.pipeline.picture import save_png

        print(f"wrote {save_png(timeline, args.png, f'{args.name}: p={p}, m={m}, v={v}')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
