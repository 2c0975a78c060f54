"""The config as a checkpoint records it, and back: each field flattened to a JSON value
(`record`), with where the model's config class is found again (its module, name and file),
so `rebuild` makes the same Config from the record alone, for `jaxpar sample` and `jaxpar
export` to read a run's checkpoint without its recipe. A field the record lacks (added to
jaxpar since) keeps its default; a saved key jaxpar no longer has is passed over."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import pathlib
import sys
import types
import typing
from typing import Any

from jaxpar.config import RENAMED_KEYS, Config, flatten
from jaxpar.errors import ConfigError


def record(config: Config) -> dict:
    """{"config": every field flattened to a JSON value, "model_class": where the model's
    config class is found again}."""
    return {"config": {k: jsonable(v) for k, v in flatten(config).items()},
            "model_class": class_record(type(config.model))}


def rebuild(meta: dict, where: str, step: int) -> Config:
    """The Config a `record` (inside `meta`) was made from, as saved at `step`; `where`
    names the record in errors. The model's module is imported (a recipe file from its
    saved path), so read only records whose code you would run."""
    if "model_class" not in meta:
        raise ConfigError(f"{where} was written before checkpoints recorded their model's class, so its config "
                          "cannot be rebuilt from it alone; train on from it for one step with this jaxpar (jaxpar train "
                          f"RECIPE --set checkpoint.dir=... --set train.steps={step + 1}), which saves one that records it")
    saved = {RENAMED_KEYS.get(key, key): value for key, value in meta["config"].items()}  # flat keys of before
    hints = typing.get_type_hints(Config)
    sections = {f.name: _rebuild(hints[f.name], saved, f.name + ".", where)
                for f in dataclasses.fields(Config) if f.name != "model"}
    return Config(model=_rebuild(_model_class(meta["model_class"], where), saved, "model.", where), **sections)


def jsonable(value: Any) -> Any:
    """A field's value as JSON holds it: as is, or as text (a tuple; read back as a literal)."""
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


def class_record(cls: type) -> dict:
    """Where a class is found again: its module, its qualified name, and the module's file
    (a recipe file is imported under a name of jaxpar.recipes' making, not importable)."""
    module = sys.modules.get(cls.__module__)
    return {"module": cls.__module__, "qualname": cls.__qualname__, "file": getattr(module, "__file__", None)}


def class_shown(record: dict) -> str:
    """A `class_record` as errors name it: the class, and its module, or a recipe file's path
    (its module's name is jaxpar.recipes' making, which the user never wrote)."""
    imported_from_file = record["module"].startswith("jaxpar_recipe_") and record.get("file")
    return f"{record['qualname']} ({record['file'] if imported_from_file else record['module']})"


def _model_class(record: dict, where: str) -> type:
    name, qualname, file = record["module"], record["qualname"], record.get("file")
    shown = f"model config class {name}.{qualname}"
    if name == "__main__":  # another program's __main__ now; never re-run a script for its class
        raise ConfigError(f"{where} was written with {shown}, defined in a script run as __main__ ({file}); move the "
                          "class into an importable module or recipe file and save a checkpoint from there")
    module = sys.modules.get(name)
    if module is None:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            if not (file and pathlib.Path(file).is_file()):
                raise ConfigError(f"{where} was written with {shown}, which cannot be imported here ({e}) and whose "
                                  f"file {file!r} is gone; put its module on sys.path") from None
            from jaxpar.recipes import load_file  # only a recipe file's class needs it

            module = load_file(file)  # a recipe file: imported as `jaxpar train FILE` did
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not (isinstance(found, type) and dataclasses.is_dataclass(found)):
        raise ConfigError(f"{where} was written with {shown}, which {name} no longer defines as a dataclass; restore "
                          "that class, or use a checkpoint written with the model as it is now")
    return found


def _rebuild(cls: type, saved: dict, prefix: str, where: str) -> Any:
    """An instance of dataclass `cls` from the flattened record's `prefix`* keys."""
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        key, hint = prefix + field.name, hints.get(field.name)
        if not field.init:
            continue
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            values[field.name] = _rebuild(hint, saved, key + ".", where)
        elif key in saved:
            values[field.name] = _field_value(saved[key], hint, key, where)
    return cls(**values)


def _field_value(value: Any, hint: Any, key: str, where: str) -> Any:
    """A saved JSON value as the field's type: as saved, a float from an int, or a value
    `jsonable` saved as text (a tuple) read back as a Python literal."""
    options = [a for a in typing.get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
    kind = (typing.get_origin(options[0]) or options[0]) if len(options) == 1 else None
    if value is None or not isinstance(kind, type):
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
    raise ConfigError(f"{where} records {key}={value!r}, which is not of type {kind.__name__} as the field now is; its "
                      "class changed since the save: restore the class it was written with, or use a newer checkpoint")


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def first_change(saved: dict, config: Config, sections: tuple[str, ...], ignore: tuple[str, ...] = ()
                 ) -> tuple[str, Any, Any] | None:
    """(key, saved value, this config's value) of the first key under `sections` (e.g.
    "model.") that `config` sets otherwise than the record `saved` (a `record`'s "config");
    None where they agree. A field added since the record was written counts as saved at its
    default; keys in `ignore` are passed over."""
    for key, value in flatten(config).items():
        if not key.startswith(sections) or key in ignore or (key not in saved and value == _default(config, key)):
            continue
        if saved.get(key) != jsonable(value):
            return key, saved.get(key), value
    return None


def _default(config: Any, key: str) -> Any:
    """The default of the field at dotted `key` under `config` (a sentinel that equals nothing
    where it has none)."""
    *sections, name = key.split(".")
    node = functools.reduce(getattr, sections, config)
    field = next(f for f in dataclasses.fields(node) if f.name == name)
    return field.default if field.default is not dataclasses.MISSING else object()
