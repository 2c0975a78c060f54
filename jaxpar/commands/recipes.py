"""`jaxpar recipes`: list the shipped recipes, the model presets, and the other forms a recipe takes."""

from __future__ import annotations



def add_parser(sub) -> None:
    sub.add_parser("recipes", help="list the shipped recipes")


def run(args) -> int:
    from jaxpar import recipes

    print("\n".join(recipes.names()))
    print(f"presets (the model, with jaxpar's defaults for the rest): {', '.join(recipes.presets())}")
    print(f"(or {recipes.FORMS}, e.g. jaxpar train ./my_recipe.py or jaxpar train my_recipes.small:recipe)")
    return 0
