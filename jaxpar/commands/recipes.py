"""`jaxpar recipes`: list the shipped recipes (a line each: its model family, size, mesh and
what it is), the model presets, and the other forms a recipe takes."""

from __future__ import annotations


def add_parser(sub) -> None:
    sub.add_parser("recipes", help="list the shipped recipes, a line each, and the model presets")


def run(args) -> int:
    from jaxpar import families, recipes

    named = [*recipes.names(), *families.recipes()]
    width = max(map(len, named))
    for name in named:
        print(f"{name:{width}s}  {describe(name)}")
    print(f"presets (the model, with jaxpar's defaults for the rest): {', '.join(recipes.presets())}")
    print(f"(or {recipes.FORMS}, e.g. jaxpar train ./my_recipe.py or jaxpar train my_recipes.small:recipe)")
    return 0


def describe(name: str) -> str:
    """'llama, 853.12K params, data 2 x fsdp 2 x tensor 2: A small Llama with ...': the
    recipe's model family, its parameter count, its mesh on 8 devices and the first line of
    its docstring."""
    import importlib

    from jaxpar import families, recipes
    from jaxpar.errors import ConfigError
    from jaxpar.units import params

    config = recipes.load(name)
    family = {f.config_class: f.name for f in families.families()}.get(type(config.model), type(config.model).__name__)
    try:
        sizes = config.mesh.resolve(8)  # as the recipe runs on 8 devices
    except ConfigError:
        sizes = config.mesh.requested()
    mesh = " x ".join(f"{axis} {size}" for axis, size in sizes.items() if size != 1) or "one device"
    source = families.recipes().get(name)
    if source is None:
        source = importlib.import_module(f"jaxpar.recipes.{name}")
    elif isinstance(source, str):
        module, _, function = source.partition(":")
        source = getattr(importlib.import_module(module), function or recipes.DEFAULT_FUNCTION, None)
    doc = (getattr(source, "__doc__", None) or "").strip().splitlines()
    return f"{family}, {params(config.model.param_count())} params, {mesh}" + (f": {doc[0]}" if doc else "")
