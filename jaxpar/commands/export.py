"""`jaxpar export CHECKPOINT OUT`: a jaxpar checkpoint as a Hugging Face checkpoint (a LoRA
run's: `--merge`, the adapters folded in, or `--adapter`, the adapters alone in PEFT's format,
jaxpar.hf.peft).

The checkpoint's own config (jaxpar.loop.checkpoint.saved_config) builds the trainer, on
its saved mesh unless --set mesh.* names another; the chosen step (default the newest) is
restored onto it and exported (jaxpar.hf.export). config.json keeps the keys of the
checkpoint the run started from (checkpoint.init_from: token ids, context length) under the
model's own, with the run's data.eos_id as its end of text (jaxpar.hf.generation says where
generation stops), and the tokenizer's files (data.tokenizer, its chat template) are copied
beside the weights.
"""

from __future__ import annotations

import argparse
import pathlib

from jaxpar.commands.common import (add_cpu_devices, add_overrides, check_cpu_devices, distributed_settings, hf_checkpoint,
                                    in_cluster, recorded_file, recorded_in, restore)
from jaxpar.errors import ConfigError


def add_parser(subparsers) -> argparse.ArgumentParser:
    export = subparsers.add_parser("export", help="write a jaxpar checkpoint as a Hugging Face checkpoint")
    export.add_argument("checkpoint", help="a run's checkpoint.dir")
    export.add_argument("out", help="a new folder for config.json, the safetensors files and the tokenizer")
    export.add_argument("--step", type=int, help="the step to export (default: the newest)")
    export.add_argument("--dtype", default="float32", help="float32 (default: the weights as trained), bfloat16 or float16")
    export.add_argument("--max-shard-gb", type=float, default=5.0, metavar="G",
                        help="largest safetensors file in GB (default 5, as transformers writes)")
    lora = export.add_mutually_exclusive_group()
    lora.add_argument("--merge", action="store_true", help="a LoRA run: fold the adapters into the weights (a full "
                      "Hugging Face checkpoint)")
    lora.add_argument("--adapter", action="store_true", help="a LoRA run: the adapters alone, in PEFT's format "
                      "(adapter_config.json, adapter_model.safetensors)")
    add_overrides(export, "mesh.fsdp=8 to restore onto another layout")
    add_cpu_devices(export)
    return export


def run(args) -> int:
    from jaxpar.mesh import force_cpu_devices

    if args.max_shard_gb <= 0:
        raise ConfigError(f"--max-shard-gb={args.max_shard_gb} must be positive; e.g. 5")
    check_cpu_devices(args)
    folder = hf_checkpoint(args.checkpoint)
    if folder is not None:
        raise ConfigError(f"CHECKPOINT={args.checkpoint!r} is a Hugging Face checkpoint already (config.json and "
                          "safetensors files), not a jaxpar run's checkpoint.dir; fine-tune it with jaxpar train "
                          f"hf:{folder} --set checkpoint.dir=DIR ..., then export DIR")
    force_cpu_devices(args.cpu_devices)
    from jaxpar.hf.save import check_target

    check_target(args.out, "OUT")  # before anything is restored or gathered
    from jaxpar.config import Config

    # Alone, or one of several processes (jaxpar launch --nproc N -- export ...): every one
    # restores its shards and joins each gather, process 0 writes.
    return in_cluster(lambda: _export(args), lambda: distributed_settings(Config(), args.overrides))


def _export(args) -> int:
    import jax

    from jaxpar.config import with_overrides
    from jaxpar.hf import export
    from jaxpar.hf.format import format_of
    from jaxpar.hf.save import DTYPES
    from jaxpar.step.trainer import build
    from jaxpar.loop.checkpoint import saved_config

    if args.dtype not in DTYPES:
        raise ConfigError(f"--dtype={args.dtype}; export as one of {', '.join(DTYPES)}")
    config = with_overrides(saved_config(args.checkpoint, args.step), args.overrides, len(jax.devices()))
    if config.data.tokenizer:  # the file export copies, checked before anything is restored
        recorded_file(config.data.tokenizer, "data.tokenizer", recorded_in(args, "data.tokenizer"),
                      "--set data.tokenizer=PATH to the run's tokenizer.json")
    format_of(config.model).to_hf(config.model)  # what the format cannot hold is refused before anything is restored
    _check_lora_choice(args, config)
    trainer = build(config)
    state, step = restore(trainer, args.checkpoint, args.step)
    if args.adapter:
        from jaxpar.hf.save import export_adapter

        written = export_adapter(trainer, state, args.out, DTYPES[args.dtype], config.checkpoint.init_from)
        if jax.process_index() == 0:
            print(f"exported the LoRA adapters of step {step} of {args.checkpoint} to {args.out} in PEFT's format: "
                  f"{written.stat().st_size / 2**20:.2f} MiB {args.dtype}, rank {config.lora.rank}")
        return 0
    files = export(trainer, state, args.out, args.dtype, int(args.max_shard_gb * 1e9),
                   base_config=_base_config(config), tokenizer=config.data.tokenizer or None)
    if config.data.chat_template and jax.process_index() == 0:  # the run's own template, where transformers reads one
        from jaxpar.data.chat import TEMPLATE_FILE, find_template

        (pathlib.Path(args.out) / TEMPLATE_FILE).write_text(find_template(config.data.tokenizer,
                                                                          config.data.chat_template))
    if jax.process_index() == 0:
        size = sum(f.stat().st_size for f in files)
        print(f"exported step {step} of {args.checkpoint} to {args.out}: {len(files)} safetensors "
              f"file{'s' if len(files) > 1 else ''}, {size / 2**20:.1f} MiB {args.dtype}")
    return 0


def _check_lora_choice(args, config) -> None:
    """A LoRA run exports its adapters merged or alone, as asked; another has none."""
    if config.lora.rank and not (args.merge or args.adapter):
        raise ConfigError(f"{args.checkpoint!r} trained LoRA adapters (lora.rank={config.lora.rank}); export them "
                          "folded into the weights with --merge (a full Hugging Face checkpoint), or alone with "
                          "--adapter (PEFT's format)")
    if not config.lora.rank and (args.merge or args.adapter):
        raise ConfigError(f"--{'merge' if args.merge else 'adapter'}: {args.checkpoint!r} trained no LoRA adapters "
                          "(lora.rank=0); export it without the flag")


def _base_config(config) -> dict:
    """What config.json holds besides the model: the keys of the checkpoint the run started
    from (token ids, context length), with the run's end-of-text id (data.eos_id, what it
    trained with) over the checkpoint's."""
    import warnings

    from jaxpar.errors import JaxparWarning
    from jaxpar.hf.config import read_config

    base = {"eos_token_id": config.data.eos_id} if config.data.eos_id >= 0 else {}
    if not config.checkpoint.init_from:
        return base
    try:
        return {**read_config(pathlib.Path(config.checkpoint.init_from)), **base}
    except ConfigError as e:
        warnings.warn(f"the run started from {config.checkpoint.init_from!r}, whose config.json cannot be read now ({e}); "
                      "its keys besides the model's (token ids, context length) are not in the export's", JaxparWarning)
        return base
