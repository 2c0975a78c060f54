"""`jaxpar plan --model NAME --devices N --hbm-gb G`: rank layouts for a cluster we do not
have (jaxpar.plan)."""

from __future__ import annotations

import os
import sys

from jaxpar.errors import ConfigError


def add_parser(sub) -> None:
    plan = sub.add_parser("plan", help="rank layouts for a cluster by compiled memory and a roofline step time")
    plan.add_argument("--model", required=True, metavar="NAME",
                      help="a model preset (`jaxpar recipes` lists them: llama3-8b, mixtral-8x7b, deepseek-v3, ...), "
                      "or a recipe as `train` takes it: a shipped name, a path to a .py file, or package.module[:function]")
    plan.add_argument("--devices", type=int, required=True, metavar="N", help="GPUs in the cluster (compiled for as CPU devices)")
    plan.add_argument("--hbm-gb", type=float, required=True, metavar="G", help="memory per GPU in GiB, e.g. 80")
    plan.add_argument("--hosts", type=int, metavar="H", help="hosts (default: N / 8, 8 GPUs per host)")
    plan.add_argument("--seq-len", type=int, metavar="S", help="tokens per sequence (default: the recipe's, else 4096)")
    plan.add_argument("--global-batch", type=int, metavar="B", help="sequences per step (default: N)")
    plan.add_argument("--compile-top", type=int, default=4, metavar="K", help="compile K layouts: the fastest estimate of each remat policy, then the fastest "
                      "(default 4)")
    plan.add_argument("--compile-timeout", type=float, default=600.0, metavar="S",
                      help="seconds each layout's compile may take before it is stopped and marked failed (default 600)")
    plan.add_argument("--target", metavar="FILE",
                      help="compile for the GPUs this GpuTargetConfig describes (benchmarks/targets/h100.pbtxt), "
                      "without them (pip install 'jax[cuda13]'), and rank by their kernels' predicted time "
                      "(jaxpar.inspect.cost) instead of the roofline")
    plan.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                      help="the optimizer priced and compiled: adamw (default) or muon (docs/muon.md)")
    plan.add_argument("--groups", type=int, default=1, metavar="G",
                      help="the hosts are G groups (clusters, datacenters) joined by a slower link: mesh.data spans "
                      "them, one replica each, every other axis inside a group")
    plan.add_argument("--group-link-gbit", type=float, metavar="X",
                      help="with --groups: Gb/s per GPU between the groups (default: the hosts' network)")
    plan.add_argument("--diloco", type=int, default=0, metavar="H",
                      help="with --groups: also consider DiLoCo between them, synchronising every H steps "
                      "(docs/diloco.md)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of the table")


def run(args) -> int:
    """Compiles on `--devices` virtual CPU devices: nothing runs, nothing is allocated."""
    from jaxpar.mesh import force_cpu_devices

    for flag, value in (("--devices", args.devices), ("--hbm-gb", args.hbm_gb), ("--compile-top", args.compile_top),
                        ("--hosts", args.hosts), ("--seq-len", args.seq_len), ("--global-batch", args.global_batch),
                        ("--compile-timeout", args.compile_timeout), ("--group-link-gbit", args.group_link_gbit),
                        ("--groups", args.groups)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag}={value} must be positive")
    if args.diloco < 0:
        raise ConfigError(f"--diloco={args.diloco}; use the inner steps between synchronisations, e.g. 100 (0: none)")
    if args.groups == 1 and (args.diloco or args.group_link_gbit):
        raise ConfigError("--diloco and --group-link-gbit price the link between groups of hosts; give --groups G "
                          "(e.g. --groups 2) as well")
    if args.devices > 4096:
        raise ConfigError(f"--devices={args.devices}; plan for at most 4096 devices")
    os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts its backends
    hosts = args.hosts or max(1, args.devices // 8)
    if args.target:
        from jaxpar.deviceless import gpu_devices
        from jaxpar.plan.compile_one import TARGET_ENV, TOPOLOGY_ENV

        if args.devices % hosts:
            raise ConfigError(f"--hosts={hosts} does not divide --devices={args.devices}; use a divisor of it")
        topology = f"1x{hosts}x{args.devices // hosts}"
        devices = gpu_devices(args.target, topology)
        os.environ[TARGET_ENV], os.environ[TOPOLOGY_ENV] = args.target, topology  # for the compiling children
    else:
        force_cpu_devices(args.devices)
    import dataclasses
    import json

    import jax

    from jaxpar.plan import Hardware
    from jaxpar.plan import plan as make_plan
    from jaxpar.plan import render, resolve_model

    model, recipe = resolve_model(args.model)
    seq_len = args.seq_len or (recipe.train.seq_len if recipe else 4096)
    from jaxpar.units import params

    bar = not args.json and sys.stderr.isatty()  # a bar redraws with carriage returns: a terminal's alone
    if not args.json and not bar:
        print(f"compiling the {args.compile_top} fastest estimates of {args.model}'s layouts, each remat policy's "
              f"fastest first (up to "
              f"{3 * args.compile_top} until one fits), each in a process of its own for at most "
              f"{args.compile_timeout:g} s", file=sys.stderr, flush=True)
    planned, facts = make_plan(model, devices if args.target else jax.devices(), args.hbm_gb, hosts, seq_len, args.global_batch or args.devices,
                               args.compile_top, progress=bar, compile_timeout_s=args.compile_timeout,
                               optimizer=args.optimizer, groups=args.groups, diloco=args.diloco,
                               hw=Hardware(group_link_gb_per_s=(args.group_link_gbit or 0.0) / 8))
    if args.json:
        rows = [{"layout": p.layout.describe(), "overrides": p.overrides, "estimate": p.estimate, "memory": p.memory,
                 "prediction": p.prediction, "refused": p.refused, "failed": p.failed} for p in planned]
        print(json.dumps({**facts, "hardware": dataclasses.asdict(facts["hardware"]), "ranked": rows}, indent=1))
    else:
        print(f"{args.model}: {type(model).__name__} {params(model.param_count())} params | {args.devices} devices "
              f"on {hosts} hosts | batch {args.global_batch or args.devices} x seq {seq_len} | bf16")
        batch = args.global_batch or args.devices  # what the layouts were compiled for
        command = f"jaxpar train {args.model} --set train.global_batch={batch} --set train.seq_len={seq_len}"
        print(render(planned, facts, args.hbm_gb, command))
    return 0
