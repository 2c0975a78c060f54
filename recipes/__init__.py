"""Recipes: one typed Config per module, `recipe() -> Config`."""

from __future__ import annotations

import importlib
import pkgutil

from jaxpar.errors import ConfigError


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__))


def load(name: str):
    if name not in names():
        raise ConfigError(f"unknown recipe {name!r}; use one of {', '.join(names())}")
    return importlib.import_module(f"recipes.{name}").recipe()
