"""Every public module imports on its own, and installing jaxpar claims no top-level import
name but its own (the shipped models/ and recipes/ folders install as jaxpar.models and
jaxpar.recipes)."""

import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
FOLDERS = {"jaxpar": ROOT / "jaxpar", **{pkg: ROOT / d for pkg, d in PYPROJECT["package-dir"].items()}}

# One interpreter loads the third-party libraries and the jaxpar package once, then forks a
# child per module that imports only that module. Any `import jaxpar.x` runs the package's
# __init__ first, so a fresh interpreter importing jaxpar.x is, after that, exactly where each
# child starts: an import cycle inside jaxpar shows up there, at a fraction of the cost (the
# package's own chain, the same for every module, runs once, in the parent).
FORK_EACH = """
import importlib, os, sys, traceback
import flax.nnx, jax, numpy, optax, orbax.checkpoint  # noqa: F401
import jaxpar  # noqa: F401
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1]:
        failed.append(name)
print("FAILED", *failed)
"""


def modules() -> list[str]:
    names = []
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__main__":
                continue
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            names.append(".".join((package, *parts)))
    return names


def test_every_module_imports_on_its_own():
    names = modules()
    assert "jaxpar.models.llama" in names and "jaxpar.recipes.llama" in names and len(names) > 60
    out = subprocess.run([sys.executable, "-c", FORK_EACH, *names], capture_output=True, text=True, timeout=300,
                         cwd="/")  # not the checkout: only what the install provides
    assert out.returncode == 0 and out.stdout.strip() == "FAILED", out.stdout + out.stderr[-4000:]


def test_the_install_lists_every_package_and_claims_only_jaxpar():
    on_disk = {".".join((package, *p.parent.relative_to(folder).parts)).rstrip(".")
               for package, folder in FOLDERS.items() for p in folder.rglob("__init__.py")}
    assert set(PYPROJECT["packages"]) == on_disk
    assert all(p == "jaxpar" or p.startswith("jaxpar.") for p in PYPROJECT["packages"])
