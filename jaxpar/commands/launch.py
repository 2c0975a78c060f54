"""`jaxpar launch --nproc N -- train RECIPE ...`: run `train` (or `export`, or `sample`) in several local
processes joined by jax.distributed (jaxpar.launch)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    launch = sub.add_parser("launch", help="run `train` (or `export`, or `sample`) in several local processes joined by jax.distributed")
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
                        help="-- train RECIPE [train options], -- export CHECKPOINT OUT [export options], or -- sample "
                             "CHECKPOINT [sample options]")


def run(args) -> int:
    from jaxpar.launch import launch

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    per_proc = max(1, 8 // max(1, args.nproc)) if args.cpu_devices_per_proc is None else args.cpu_devices_per_proc
    return launch(args.nproc, command, per_proc, args.bind, args.grace, args.verbose)
