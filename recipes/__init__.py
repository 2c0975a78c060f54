"""Recipes: one typed Config per module, `recipe() -> Config`.

`load(spec)` takes any of
- a shipped recipe's name: `llama` (see `names()`);
- a path to a Python file defining `recipe()`: `path/to/gpt2.py`, `./my_recipe.py`, an
  absolute path; `path.py:function` names another function;
- an importable module, `package.module:function` or `package.module` (function `recipe`),
  searched on sys.path with the current directory added, as `python -m` does;
- `hf:FOLDER`, a Hugging Face checkpoint to fine-tune (jaxpar.hf.recipe): its model, weights,
  tokenizer and end-of-text id;
- a name a registered model family gives (jaxpar.families): one of its recipes, or one of its
  presets (`llama3-8b`, see `presets()`), which runs that model with jaxpar's defaults for
  the rest (change them with --set).

A file is imported once per process under a name derived from its resolved path, registered
in sys.modules (so dataclasses and pickling inside it work), with its own folder at the front
of sys.path (so it can import the modules beside it). Loading it again reuses that module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import pkgutil
import re
import sys
import traceback
from pathlib import Path
from types import ModuleType

from jaxpar import families
from jaxpar.errors import ConfigError

DEFAULT_FUNCTION = "recipe"
FORMS = ("a model preset (jaxpar recipes lists them), a path to a .py file defining recipe(), package.module:function, "
         "or hf:FOLDER (a Hugging Face checkpoint)")
# Paths `jaxpar sample` and `jaxpar export` read from a run's checkpoint, from any folder.
RECORDED_PATHS = (("data", "tokenizer"), ("checkpoint", "init_from"))
_MODULE_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?$")


class UnknownRecipe(ConfigError):
    """Neither a shipped recipe, a path, nor an importable module: a typo, most likely."""


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__))


def did_you_mean(spec: str) -> str:
    """' (did you mean 'llama'?)' where a recipe or preset name is close to `spec`, else ''."""
    import difflib

    close = difflib.get_close_matches(spec, [*names(), *families.recipes(), *presets()], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def presets() -> list[str]:
    """The model families' presets, each a recipe of that model with jaxpar's defaults."""
    return list(families.presets())


def load(spec: str):
    """The Config that `spec`'s recipe function returns (see the module docstring)."""
    if spec.startswith("hf:"):
        from jaxpar.hf.recipe import recipe

        return recipe(spec[3:])
    if spec not in names():
        named = families.recipes()
        if spec in named:
            if callable(named[spec]):
                return _call(None, named[spec], f"recipe {spec!r}")
            return load(named[spec])
        model = families.presets().get(spec)
        if model is not None:
            from jaxpar.config import Config

            return Config(model=model)
    module, function, where = _module_for(spec)
    return _call(module, function, where)


def is_path(spec: str) -> bool:
    """Whether `spec` names a file (ends in .py, has a path separator, or is a file here)
    rather than a shipped recipe or a module."""
    head, colon, _ = spec.rpartition(":")
    target = head if colon and head.endswith(".py") else spec
    seps = [sep for sep in ("/", os.sep, os.altsep) if sep]
    return target.endswith(".py") or any(sep in spec for sep in seps) or os.path.isfile(spec)


def _module_for(spec: str) -> tuple[ModuleType, str, str]:
    """(the imported module, the function to call, how to name it in messages)."""
    if spec not in names() and is_path(spec):
        head, colon, function = spec.rpartition(":")
        path, function = (head, function) if colon and head.endswith(".py") else (spec, "")
        return load_file(path), function or DEFAULT_FUNCTION, f"recipe file {path}"
    if not _MODULE_SPEC.match(spec):
        raise UnknownRecipe(f"recipe {spec!r}{did_you_mean(spec)} is not a shipped name ({', '.join(names())}), {FORMS}")
    name, _, function = spec.partition(":")
    if name in names():  # llama or llama:recipe
        return importlib.import_module(f"jaxpar.recipes.{name}"), function or DEFAULT_FUNCTION, f"recipe {name!r}"
    return _import_module(name, spec), function or DEFAULT_FUNCTION, f"module {name}"


def load_file(path: str | os.PathLike) -> ModuleType:
    """The module of the Python file at `path`, imported once per process (see the module docstring)."""
    file = Path(path).expanduser()
    if not file.exists():
        raise ConfigError(f"recipe file {str(path)!r} not found; use an existing .py file, or a shipped recipe "
                          f"({', '.join(names())})")
    if file.is_dir() or file.suffix != ".py":
        raise ConfigError(f"recipe path {str(path)!r} is not a .py file; give a Python file that defines recipe(), "
                          "or package.module:function for a package")
    file = file.resolve()
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", file.stem)
    name = f"jaxpar_recipe_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))  # its siblings import as they would beside a script
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclasses and pickle look it up there
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"recipe file {path} failed to import: {_describe(e)}") from e
    return module


def _import_module(name: str, spec: str) -> ModuleType:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` does: modules in the current directory import
    if ":" not in spec and "." not in spec and importlib.util.find_spec(name) is None:
        raise UnknownRecipe(f"unknown recipe {spec!r}{did_you_mean(spec)}; use one of {', '.join(names())}; or {FORMS}")
    try:
        return importlib.import_module(name)
    except Exception as e:
        missing = getattr(e, "name", None)
        if isinstance(e, ModuleNotFoundError) and missing and (name == missing or name.startswith(missing + ".")):
            raise ConfigError(f"recipe module {name!r} not found on sys.path or in {cwd}; use package.module:function "
                              f"importable from there, a path to a .py file, or a shipped recipe ({', '.join(names())})"
                              ) from e
        raise ConfigError(f"module {name} failed to import: {_describe(e)}") from e


def _call(module: ModuleType | None, function, where: str):
    """`module.function()` (or `function()`, given the function), checked to be a Config."""
    from jaxpar.config import Config

    fn = function if callable(function) else getattr(module, function, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        listed = f"callables defined there: {', '.join(found)}" if found else "it defines no callables"
        raise ConfigError(f"{where} has no function {function!r} returning a jaxpar.config.Config; {listed}")
    try:
        config = fn()
    except Exception as e:
        raise ConfigError(f"{where}: {getattr(fn, '__name__', function)}() raised {_describe(e)}") from e
    if not isinstance(config, Config):
        raise ConfigError(f"{where}: {getattr(fn, '__name__', function)}() returned {type(config).__module__}.{type(config).__qualname__}, "
                          "not a jaxpar.config.Config; return Config(model=..., train=...)")
    return config


def _describe(e: BaseException) -> str:
    """`Type: message (file, line N)`, the line being the deepest one in the folder of the
    user's code that the import or call entered (the first frame past this module and importlib)."""
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, SyntaxError):
        return text  # its message names the file and line already
    machinery = (__file__, importlib.__file__)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if f.filename not in machinery and not f.filename.startswith("<frozen")]
    if not frames:
        return text
    folder = Path(frames[0].filename).parent
    frame = [f for f in frames if Path(f.filename).is_relative_to(folder)][-1]
    return f"{text} ({frame.filename}, line {frame.lineno})"


def resolve_config(recipe: str, overrides: list[str], num_devices: int):
    """The recipe with overrides applied. A recipe's mesh is the layout it was written for:
    naming any mesh.* axis replaces it (unnamed axes are 1, data fills with -1), and on a
    single device every layout collapses to the single-device run. The paths a checkpoint
    records for `sample` and `export` to read back are made absolute (RECORDED_PATHS)."""
    from jaxpar.config import with_overrides

    return with_absolute_paths(with_overrides(load(recipe), overrides, num_devices))


def with_absolute_paths(config):
    """`config` with each of RECORDED_PATHS that is set made absolute, against the current folder."""
    for section, field in RECORDED_PATHS:
        part = getattr(config, section)
        value = getattr(part, field)
        if value and not Path(value).is_absolute():
            absolute = str(Path(value).absolute())
            config = dataclasses.replace(config, **{section: dataclasses.replace(part, **{field: absolute})})
    return config
