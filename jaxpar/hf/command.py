"""`jaxpar export CHECKPOINT OUT`: a jaxpar checkpoint as a Hugging Face checkpoint.

The checkpoint's own config (jaxpar.train.checkpoint.saved_config) builds the trainer, on
its saved mesh unless --set mesh.* names another; the chosen step (default the newest) is
restored onto it and exported (jaxpar.hf.export). config.json keeps the keys of the
checkpoint the run started from (checkpoint.init_from: token ids, context length) under the
model's own, and the tokenizer's files (data.tokenizer) are copied beside the weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib


def add_parser(subparsers) -> argparse.ArgumentParser:
    export = subparsers.add_parser("export", help="write a jaxpar checkpoint as a Hugging Face checkpoint")
    export.add_argument("checkpoint", help="a run's checkpoint.dir")
    export.add_argument("out", help="a new folder for config.json, the safetensors files and the tokenizer")
    export.add_argument("--step", type=int, help="the step to export (default: the newest)")
    export.add_argument("--dtype", default="float32", help="float32 (default: the weights as trained), bfloat16 or float16")
    export.add_argument("--max-shard-gb", type=float, default=5.0, metavar="G",
                        help="largest safetensors file in GB (default 5, as transformers writes)")
    export.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a saved config field, e.g. --set mesh.fsdp=8 to restore onto another layout")
    export.add_argument("--cpu-devices", type=int, default=8, metavar="N",
                        help="virtual CPU devices when no accelerator is present (default 8)")
    return export


def run(args) -> int:
    from jaxpar.errors import ConfigError
    from jaxpar.mesh import force_cpu_devices

    if args.max_shard_gb <= 0:
        raise ConfigError(f"--max-shard-gb={args.max_shard_gb} must be positive; e.g. 5")
    force_cpu_devices(args.cpu_devices)
    import jax

    from jaxpar.hf import export
    from jaxpar.train import build
    from jaxpar.train.checkpoint import Checkpoints

    config = saved_layout(args.checkpoint, args.step, args.overrides, len(jax.devices()))
    trainer = build(config)
    checkpoints = Checkpoints.open(args.checkpoint, async_save=False)
    try:
        state, step = checkpoints.restore(trainer, args.step)
    finally:
        checkpoints.close()
    files = export(trainer, state, args.out, args.dtype, int(args.max_shard_gb * 1e9),
                   base_config=_imported_config(config), tokenizer=config.data.tokenizer or None)
    if jax.process_index() == 0:
        size = sum(f.stat().st_size for f in files)
        print(f"exported step {step} of {args.checkpoint} to {args.out}: {len(files)} safetensors "
              f"file{'s' if len(files) > 1 else ''}, {size / 2**20:.1f} MiB {args.dtype}")
    return 0


def saved_layout(directory: str, step: int | None, overrides: list[str], num_devices: int):
    """The checkpoint's config with `overrides`; naming a mesh.* axis replaces the saved mesh
    (as `jaxpar train` treats a recipe's), as does a single device."""
    from jaxpar.config import apply_overrides
    from jaxpar.mesh import MeshConfig
    from jaxpar.train.checkpoint import saved_config

    config = saved_config(directory, step)
    if num_devices == 1 or any(o.startswith("mesh.") for o in overrides):
        config = dataclasses.replace(config, mesh=MeshConfig(hosts=config.mesh.hosts))
    return apply_overrides(config, overrides)


def _imported_config(config) -> dict | None:
    """The config.json of the checkpoint the run started from, if it is still there."""
    source = pathlib.Path(config.checkpoint.init_from) / "config.json" if config.checkpoint.init_from else None
    return json.loads(source.read_text()) if source is not None and source.is_file() else None
