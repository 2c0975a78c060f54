"""`jaxpar train RECIPE [--set key=value ...]`: train a recipe, alone or as one process of
several (jaxpar launch, SLURM). Device set-up comes first: JAX reads the CPU device count
once, when its backends start."""

from __future__ import annotations

import os
import sys

from jaxpar.commands.common import (INTERRUPTED_EXIT, PREEMPTED_EXIT, RECIPE_HELP, add_cpu_devices, add_overrides,
                                    check_cpu_devices, distributed_settings, in_cluster)
from jaxpar.errors import Preempted


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train a recipe")
    train.add_argument("recipe", help=RECIPE_HELP)
    add_overrides(train, "mesh.fsdp=2")
    add_cpu_devices(train)
    train.add_argument("--metrics-file", metavar="PATH", help="write one JSON object per step")
    train.add_argument("--tensorboard", metavar="DIR",
                       help="also write each step's metrics as TensorBoard scalars into DIR "
                       "(pip install 'jaxpar[tensorboard]')")
    train.add_argument("--wandb", metavar="PROJECT", help="also log each step's metrics to this Weights & Biases project "
                       "(pip install 'jaxpar[wandb]'; WANDB_MODE=offline keeps it local)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar: a plain line every "
                       "train.log_every steps instead (as when the output is not a terminal)")
    train.add_argument("--print-config", nargs="?", const="", metavar="PREFIX",
                       help="print every config key (or those under PREFIX, e.g. train) with its value, its choices "
                       "and what it means, and exit")
    train.add_argument("--as-toml", action="store_true", help="with --print-config: as a TOML file that --config reads "
                       "back")


def run(args) -> int:
    """Alone, or one of several processes when the environment names a cluster
    (jaxpar.distributed): then every process runs this same function, and process 0 alone
    prints, shows progress and writes the metrics file."""
    check_cpu_devices(args)
    from jaxpar.mesh import force_cpu_devices

    force_cpu_devices(args.cpu_devices)  # only the CPU backend reads it; accelerators win if present
    return in_cluster(lambda: _train(args), lambda: _distributed_settings(args))


def _distributed_settings(args):
    from jaxpar import recipes

    return distributed_settings(recipes.load(args.recipe), args.overrides)


def _train(args) -> int:
    import jax

    from jaxpar.mesh import describe
    from jaxpar.loop.metrics import writers_for
    from jaxpar.loop.run import run
    from jaxpar.recipes import resolve_config
    from jaxpar.step.trainer import build

    devices = jax.devices()
    config = resolve_config(args.recipe, args.overrides, len(devices))
    leader = jax.process_index() == 0
    if args.print_config is not None or args.as_toml:
        from jaxpar.config_text import listing, to_toml

        if leader:
            print(to_toml(config) if args.as_toml else listing(config, args.print_config or ""))
        return 0
    trainer = build(config, devices)  # validates before anything compiles
    from jaxpar.model import ATTENTION, supports

    model = config.model
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    matmul = trainer.layout.projections.collective
    # Which attention an unsharded sequence runs (a sharded one runs parallel.context.impl).
    has_attention = supports(model, ATTENTION) and trainer.mesh.shape["context"] == 1
    if leader:
        print(
            f"{args.recipe}: {type(model).__name__} {model.param_count() / 1e6:.2f}M params | "
            f"mesh {describe(trainer.mesh)} on {len(devices)} {devices[0].platform} devices{processes} | "
            f"{_strategies_summary(trainer)}"
            f"{f'collective matmul {matmul} | ' if matmul != 'none' else ''}"
            f"{f'pipeline {trainer.layout.pipeline.schedule} | ' if trainer.pipeline is not None else ''}"
            f"{_diloco_summary(trainer)}"
            f"{f'attention {trainer.layout.attention} | ' if has_attention else ''}"
            f"{_repeats_summary(trainer.layout.params.repeats)}"
            f"{_lora_summary(trainer)}"
            f"compute {config.train.compute_dtype}"
            f"{', fp8 matmuls' if config.train.matmul_dtype == 'fp8' else ''} | "
            f"batch {config.train.global_batch} x {trainer.layout.microbatches} microbatches",
            flush=True,
        )
    try:
        # progress None: the loop shows a bar on a terminal, plain lines in a file (SLURM, nohup)
        writers = writers_for(args.metrics_file, args.tensorboard, args.wandb) if leader else []
        history = run(trainer, progress=None if leader and not args.no_progress else False, writers=writers)
    except Preempted as e:  # every process stops at the same step: not a failure of one
        if leader:
            print(f"jaxpar: {e}", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT if e.signal == "SIGINT" else PREEMPTED_EXIT
    except KeyboardInterrupt as e:  # Ctrl-C before the first step, or a second one: no save
        from jaxpar.loop.stop import Interrupted

        said = str(e) if isinstance(e, Interrupted) else "interrupted; nothing saved since the last checkpoint"
        print(f"jaxpar: {said}", file=sys.stderr, flush=True)
        if isinstance(e, Interrupted) and e.abandoned is not None:
            # Out now: an ordinary exit would wait for orbax's writing thread, finishing the
            # save the line says was abandoned.
            sys.stdout.flush()
            os._exit(INTERRUPTED_EXIT)
        return INTERRUPTED_EXIT
    if history and leader:
        first, last = history[0], history[-1]
        held_out = f", held-out loss {last['eval_loss']:.4f}" if "eval_loss" in last else ""
        print(f"loss {first['loss']:.4f} -> {last['loss']:.4f} over {len(history)} steps{held_out}")
    return 0


def _strategies_summary(trainer) -> str:
    """What the layout does that its mesh does not show: ZeRO's stage and offloads, sequence
    parallelism (where mesh.tensor splits), context parallelism's kernel, remat."""
    from jaxpar.model import declared

    layout, shape, zero = trainer.layout, trainer.mesh.shape, trainer.layout.zero
    remat = declared(trainer.config.model, "remat")
    offloaded = [what for what, on in (("optimizer", zero.offload_optimizer), ("params", zero.offload_params)) if on]
    parts = [f"zero-{zero.stage}" if zero.stage else "",
             f"offload {' + '.join(offloaded)}" if offloaded else "",
             "sequence parallel" if layout.tensor.sequence_parallel and shape["tensor"] > 1 else "",
             f"context {trainer.config.parallel.context.impl}" if shape["context"] > 1 else "",
             f"remat {remat}" if remat != "none" else ""]
    return "".join(f"{part} | " for part in parts if part)


def _repeats_summary(repeats: tuple[tuple[str, int], ...]) -> str:
    """Key/value heads fewer than mesh.tensor: how many times each is repeated at use."""
    return f"kv heads repeated {repeats[0][1]}x over tensor | " if repeats else ""


def _diloco_summary(trainer) -> str:
    """DiLoCo's groups and their synchronisation, for the start line (jaxpar.step.diloco)."""
    d = trainer.layout.diloco
    if not d.inner_steps:
        return ""
    fragments = f" in {d.fragments} fragments, one every {d.inner_steps // d.fragments}" if d.fragments > 1 else ""
    return (f"DiLoCo: {trainer.mesh.shape['data']} groups, synchronised every {d.inner_steps} steps{fragments}"
            f"{', beside a step' if d.delay else ''}{', int8' if d.compression != 'none' else ''} | ")


def _lora_summary(trainer) -> str:
    """'lora rank 8 on 7 weights: 49,152 trained (5.7%) | ', or nothing without adapters."""
    if trainer.lora_targets is None:
        return ""
    import math

    import jax

    state = trainer.abstract_state()
    trained, frozen = (sum(math.prod(x.shape) for x in jax.tree.leaves(t)) for t in (state.params, state.frozen))
    return (f"lora rank {trainer.config.lora.rank} on {len(trainer.lora_targets)} weights: {trained:,} trained "
            f"({trained / (trained + frozen):.1%}) | ")
