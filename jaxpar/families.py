"""Model families, registered once.

A family is a model config class with its formats and what jaxpar knows it by: its Hugging
Face format (`hf`, a jaxpar.hf.HFFormat: the architectures it reads, config.json and the
tensors' names), the model shapes the planner knows by name (`presets`), and recipes by
name. One call fills every table:

    register(Family("qwen3", Qwen3Config, hf=QWEN3_FORMAT, presets={"qwen3-8b": Qwen3Config(...)}))

and then `jaxpar train hf:DIR` reads a Qwen3 checkpoint (jaxpar.hf.model_config),
`jaxpar plan --model qwen3-8b` plans it, and `jaxpar train NAME` runs a recipe the family
names. The shipped families register in their own modules (models/llama.py, models/moe.py,
models/mlp.py), which are imported the first time a table is read, so importing this module
imports no model. A family registered again under its name replaces the earlier one; where
two families claim one architecture or preset (or one config class has formats in two), the
later registration wins, and the shipped families count as registered first.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable, Iterator, Mapping

from jaxpar.errors import ConfigError

SHIPPED = "jaxpar.models"  # every module of this package is imported before a table is read


@dataclasses.dataclass(frozen=True)
class Family:
    """`config_class`'s family. `hf`: its Hugging Face format (a jaxpar.hf.HFFormat; None: it
    has none, and jaxpar.hf refuses to import or export it). `presets`: {name: a config of
    it}, model shapes the planner (and `jaxpar explain`, `jaxpar train`) knows by name.
    `recipes`: {name: "module:function" or a function returning a jaxpar.config.Config},
    what `jaxpar train NAME` runs."""

    name: str
    config_class: type
    hf: Any = None
    presets: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    recipes: Mapping[str, str | Callable[[], Any]] = dataclasses.field(default_factory=dict)

    @property
    def hf_architectures(self) -> tuple[str, ...]:
        return () if self.hf is None else tuple(self.hf.architectures)


_FAMILIES: dict[str, Family] = {}
_loaded = False


def register(family: Family) -> Family:
    """Add `family` to every table (see the module docstring); returns it."""
    if not isinstance(family, Family):
        raise TypeError(f"register takes a jaxpar.families.Family, not {type(family).__name__}")
    for name, preset in family.presets.items():
        if not isinstance(preset, family.config_class):
            raise ConfigError(f"family {family.name!r}: preset {name!r} is a {type(preset).__name__}, not a "
                              f"{family.config_class.__name__}")
    _FAMILIES.pop(family.name, None)  # registered again: it moves to the end (it wins over earlier ones)
    _FAMILIES[family.name] = family
    return family


def families() -> list[Family]:
    """Every registered family, the shipped ones first, then in the order registered."""
    _load_shipped()
    shipped = [f for f in _FAMILIES.values() if f.config_class.__module__.startswith(SHIPPED + ".")]
    return shipped + [f for f in _FAMILIES.values() if f not in shipped]


def hf_formats() -> dict[str, Any]:
    """{Hugging Face architecture: the format (jaxpar.hf.HFFormat) that reads it}."""
    return {arch: f.hf for f in families() for arch in f.hf_architectures}


def hf_format(model: Any) -> Any:
    """The Hugging Face format of `model`'s family (the family registered for its very
    class: a subclass is a model of its own), or None."""
    formats = {f.config_class: f.hf for f in families() if f.hf is not None}
    return formats.get(type(model))


def presets() -> dict[str, Any]:
    """{preset name: model config}: the model shapes the planner knows by name."""
    return {name: preset for f in families() for name, preset in f.presets.items()}


def recipes() -> dict[str, str | Callable[[], Any]]:
    """{recipe name: "module:function" or a function}: the recipes families name."""
    return {name: recipe for f in families() for name, recipe in f.recipes.items()}


class View(Mapping):
    """A read-only table computed from the registry when read (`MODELS`, ...)."""

    def __init__(self, table: Callable[[], dict]):
        self._table = table

    def __getitem__(self, key):
        return self._table()[key]

    def __iter__(self) -> Iterator:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return repr(self._table())


def _load_shipped() -> None:
    """Import every module of the shipped models package (each registers its family)."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # before the imports: a module reading a table while it registers finds the flag set
    try:
        package = importlib.import_module(SHIPPED)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{SHIPPED}.{module.name}")
    except BaseException:
        _loaded = False
        raise


__all__ = ["Family", "View", "families", "hf_format", "hf_formats", "presets", "recipes", "register"]
