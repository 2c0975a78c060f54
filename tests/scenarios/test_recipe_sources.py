"""Recipes from anywhere: a shipped name, a path to a .py file, package.module[:function], or a
name a model family registers (a preset, or one of its recipes).

Here a recipe file trained end to end by `jaxpar train`; the loading: tests/unit/test_recipe_sources.py."""

import sys
import textwrap

import pytest

from jaxpar.commands import main

RECIPE = '''
import dataclasses

from jaxpar.config import Config, OptimConfig, TrainConfig
from jaxpar.mesh import MeshConfig
from jaxpar.models.mlp import MLPConfig

import {parts} as parts
from {parts} import HIDDEN

parts.EXECUTIONS.append(__name__)


@dataclasses.dataclass(frozen=True)
class Note:
    text: str = "tiny"


def recipe() -> Config:
    return Config(
        model=MLPConfig(in_features=16, hidden=HIDDEN, num_classes=4),
        mesh=MeshConfig(data=-1),
        train=TrainConfig(steps=3, global_batch=16, microbatches=2, compute_dtype="float32"),
        optim=OptimConfig(name="adamw", lr=3e-3, warmup_steps=1, weight_decay=0.0),
    )


def wide() -> Config:
    return dataclasses.replace(recipe(), model=MLPConfig(in_features=16, hidden=2 * HIDDEN, num_classes=4))


def not_a_config():
    return {{"model": "mlp"}}
'''


def write(folder, name, text):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture(autouse=True)
def isolated_imports(tmp_path, monkeypatch):
    """Loading puts folders on sys.path and modules in sys.modules: undo both after each test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.fixture
def recipe_file(tmp_path):
    """(tiny.py, the name of the module beside it that it imports)."""
    parts = f"parts_{tmp_path.name.replace('-', '_')}"
    write(tmp_path, f"{parts}.py", "HIDDEN = 8\nEXECUTIONS = []\n")
    return write(tmp_path, "tiny.py", RECIPE.format(parts=parts)), parts


def test_train_a_recipe_file(recipe_file, capsys):
    path, _ = recipe_file
    assert main(["train", str(path), "--no-progress", "--set", "train.steps=2"]) == 0
    out = capsys.readouterr().out
    assert f"{path}: MLP" in out and "over 2 steps" in out
