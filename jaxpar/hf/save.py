"""Exporting a trainer's state as a Hugging Face checkpoint, from any layout.

Each tensor is gathered to the hosts one slab (one layer, one expert) at a time, every
process taking part; process 0 writes it straight into its file. The files, the index and
config.json go into a temporary folder renamed to the target when all is written, so an
export cut short leaves nothing half-written behind.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.errors import ConfigError
from jaxpar.hf.format import format_of
from jaxpar.hf.generation import GENERATION_FILE, generation_config
from jaxpar.hf.load import prepare_import
from jaxpar.hf.peft import CONFIG_FILE as ADAPTER_CONFIG
from jaxpar.hf.peft import WEIGHTS_FILE as ADAPTER_WEIGHTS
from jaxpar.hf.peft import adapter_config, adapter_weights
from jaxpar.hf.program import StepProgram
from jaxpar.hf.safetensors import (
    INDEX,
    NAMES,
    Planned,
    file_names,
    plan_files,
    write_file,
)
from jaxpar.hf.weights import Weight
from jaxpar.pipeline.split import StageSplit
from jaxpar.pipeline.stages import layers_mover
from jaxpar.sharding.adapters import join, merge_adapters
from jaxpar.sharding.annotate import Layout

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(jnp.bfloat16), "float16": np.dtype(np.float16)}
# Keys of a base config.json that the format's to_hf and the dtype replace (each of
# transformers' spellings, so no stale one wins over ours).
REWRITTEN = ("dtype", "torch_dtype", "rope_parameters", "rope_scaling", "rope_theta", "transformers_version")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def export(trainer: StepProgram, state: Any, folder: str | pathlib.Path, dtype: str = "float32", max_shard_bytes: int = 5 << 30,
           base_config: dict | None = None, tokenizer: str | None = None) -> list[pathlib.Path]:
    """Write `state`'s float32 weights (cast to `dtype`) into `folder` in Hugging Face's
    format: safetensors files of at most `max_shard_bytes`, an index when there are several,
    config.json (`base_config`'s keys, e.g. the imported checkpoint's token ids, under the
    model's own), and the tokenizer's files when `tokenizer` names a tokenizer.json."""
    model = trainer.config.model
    form = format_of(model)
    folder = pathlib.Path(folder)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r}; export as one of {', '.join(DTYPES)}")
    check_target(folder)
    kept = {k: v for k, v in (base_config or {}).items() if k not in REWRITTEN}
    hf_config = {**kept, **form.to_hf(model), "torch_dtype": dtype}
    generation = generation_config(trainer.config)  # where generation stops: the run's ids (jaxpar.hf.generation)
    tensors = planned_tensors(merged_master(trainer, state), form.weights(model), DTYPES[dtype], trainer.layout,
                              trainer.stage_split)
    files = plan_files(tensors, max_shard_bytes)
    names = file_names(len(files))

    def write(into: pathlib.Path | None) -> None:
        for name, group in zip(names, files):
            write_file(into / name if into else None, group, {"format": "pt"})
        if into:
            _write_extras(into, hf_config, names, files, tokenizer, generation)

    _into_new_folder(folder, write)
    return [folder / n for n in names]


def export_adapter(trainer: StepProgram, state: Any, folder: str | pathlib.Path, dtype: np.dtype, base: str = "") -> pathlib.Path:
    """Write the trainer's adapters (`state`'s float32 ones) into `folder` in PEFT's format;
    `base`: the base model's folder or name, for adapter_config.json."""
    lora, model = trainer.config.lora, trainer.config.model
    weights = format_of(model).weights(model)
    frozen = trainer.abstract_state().frozen
    shapes = {p: _leaf(frozen, p + ".base").shape for p in trainer.lora_targets}
    adapters = adapter_weights(weights, trainer.lora_targets, shapes, lora.rank)
    tensors = planned_tensors(trainer.master_params(state), adapters, dtype, trainer.layout, trainer.stage_split)
    config = adapter_config(lora, weights, trainer.lora_targets, base)

    def write(into: pathlib.Path | None) -> None:
        write_file(into / ADAPTER_WEIGHTS if into else None, tensors, {"format": "pt"})
        if into:
            (into / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    folder = pathlib.Path(folder)
    _into_new_folder(folder, write)
    return folder / ADAPTER_WEIGHTS


def _into_new_folder(folder: pathlib.Path, write: Callable[[pathlib.Path | None], None]) -> None:
    """`write(into)` fills `folder` whole or not at all: process 0 writes into FOLDER.partial,
    renamed when complete; the others call `write(None)` (making the values may be a
    collective every process joins)."""
    leader = jax.process_index() == 0
    partial = folder.with_name(folder.name + ".partial")
    if leader:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    try:
        write(partial if leader else None)
        if leader:
            if folder.exists():
                folder.rmdir()
            partial.rename(folder)
    finally:
        if leader:
            shutil.rmtree(partial, ignore_errors=True)


def _leaf(tree: dict, path: str) -> Any:
    for key in path.split("."):
        tree = tree[key]
    return tree


def check_target(folder: str | pathlib.Path, name: str = "folder") -> None:
    """`folder` can be exported into: new (its parents are made) or an empty folder, under a
    folder this process may write. `name` is how the message calls it (the CLI's OUT)."""
    folder = pathlib.Path(folder)
    shown = f"{name}={str(folder)!r}"
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{shown} is a file; give a new folder to export into (it will hold config.json, the "
                          "safetensors files and the tokenizer)")
    if folder.is_dir() and any(folder.iterdir()):
        raise ConfigError(f"{shown} is a folder that holds files already; give a new or empty folder to export into")
    above = next(p for p in folder.absolute().parents if p.exists())  # the first folder that is there
    if not above.is_dir():
        raise ConfigError(f"{shown}: {str(above)!r} is a file, so no folder can be made under it; give another path")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"{shown}: {str(above)!r} is not writable by this user; give a folder you can write")


def merged_master(trainer: StepProgram, state: Any) -> Any:
    """The float32 weights as the base model lays them out: with LoRA (jaxpar.step.lora),
    each adapter folded into its frozen weight where the shards rest. A run that started from
    a Hugging Face checkpoint folds them into its weights read again at their own precision
    (the state holds them in the compute dtype: a bf16 run's would round the base)."""
    if trainer.lora_targets is None:
        return trainer.master_params(state)
    weights = trainer.master_weights(state)
    if trainer.config.checkpoint.init_from:
        published = trainer.pipeline_order(prepare_import(trainer, trainer.config.checkpoint.init_from, True)())
        weights = join(published, trainer.master_params(state))
    scale = trainer.config.lora.alpha / trainer.config.lora.rank
    return jax.jit(lambda w: merge_adapters(w, scale))(weights)



def planned_tensors(master: Any, weights: dict[str, Weight], dtype: np.dtype, layout: Layout,
                    split: StageSplit | None) -> list[Planned]:
    """Every Hugging Face tensor of `weights`, each with a function gathering its slab of
    `master` (a tree of float32 weights as `layout` lays them out; `split`: its stages'
    layers) to the hosts."""
    move = layers_mover(jax.tree.map(lambda x: x.sharding, master), split, "model") if split else None
    master = move(master) if move else master  # the layers in model order, unpadded
    leaves = {".".join(str(k.key) for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(master)[0]}
    replicated = NamedSharding(layout.mesh, P())
    tensors = []
    for path, weight in weights.items():
        if weight.name is None:
            continue
        array = leaves[path]
        take = jax.jit(lambda a, i: a[i], out_shardings=replicated)  # one slab, on every device
        written = np.dtype(DTYPES[weight.export_dtype]) if weight.export_dtype else dtype
        for combo, name in weight.names(array.shape):
            slab_shape = array.shape[len(combo):]
            hf_shape = weight.hf_shape(slab_shape)

            def values(array=array, combo=combo, weight=weight, hf_shape=hf_shape, written=written) -> np.ndarray:
                slab = take(array, tuple(jnp.int32(i) for i in combo))  # () takes the whole array
                host = np.asarray(slab.addressable_shards[0].data)
                return weight.to_hf(host, hf_shape).astype(written)

            tensors.extend(Planned(n, written, hf_shape, values) for n in (name, *weight.copy_names(combo)))
    return sorted(tensors, key=_hf_order)


def _hf_order(t: Planned) -> tuple:
    """Embedding first, then layer by layer, then the final norm and head, as transformers saves."""
    parts = t.name.split(".")
    layer = next((int(p) for p in parts if p.isdigit()), -1)
    rank = 1 if layer >= 0 else (0 if "embed" in t.name else 2)
    return rank, layer, t.name


def _write_extras(folder: pathlib.Path, hf_config: dict, names: list[str], files: list[list[Planned]],
                  tokenizer: str | None, generation: dict) -> None:
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if generation:
        (folder / GENERATION_FILE).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for group in files for t in group)},
                 "weight_map": {t.name: n for n, group in zip(names, files) for t in group}}
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if tokenizer:
        source = pathlib.Path(tokenizer)
        shutil.copyfile(source, folder / "tokenizer.json")  # under the name transformers reads
        for name in TOKENIZER_FILES[1:]:
            if (source.parent / name).is_file():
                shutil.copyfile(source.parent / name, folder / name)


__all__ = ["DTYPES", "NAMES", "check_target", "export", "export_adapter"]
