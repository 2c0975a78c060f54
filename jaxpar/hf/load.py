"""Importing a Hugging Face checkpoint into a trainer's sharded state.

Everything is checked before any weight is read: the architecture, every field of the
model config against config.json, every tensor the model needs (present, of the right
shape, no shard file missing) and none left over. Then each parameter is made with
`jax.make_array_from_callback`: every device's shard is read from the memory-mapped
tensors, so each process reads only the slices its own devices hold and no process holds
the whole checkpoint. The state is laid out for the trainer's layout, pipeline stages
included (the layers put in pipeline order on the devices, as a fresh state would be).
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any, Callable, Mapping

import jax
import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.families import View, hf_formats
from jaxpar.hf.config import architecture, check_same_model, read_config
from jaxpar.hf.format import format_of
from jaxpar.hf.peft import adapter_settings, adapter_weights
from jaxpar.hf.program import StepProgram
from jaxpar.hf.safetensors import Entry, tensor_index
from jaxpar.hf.weights import Weight, read_slice
from jaxpar.model import model_name
from jaxpar.sharding.adapters import initial_adapter

# The formats jaxpar reads, by architecture: the registered model families' (jaxpar.families).
ARCHITECTURES = View(hf_formats)
ALWAYS_IGNORED = ("rotary_emb.inv_freq",)  # buffers older exporters saved; recomputed


def model_config(folder: str | pathlib.Path) -> Any:
    """The jaxpar model config of the checkpoint in `folder` (from its config.json)."""
    folder = pathlib.Path(folder)
    hf = read_config(folder)
    name = architecture(hf, folder)
    if name not in ARCHITECTURES:
        raise ConfigError(f"{str(folder)!r} holds a {name}; jaxpar reads {', '.join(ARCHITECTURES)} "
                          "(jaxpar.families.register adds a model family of one's own, with its format)")
    return ARCHITECTURES[name].from_hf(hf)


def prepare_import(trainer: StepProgram, folder: str | pathlib.Path, weights_only: bool = False) -> Callable[[], Any]:
    """Check the checkpoint in `folder` against `trainer`'s model (reading only config.json
    and the safetensors headers) and return () -> the TrainState at step 0 with its weights.
    `weights_only`: () -> the float32 weights in model order instead, LoRA's frozen ones at
    the checkpoint's precision and its adapters zero (what a merged export folds into)."""
    folder = pathlib.Path(folder)
    model = trainer.config.model
    form = format_of(model)
    hf = read_config(folder, "checkpoint.init_from")
    name = architecture(hf, folder)
    if name not in form.architectures:
        raise ConfigError(f"checkpoint.init_from={str(folder)!r} holds a {name}, but this run's model "
                          f"{model_name(model)} reads {', '.join(form.architectures)}; train the recipe hf:{folder}, "
                          "whose model is the checkpoint's")
    check_same_model(model, form.from_hf(hf), folder, form.training_fields)
    entries = renamed(tensor_index(folder), form.renames)
    weights = form.weights(model)
    abstract_state = trainer.model_order_state()  # the weights read in model order
    leaves, treedef = jax.tree_util.tree_flatten_with_path(trainer.master_weights(abstract_state))
    shapes = {_path(p): leaf.shape for p, leaf in leaves}
    weights, adapters = adapted(weights, shapes)
    fresh = check_tensors(shapes, weights, entries, folder, tuple(form.ignored(model)))
    lora, targets = trainer.config.lora, trainer.lora_targets
    if lora.init_from:  # the adapters read from a PEFT folder, not drawn
        given, adapter_entries = read_adapter(lora.init_from, lora.rank, lora.alpha, targets, weights,
                                              {p: shapes[p + ".base"] for p in targets})
        weights, entries, adapters = {**weights, **given}, {**entries, **adapter_entries}, set()
    shardings = [leaf.sharding for _, leaf in leaves]
    if fresh and jax.process_index() == 0:
        parts = sorted({p.split(".")[0] for p in fresh})
        print(f"{str(folder)!r} holds none of {', '.join(parts)} ({len(fresh)} parameters): they start from the model's "
              "own initialisation", flush=True)

    def draw() -> Any:  # a fresh run's float32 weights, in model order
        return trainer.model_order(trainer.master_weights(trainer.init()))

    def start() -> Any:
        drawn = {**_drawn(draw, fresh),
                 **({} if weights_only else _drawn_adapters(targets, lora.rank, trainer.config.train.seed, adapters, shapes))}
        arrays = [
            jax.device_put(drawn[path], sharding) if path in drawn else
            jax.make_array_from_callback(shapes[path], sharding, _reader(weights[path], entries, shapes[path]))
            for path, sharding in zip(shapes, shardings)  # an adapter's Weight(None) reads zeros
        ]
        tree = jax.tree.unflatten(treedef, arrays)
        return tree if weights_only else trainer.start_from(tree)

    return start


def renamed(entries: dict[str, Entry], renames: Mapping[str, str]) -> dict[str, Entry]:
    """The checkpoint's tensors under the names the format's `weights` uses: each name
    starting with a key of `renames` has that prefix replaced by its value."""
    def name(n: str) -> str:
        old = next((p for p in renames if n.startswith(p)), None)
        return n if old is None else renames[old] + n[len(old):]

    return {name(n): e for n, e in entries.items()}


def adapted(weights: dict[str, Weight], shapes: dict[str, tuple]) -> tuple[dict[str, Weight], set[str]]:
    """(The format's weights for a model whose weights may carry LoRA adapters (jaxpar.step.lora):
    a frozen `path.base` reads the checkpoint's tensor for `path`; the paths of the adapters,
    which no checkpoint of the base model holds and which start as drawn)."""
    weights, adapters = dict(weights), set()
    for path in shapes:
        owner, _, leaf = path.rpartition(".")
        if leaf == "base" and owner in weights:
            weights[path] = weights[owner]
        elif leaf == "base_scale" and owner in weights:  # FP8's scales: set from the base when it is quantized
            weights[path] = Weight(None)
        elif leaf in ("lora_a", "lora_b") and owner in weights:
            weights[path] = Weight(None)  # drawn, not read
            adapters.add(path)
    return weights, adapters


def _drawn_adapters(targets: Mapping[str, Any], rank: int, seed: int, paths: set[str], shapes: dict[str, tuple]
                    ) -> dict[str, Any]:
    """LoRA's adapters at `paths` as the model's build draws them from `seed` (A drawn, B
    zero), without drawing the rest of the model. `targets`: {weight path: its
    jaxpar.step.lora.Target}."""
    if not paths:
        return {}
    order = sorted(targets)
    out = {}
    for path in paths:
        owner, _, leaf = path.rpartition(".")
        t = targets[owner]
        a, b = initial_adapter(order.index(owner), t.lead, t.inputs, shapes[owner + ".base"], rank, seed)
        out[path] = np.asarray(b if leaf == "lora_b" else a)
    return out


def _drawn(draw: Callable[[], Any], paths: set[str]) -> dict[str, Any]:
    """The parameters at `paths` as `draw` makes them (() -> a fresh run's float32 weights in
    model order), in one program that returns only these, so the compiler drops the other
    parameters' draws (DeepSeek's missing prediction module: a quarter of init's compile)."""
    if not paths:
        return {}

    def kept():
        return {p: leaf for p, leaf in ((_path(k), v) for k, v in jax.tree_util.tree_flatten_with_path(draw())[0])
                if p in paths}

    return jax.jit(kept)()


def _reader(weight: Weight, entries: dict[str, Entry], shape: tuple[int, ...]):
    """index -> that shard, each distinct index read once (replicas share it)."""
    return functools.lru_cache(maxsize=None)(lambda index: read_slice(weight, entries, shape, index))


def check_tensors(shapes: dict[str, tuple[int, ...]], weights: dict[str, Weight], entries: dict[str, Entry],
                  folder: pathlib.Path, ignored: tuple[str, ...]) -> set[str]:
    """Every tensor the model needs is there in the right shape, and none is left over (a
    Weight's `copies` are accepted where present, not read); returns the parameters left to
    their initialisation (`Weight.fresh`, absent)."""
    unmapped = [p for p in shapes if p not in weights]
    if unmapped:
        raise ConfigError(f"the model's Hugging Face format (its weights) maps no tensor to {', '.join(unmapped)}; "
                          "give each parameter a jaxpar.hf.Weight (Weight(None) for one Hugging Face has not)")
    used, fresh = set(), set()
    for path, shape in shapes.items():
        weight = weights[path]
        names = [name for _, name in weight.names(shape)] if weight.name else []
        if weight.fresh and names and not any(n in entries for n in names):
            fresh.add(path)
            continue
        want = weight.hf_shape(shape[len(weight.stacked):]) if weight.name else ()
        for combo, name in weight.names(shape) if weight.name else []:
            if name not in entries:
                raise ConfigError(f"{str(folder)!r} has no tensor {name!r} (the model's {path}); the checkpoint is "
                                  "incomplete or of another model")
            for held in (name, *(c for c in weight.copy_names(combo) if c in entries)):
                if entries[held].shape != tuple(want):
                    raise ConfigError(f"{str(folder)!r}: tensor {held!r} has shape {entries[held].shape}, but the "
                                      f"model's {path} takes one of {tuple(want)}; the checkpoint is of another shape "
                                      "than its config.json says")
                used.add(held)
    prefixes = tuple(n for n in ignored if n.endswith("."))  # "model.layers.3.": all of that layer's
    left = [n for n in entries if n not in used and n not in ignored and not n.startswith(prefixes)
            and not n.endswith(ALWAYS_IGNORED)]
    if left:
        raise ConfigError(f"{str(folder)!r} holds {len(left)} tensors the model has no place for "
                          f"({', '.join(sorted(left)[:3])}{', ...' if len(left) > 3 else ''}); it is of another architecture "
                          "than its config.json says, or the model's Hugging Face format (its weights) is incomplete")
    return fresh


def _path(keys) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in keys)


def read_adapter(folder: str | pathlib.Path, rank: int, alpha: float, targets: Mapping[str, Any],
                 weights: dict[str, Weight], base_shapes: dict[str, tuple]) -> tuple[dict, dict]:
    """(Weights of our adapter paths, the adapter folder's tensors) for lora.init_from=`folder`:
    its rank and alpha checked against lora.rank and lora.alpha (`rank`, `alpha`), and every
    tensor there in the shape ours takes for `targets` ({weight path: its
    jaxpar.step.lora.Target}), none left over (jaxpar.hf.load.check_tensors)."""
    folder = pathlib.Path(folder)
    settings = adapter_settings(folder)
    for key, ours, theirs in (("rank", rank, settings.get("r")), ("alpha", alpha, settings.get("lora_alpha"))):
        if theirs is None or float(theirs) != float(ours):
            raise ConfigError(f"lora.init_from={str(folder)!r} was trained with {'r' if key == 'rank' else 'lora_alpha'}="
                              f"{theirs}, but this run has lora.{key}={ours}; set lora.{key}={theirs}")
    adapters = adapter_weights(weights, targets, base_shapes, rank)
    entries = tensor_index(folder)
    shapes = {}
    for path, t in targets.items():
        shape, cut = base_shapes[path], t.lead + t.inputs
        shapes[path + ".lora_a"] = (*shape[:cut], rank)
        shapes[path + ".lora_b"] = (*shape[:t.lead], rank, *shape[cut:])
    check_tensors(shapes, adapters, entries, folder, ())
    return adapters, entries
