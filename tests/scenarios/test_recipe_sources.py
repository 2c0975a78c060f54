"""Recipes from anywhere: a shipped name, a path to a .py file, package.module[:function], or a
name a model family registers (a preset, or one of its recipes).

Here a recipe file trained end to end by `jaxpar train`; the loading: tests/unit/test_recipe_sources.py."""

from jaxpar.commands import main

from ..unit.test_recipe_sources import isolated_imports, recipe_file  # noqa: F401  the fixtures, shared


def test_train_a_recipe_file(recipe_file, capsys):
    path, _ = recipe_file
    assert main(["train", str(path), "--no-progress", "--set", "train.steps=2"]) == 0
    out = capsys.readouterr().out
    assert f"{path}: MLP" in out and "over 2 steps" in out
