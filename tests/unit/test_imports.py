"""Every public module imports on its own, none imports itself through others or from a
layer above its own (docs/architecture.md), and installing jaxpar claims no top-level import name but its own (the shipped models/ and
recipes/ folders install as jaxpar.models and jaxpar.recipes)."""

import ast
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
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


def imports_of(name: str, path: pathlib.Path, names: set[str]) -> set[str]:
    """The jaxpar modules `name` imports, at its top or inside a function (a lazy import
    that closes a circle still ties the two modules together)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package up
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                package = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{package}.{base}".rstrip(".")
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in names else base)
    return (found & names) - {name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups




# The layers, from the top down (docs/architecture.md): a module imports from its own layer
# or those below. The most specific prefix places a module; "jaxpar" alone is the package's
# __init__ (the public names).
LAYERS = [
    ("commands", ["jaxpar.commands"]),
    ("planner", ["jaxpar.plan"]),
    ("public names", ["jaxpar", "jaxpar.testing", "jaxpar.inspect", "jaxpar.train"]),
    ("host run", ["jaxpar.loop"]),
    ("generation", ["jaxpar.generate"]),
    ("program", ["jaxpar.step"]),
    ("checks", ["jaxpar.checks"]),
    ("configs", ["jaxpar.config", "jaxpar.config_text", "jaxpar.config_record", "jaxpar.recipes", "jaxpar.hf.recipe"]),
    ("models", ["jaxpar.models", "jaxpar.hf", "jaxpar.nn"]),
    ("sharding", ["jaxpar.sharding"]),
    ("kernels and parts", ["jaxpar.kernels", "jaxpar.pipeline", "jaxpar.data", "jaxpar.launch", "jaxpar.distributed",
                           "jaxpar.curves"]),
    ("base", ["jaxpar.choices", "jaxpar.families", "jaxpar.mesh", "jaxpar.model", "jaxpar.errors", "jaxpar.specs", "jaxpar.logs", "jaxpar.units", "jaxpar.flops",
              "jaxpar.xla_options", "jaxpar.deviceless", "jaxpar.device_memory", "jaxpar.scan_stacks"]),
]
# Imports that still run upward, each with its reason (none today); the test fails if one
# disappears too, so this list stays true.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def layer_of(module: str) -> int:
    found = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
             if module == prefix or (prefix != "jaxpar" and module.startswith(prefix + "."))]
    assert found, f"{module} is in no layer of LAYERS: add it"
    return max(found)[1]


def import_graph() -> dict[str, set[str]]:
    paths = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            paths[".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return {name: imports_of(name, path, set(paths)) for name, path in paths.items()}


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    assert "jaxpar.data.order" in graph["jaxpar.data.sources"]  # the parse sees imports
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles(graph) == []


def test_no_module_imports_from_a_layer_above_its_own():
    graph = import_graph()
    upward = {(a, b) for a, targets in graph.items() for b in targets if layer_of(b) < layer_of(a)}
    assert layer_of("jaxpar.hf.recipe") < layer_of("jaxpar.hf.load") < layer_of("jaxpar.kernels.quantized")
    assert upward == KNOWN_UPWARD, "\n".join(
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})" for a, b in sorted(upward ^ KNOWN_UPWARD))


def test_no_module_imports_another_s_private_names():
    """A name starting with one underscore is its module's own: no other module of the
    package imports it (a helper two modules share is public where it lives)."""
    found = set()
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FOLDERS:
                    found |= {(name, f"{node.module}.{a.name}") for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__") and node.module != name}
    assert found == set(), sorted(found)
