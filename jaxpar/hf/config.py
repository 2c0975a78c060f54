"""Reading a Hugging Face config.json: the helpers a format's `from_hf` uses
(jaxpar.hf.format), and the check that a run's model is the checkpoint's."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from jaxpar.errors import ConfigError


def read_config(folder: pathlib.Path, field: str = "") -> dict:
    """config.json of the Hugging Face checkpoint in `folder`; `field`: the setting that gave
    the folder (checkpoint.init_from), which the errors name."""
    path = folder / "config.json"
    shown = f"{field}={str(folder)!r}" if field else repr(str(folder))
    wanted = "give the folder of a Hugging Face checkpoint (config.json and *.safetensors)"
    if field:  # a run's own checkpoint.dir is what a new user tries there first
        wanted = (f"{field} takes only the folder of a Hugging Face checkpoint (config.json and *.safetensors); a "
                  "jaxpar run's own checkpoints resume through checkpoint.dir")
    if not folder.is_dir():
        raise ConfigError(f"{shown} is not a folder; {wanted}")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{shown} has no config.json; {wanted}") from None
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{str(path)!r} is not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{str(path)!r} holds a JSON {type(config).__name__}, not an object of the model's settings; "
                          "the checkpoint's config.json is damaged")
    return config


def architecture(hf: dict, folder: Any) -> str:
    names = hf.get("architectures") or []
    if len(names) != 1:
        raise ConfigError(f"{str(folder)!r}: config.json names architectures {names}; jaxpar reads a checkpoint of one")
    return names[0]


def value(hf: dict, key: str, folder: Any = "") -> Any:
    """A key config.json must have."""
    if hf.get(key) is None:
        raise ConfigError(f"{str(folder) + ': ' if folder else ''}config.json has no {key!r}")
    return hf[key]


def refuse_unless(hf: dict, **expected: Any) -> None:
    """Keys whose other values our models do not compute (a bias, another activation)."""
    for key, want in expected.items():
        if hf.get(key, want) != want:
            raise ConfigError(f"config.json has {key}={hf[key]!r}; jaxpar's model computes only {key}={want!r}")


def rope_settings(hf: dict) -> dict:
    """RoPE's theta and scaling from either spelling: transformers 5's `rope_parameters`, or
    4's `rope_theta` and `rope_scaling`. Keys: rope_type, rope_theta, and the scaling's own."""
    settings = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    settings.update({k: v for k, v in scaling.items() if k not in settings})
    settings.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    settings["rope_type"] = settings.get("rope_type", settings.get("type", "default"))
    return settings


def check_same_model(model: Any, imported: Any, folder: Any, free: tuple[str, ...]) -> None:
    """The run's model config against the one config.json describes: every field must agree
    but the training choices `free` (its format's `training_fields`: remat, routing)."""
    for f in dataclasses.fields(imported):
        ours, theirs = getattr(model, f.name), getattr(imported, f.name)
        if f.name not in free and ours != theirs:
            raise ConfigError(
                f"checkpoint.init_from={str(folder)!r}: its config.json gives model.{f.name}={theirs!r}, but this run has "
                f"model.{f.name}={ours!r}; set model.{f.name}={theirs!r}, or train the recipe hf:{folder}, whose model is "
                "the checkpoint's"
            )
