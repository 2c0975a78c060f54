"""LoRA adapters in PEFT's format (what `peft.PeftModel.from_pretrained` loads): a folder with
adapter_config.json and adapter_model.safetensors, whose tensors are named after the base
checkpoint's Linear layers:

  base_model.model.<module>.lora_A.weight   [r, in]     ours: A [*in, r]
  base_model.model.<module>.lora_B.weight   [out, r]    ours: B [r, *out]

for each adapted weight <module>.weight of the base (its format's `weights` entry), one tensor
per layer, and W + (lora_alpha / r) * B @ A in Hugging Face's [out, in] layout. An adapter
reads and writes through the same `Weight` machinery as the base: a view and an axis order
per tensor (jaxpar.hf.weights).

  adapter_weights(...)   {our adapter path: Weight} for a trainer's LoRA targets
  adapter_config(...)    adapter_config.json's settings for a run's adapters
  adapter_settings(dir)  a PEFT folder's adapter_config.json, checked

Reading one is jaxpar.hf.load.read_adapter (lora.init_from); writing one,
jaxpar.hf.save.export_adapter (`jaxpar export --adapter`).
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.hf.weights import Weight

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


def adapter_weights(weights: dict[str, Weight], targets: dict[str, Any], shapes: dict[str, tuple], rank: int
                    ) -> dict[str, Weight]:
    """{'<path>.lora_a' and '<path>.lora_b': Weight} for each LoRA target `path` (whose
    Target gives the stacked and input dimensions; `shapes`: the base weights' shapes)."""
    out = {}
    for path, target in targets.items():
        base = weights.get(path)
        if base is None or base.name is None or not base.name.endswith(".weight"):
            raise ConfigError(f"lora: {path} has no Linear weight in the model's Hugging Face format (its weights "
                              f"give {base.name if base else None!r}); PEFT's format names adapters after one")
        shape = shapes[path]
        cut = target.lead + target.inputs
        inputs, outputs = shape[target.lead:cut], shape[cut:]
        _check_separable(path, base, shape[target.lead:], len(inputs))
        module = PREFIX + base.name[: -len(".weight")]
        n_in, n_out = len(inputs), len(outputs)
        out[path + ".lora_a"] = Weight(module + ".lora_A.weight", (rank, *inputs), (*range(1, n_in + 1), 0),
                                       (rank, math.prod(inputs)), layer_ids=base.layer_ids)
        out[path + ".lora_b"] = Weight(module + ".lora_B.weight", (*outputs, rank), (n_out, *range(n_out)),
                                       (math.prod(outputs), rank), layer_ids=base.layer_ids)
    return out


def _check_separable(path: str, weight: Weight, slab: tuple[int, ...], inputs: int) -> None:
    """Our slab [*in, *out] must be Hugging Face's [out, in] transposed, each side flattened
    in our order: then A and B convert on their own. Checked on a slab of distinct values."""
    probe = np.arange(math.prod(slab)).reshape(slab)
    theirs = weight.to_hf(probe, weight.hf_shape(slab))
    n_in = math.prod(slab[:inputs])
    if theirs.shape != (probe.size // n_in, n_in) or not (theirs == probe.reshape(n_in, -1).T).all():
        raise ConfigError(f"lora: {path} lies in its Hugging Face tensor {weight.name} in another order than "
                          "[out, in] of ours: PEFT's A and B cannot be written for it; leave it out of lora.targets")


def module_names(weights: dict[str, Weight], targets: dict[str, Any]) -> list[str]:
    """PEFT's target_modules: the adapted Linear layers' own names (q_proj, v_proj, ...),
    but those named as routed experts (`parameter_names`)."""
    remapped = expert_names(weights)
    return sorted({n for n in (weights[p].name.split(".")[-2] for p in targets) if n not in remapped})


def parameter_names(weights: dict[str, Weight], targets: dict[str, Any]) -> list[str]:
    """PEFT's target_parameters: the adapted Linear layers named as a routed expert's
    projections (gate_proj, up_proj, down_proj in DeepSeek-V3's and Qwen3-MoE's formats: the
    shared experts, the dense layers' MLPs), each as '<parent>.<name>.weight'. peft (0.18 on)
    loading onto transformers 5, which fuses the routed experts into one parameter a layer,
    maps those names in target_modules to the fused experts' parameters, so the Linears
    themselves would get no adapter; a parameter target wraps the Linear's weight itself,
    with the same tensors (W + alpha / r x B @ A)."""
    remapped = expert_names(weights)
    names = (weights[p].name.split(".") for p in targets)
    return sorted({".".join(parts[-3:]) for parts in names if parts[-2] in remapped})


def expert_names(weights: dict[str, Weight]) -> set[str]:
    """The module names of the format's routed experts' projections (their tensors' names
    hold an {expert}): those transformers 5 fuses."""
    return {w.name.split(".")[-2] for w in weights.values() if w.name and "{expert}" in w.name}


def adapter_config(lora: Any, weights: dict[str, Weight], targets: dict[str, Any], base: str) -> dict:
    """adapter_config.json for adapters of rank lora.rank and scale lora.alpha / lora.rank on
    `targets`; `base`: the base model's folder or name."""
    parameters = parameter_names(weights, targets)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0,
        "target_modules": module_names(weights, targets), **({"target_parameters": parameters} if parameters else {}),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
        "modules_to_save": None, "base_model_name_or_path": base, "init_lora_weights": True,
    }


def adapter_settings(folder: str | pathlib.Path, field: str = "lora.init_from") -> dict:
    """A PEFT folder's adapter_config.json, checked: a plain LoRA (no DoRA, rsLoRA, biases or
    saved modules) with its weights file beside it."""
    folder = pathlib.Path(folder)
    config_file = folder / CONFIG_FILE
    if not config_file.is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ConfigError(f"{field}={str(folder)!r} holds no {CONFIG_FILE} and {WEIGHTS_FILE}; give the folder of a "
                          "PEFT LoRA adapter (what peft's save_pretrained writes)")
    config = json.loads(config_file.read_text())
    unsupported = {k: config.get(k) for k, plain in (("peft_type", "LORA"), ("use_dora", False), ("use_rslora", False),
                                                      ("bias", "none"), ("modules_to_save", None),
                                                      ("fan_in_fan_out", False))
                   if config.get(k, plain) != plain}
    if unsupported or config.get("rank_pattern") or config.get("alpha_pattern"):
        shown = ", ".join(f"{k}={v!r}" for k, v in unsupported.items()) or "per-module ranks or alphas"
        raise ConfigError(f"{field}={str(folder)!r} is a PEFT adapter with {shown}; jaxpar reads plain LoRA adapters "
                          "(one rank and alpha, no DoRA, rsLoRA, biases or saved modules)")
    return config
