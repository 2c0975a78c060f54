"""Recipes from anywhere: a shipped name, a path to a .py file, package.module[:function], or a
name a model family registers (a preset, or one of its recipes).

A recipe file trained end to end: tests/scenarios/test_recipe_sources.py."""

import importlib
import pathlib
import pickle
import sys
import textwrap

import pytest

from jaxpar import recipes
from jaxpar.commands import main
from jaxpar.config import Config
from jaxpar.errors import ConfigError
from jaxpar.plan import resolve_model
from jaxpar.units import params

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


def test_shipped_name_still_loads():
    assert recipes.load("mlp_dp") == recipes.load("mlp_dp:recipe")
    assert recipes.load("mlp_dp").train.microbatches == 4


def test_path_loads_once_with_its_siblings_importable(recipe_file):
    path, parts = recipe_file
    first = recipes.load(str(path))
    assert isinstance(first, Config) and first.model.hidden == 8
    module = recipes.load_file(path)
    assert module.__name__ in sys.modules
    assert recipes.load(str(path)) == first  # a second load reuses the module:
    assert sys.modules[parts].EXECUTIONS == [module.__name__]  # the file ran once
    assert recipes.load_file(path).Note is module.Note
    assert pickle.loads(pickle.dumps(module.Note("x"))) == module.Note("x")  # registered, so picklable
    assert recipes.load(f"{path}:wide").model.hidden == 16


def test_relative_path_from_the_working_directory(recipe_file, monkeypatch):
    path, _ = recipe_file
    monkeypatch.chdir(path.parent)
    assert recipes.load("./tiny.py") == recipes.load("tiny.py") == recipes.load(str(path))


def test_module_function_and_module_alone(tmp_path, monkeypatch):
    parts = "parts_for_modules"
    write(tmp_path, f"{parts}.py", "HIDDEN = 8\nEXECUTIONS = []\n")
    write(tmp_path, "my_recipes/__init__.py", "")
    write(tmp_path, "my_recipes/small.py", RECIPE.format(parts=parts))
    sys.path.insert(0, str(tmp_path))
    assert recipes.load("my_recipes.small:wide").model.hidden == 16
    assert recipes.load("my_recipes.small") == recipes.load("my_recipes.small:recipe")
    assert sys.modules[parts].EXECUTIONS == ["my_recipes.small"]


def test_module_in_the_working_directory_as_python_m_finds_it(tmp_path, monkeypatch):
    write(tmp_path, "cwd_parts.py", "HIDDEN = 8\nEXECUTIONS = []\n")
    write(tmp_path, "cwd_recipes/__init__.py", "")
    write(tmp_path, "cwd_recipes/small.py", RECIPE.format(parts="cwd_parts"))
    monkeypatch.chdir(tmp_path)
    sys.path[:] = [p for p in sys.path if p not in ("", ".", str(tmp_path))]
    assert recipes.load("cwd_recipes.small:recipe").model.hidden == 8


def error(spec: str) -> str:
    with pytest.raises(ConfigError) as e:
        recipes.load(spec)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_missing_file_names_the_path_and_the_shipped_recipes(tmp_path):
    message = error(str(tmp_path / "nowhere.py"))
    assert str(tmp_path / "nowhere.py") in message and "not found" in message
    assert "deepseek, gemma3, llama, llama_long, llama_pp, mistral, mlp_dp, moe, qwen3, qwen3_moe" in message


def test_not_a_python_file(tmp_path):
    path = write(tmp_path, "recipe.yaml", "model: mlp\n")
    assert "is not a .py file" in error(str(path))
    assert "is not a .py file" in error(str(tmp_path))


def test_import_error_names_the_file_the_exception_and_the_line(tmp_path):
    path = write(tmp_path, "broken.py", "import math\n\nraise RuntimeError('no GPU here')\n")
    with pytest.raises(ConfigError) as e:
        recipes.load(str(path))
    message = str(e.value)
    assert f"recipe file {path} failed to import: RuntimeError: no GPU here ({path}, line 3)" == message
    assert isinstance(e.value.__cause__, RuntimeError)  # the user's traceback stays reachable
    assert not any(name.startswith("jaxpar_recipe_broken_") for name in sys.modules)
    syntax = write(tmp_path, "syntax.py", "def recipe(:\n")
    assert "SyntaxError" in error(str(syntax)) and "line 1" in error(str(syntax))


def test_module_that_fails_to_import_or_a_recipe_that_raises(tmp_path):
    sys.path.insert(0, str(tmp_path))
    write(tmp_path, "needs_more.py", "import not_installed_anywhere\n")
    message = error("needs_more:recipe")
    assert message.startswith("module needs_more failed to import: ModuleNotFoundError: No module named "
                              "'not_installed_anywhere'") and "needs_more.py, line 1)" in message
    path = write(tmp_path, "raises.py", "def recipe():\n    return 1 / 0\n")
    assert error(str(path)) == f"recipe file {path}: recipe() raised ZeroDivisionError: division by zero ({path}, line 2)"


def test_missing_function_lists_the_callables(recipe_file):
    path, _ = recipe_file
    message = error(f"{path}:nope")
    assert f"recipe file {path} has no function 'nope'" in message
    assert "callables defined there: Note, not_a_config, recipe, wide" in message
    empty = write(path.parent, "empty.py", "X = 1\n")
    assert "no function 'recipe'" in error(str(empty)) and "it defines no callables" in error(str(empty))


def test_function_must_return_a_config(recipe_file):
    path, _ = recipe_file
    message = error(f"{path}:not_a_config")
    assert "not_a_config() returned builtins.dict, not a jaxpar.config.Config" in message


def test_unknown_names_and_modules():
    message = error("lama")
    assert message.startswith("unknown recipe 'lama' (did you mean 'llama'?); use one of deepseek, gemma3, llama, "
                              "llama_long, llama_pp, mistral, mlp_dp, moe, qwen3, qwen3_moe")
    assert "(did you mean 'qwen3_moe'?)" in error("qwen3-moe") and "did you mean" not in error("nope")
    assert "package.module:function" in message
    assert "recipe module 'no_such_pkg.recipes' not found" in error("no_such_pkg.recipes:small")
    assert "is not a shipped name" in error("two words")
    assert "has no function 'recipe'" in error("json")  # importable, but no recipe in it


def test_plan_model_takes_the_same_specs(recipe_file):
    shipped = pathlib.Path(__file__).resolve().parents[2] / "recipes" / "llama.py"
    model, config = resolve_model(str(shipped))
    assert model.num_layers == 4 and config == resolve_model("llama")[1]
    with pytest.raises(ConfigError, match=r"--model='llama3-7b'; use one of llama3-8b.*a recipe \(deepseek, gemma3, llama"):
        resolve_model("llama3-7b")


def test_recipes_command_says_paths_work(capsys):
    """A line per recipe: its name, model family, size, mesh on 8 devices and docstring's first line."""
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[:10]] == ["deepseek", "gemma3", "llama", "llama_long", "llama_pp", "mistral",
                                                      "mlp_dp", "moe", "qwen3", "qwen3_moe"]
    llama = recipes.load("llama")
    assert out[2] == (f"llama       llama, {params(llama.model.param_count())} params, data 2 x fsdp 2 x tensor 2: "
                      "A small Llama with Megatron sequence parallelism.")
    assert out[7].startswith("moe         mixtral, ") and ", data 2 x expert 4: Mixture of experts" in out[7]
    for name, line in zip(recipes.names(), out):
        summary = importlib.import_module(f"jaxpar.recipes.{name}").__doc__.splitlines()[0]
        assert line.endswith(": " + summary) and len(summary) <= 100, line
    presets = out[10]
    assert "llama3-8b, llama3-70b" in presets and "mixtral-8x7b" in presets and "deepseek-v3" in presets
    assert "mistral-7b" in presets and "gemma3-27b" in presets
    assert "path to a .py file" in out[-1] and "module:function" in out[-1]


def test_train_reports_a_bad_file_in_one_line(tmp_path, capsys):
    assert main(["train", str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxpar: error: recipe file") and "\n" not in err


def test_plan_refuses_a_model_its_cost_model_cannot_read():
    from jaxpar.plan import resolve_model

    with pytest.raises(ConfigError, match=r"--model='mlp_dp': the planner's cost model is a decoder's .* MLPConfig has no "
                                          r"vocab_size, embed.*jaxpar explain"):
        resolve_model("mlp_dp")


def test_a_family_s_presets_and_recipes_load_by_name(monkeypatch):
    """A preset runs its model with jaxpar's defaults; a family's recipes load by their names."""
    from jaxpar import families
    from jaxpar.models.llama import LlamaConfig
    from jaxpar.plan import MODELS

    config = recipes.load("llama3-8b")
    assert config.model == MODELS["llama3-8b"] and config.train == Config().train
    families.families()  # the shipped families, registered before the test's (restored after it)
    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))

    def small() -> Config:
        return Config(model=LlamaConfig(num_layers=1))

    families.register(families.Family("mine", LlamaConfig, recipes={"mine-small": small,
                                                                    "mine-llama": "jaxpar.recipes.llama:recipe"}))
    assert recipes.load("mine-small").model.num_layers == 1
    assert recipes.load("mine-llama") == recipes.load("llama")
    families.register(families.Family("mine", LlamaConfig, recipes={"mine-small": lambda: 3}))
    with pytest.raises(ConfigError, match=r"recipe 'mine-small': <lambda>\(\) returned builtins.int, not a jaxpar.config.Config"):
        recipes.load("mine-small")
