"""Testing tools for jaxpar users too.

  * pytest plugin (`-p jaxpar.testing`, or `pytest_plugins = ["jaxpar.testing"]` in a
    conftest): forces N CPU devices before JAX starts (ini option `jaxpar_cpu_devices`,
    default 8), so layouts for a GPU host run on a laptop, and compiles fast
    (`fast_compiles`; ini option `jaxpar_fast_compiles`, default true).
  * `compare_layouts` / `assert_equivalent`: train one config under two layouts from the
    same initial parameters and data and compare losses, first-step gradients and
    parameters after N steps.
  * `CompileLog`: where a test run's time goes, each trace, lowering and XLA compile with
    the test that made it (benchmarks/suite_compiles.py).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from jaxpar.config import Config, PipelineConfig, apply_overrides
from jaxpar.data.sources import make_source
from jaxpar.mesh import MeshConfig, force_cpu_devices

__all__ = ["CompileLog", "assert_equivalent", "check", "compare", "compare_layouts", "fast_compiles", "force_cpu_devices", "reference_run",
           "run_layout", "single_device", "tree_error"]

CACHE_DIR = "JAXPAR_TEST_XLA_CACHE"  # the compilation cache's folder (fast_compiles); "run": one for this run only
CACHE_LIMIT = 1 << 30  # bytes the persistent cache holds before the least recently used go
COMPILE_LOG = "JAXPAR_COMPILE_LOG"  # a folder: CompileLog's lines of every test process


def fast_compiles() -> str:
    """For a test run, before JAX compiles anything; the processes a test starts inherit it:

      * a persistent compilation cache (JAX's), kept from one run to the next outside the
        clone (`default_cache_dir()`: ~/.cache/jaxpar/test-xla-cache, or under
        $XDG_CACHE_HOME), shared by pytest-xdist workers and subprocesses: a program compiled
        alike by two tests, by every process of a subprocess scenario, or by the last run of
        unchanged code, compiles once. Its entries are keyed by the program, the options and
        the jax version, so a stale one is never used; the least recently used go past
        CACHE_LIMIT bytes, and the folder is safe to delete. JAXPAR_TEST_XLA_CACHE names
        another folder; `run` keeps one for this run only (a cold run), removed at exit.
      * XLA's backend at optimisation level 0: LLVM stops optimising the CPU code it emits,
        about half of a tiny model's compile time. The HLO passes (SPMD partitioning,
        collectives, scheduling) are unchanged, and so are the values: LLVM does not
        reorder floating-point arithmetic unasked. Skipped if XLA_FLAGS sets the level.

    Returns the cache directory. A program loaded from the cache prints none of the
    compiler's warnings: what reads them compiles in jaxpar.inspect.compiler_warnings()."""
    asked = os.environ.get(CACHE_DIR, "")  # the run's first process; the others inherit its folder
    if asked == "run":
        os.environ[CACHE_DIR] = tempfile.mkdtemp(prefix="jaxpar-test-xla-cache-")
        atexit.register(shutil.rmtree, os.environ[CACHE_DIR], ignore_errors=True)
    elif not asked:
        os.environ[CACHE_DIR] = default_cache_dir()
    settings = {"jax_compilation_cache_dir": os.environ[CACHE_DIR],
                "jax_persistent_cache_min_compile_time_secs": 0,  # tiny programs are worth caching too
                "jax_persistent_cache_min_entry_size_bytes": -1,
                "jax_compilation_cache_max_size": CACHE_LIMIT}
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)
    if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):  # read when the backend starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    return os.environ[CACHE_DIR]


def default_cache_dir() -> str:
    """Where test runs keep compiled programs between runs: outside any clone, per user."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "jaxpar", "test-xla-cache")


class CompileLog(logging.Handler):
    """JAX's compile reports (jax_log_compiles, turned on here) as JSON lines in
    `directory`/<pid>.jsonl: {"test", "kind": tracing | lowering | compile, "fn", "s"}, the
    test being the one `test` names when JAX reports. The reports leave JAX's loggers only
    through this handler (nothing more on stderr); a cache hit is a compile of a few
    milliseconds. Processes a test starts are not logged."""

    REPORT = re.compile(r"Finished (tracing|jaxpr to MLIR module conversion|XLA compilation) (?:of )?(?:for )?"
                        r"(?:jit\()?(.*?)\)?(?: for jit)? in ([0-9.e+-]+) sec")
    KINDS = {"tracing": "tracing", "jaxpr to MLIR module conversion": "lowering", "XLA compilation": "compile"}
    LOGGERS = ("jax._src.dispatch", "jax._src.interpreters.pxla")

    def __init__(self, directory: str):
        super().__init__(logging.DEBUG)
        self.test = ""
        self.file = open(os.path.join(directory, f"{os.getpid()}.jsonl"), "a", buffering=1)
        jax.config.update("jax_log_compiles", True)
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            logger.addHandler(self)
            logger.propagate = False

    def close(self) -> None:
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            logger.removeHandler(self)
            logger.propagate = True
        jax.config.update("jax_log_compiles", False)
        self.file.close()
        super().close()

    def emit(self, record: logging.LogRecord) -> None:
        found = self.REPORT.search(record.getMessage())
        if found:
            kind, fn, seconds = found.groups()
            self.file.write(json.dumps({"test": self.test, "kind": self.KINDS[kind], "fn": fn, "s": float(seconds)}) + "\n")


def pytest_addoption(parser) -> None:
    parser.addini("jaxpar_cpu_devices", "CPU devices jaxpar.testing forces before JAX starts", default="8")
    parser.addini("jaxpar_fast_compiles", "jaxpar.testing.fast_compiles() before JAX starts", type="bool", default=True)


def pytest_configure(config) -> None:
    if config.getini("jaxpar_fast_compiles"):
        fast_compiles()
    force_cpu_devices(int(config.getini("jaxpar_cpu_devices")))


@dataclasses.dataclass
class Run:
    losses: list[float]
    grads: dict  # first step, on the host
    params: dict  # after the last step, on the host
    metrics: dict = dataclasses.field(default_factory=dict)  # the last step's scalar metrics


@dataclasses.dataclass
class Comparison:
    losses: tuple[list[float], list[float]]
    loss_error: float  # max |a - b| / |b| over steps
    grad_error: float  # max over parameters of ||a - b||_inf / ||b||_inf, first step
    param_error: float  # the same, after the last step


def single_device(config: Config) -> tuple[Config, list[jax.Device]]:
    """The reference: the same config on one device, every mesh axis 1 (and no pipeline)."""
    plain = dataclasses.replace(config.parallel, pipeline=PipelineConfig())
    return dataclasses.replace(config, mesh=MeshConfig(data=1), parallel=plain), jax.devices()[:1]


def run_layout(config: Config, devices: Sequence[jax.Device] | None = None, steps: int = 3) -> Run:
    """Gradients of step 0, losses of `steps` steps and the final parameters."""
    from jaxpar.step.trainer import build

    trainer = build(config, devices)
    source = make_source(trainer.batch, trainer.config)
    state = initial_state(trainer)
    if config.data.source == "preference":  # DPO's reference: the starting weights
        from jaxpar.loop.start import attach_reference

        attach_reference(source, trainer, trainer.weights(state))
    losses, grads = [], None
    for i in range(steps):  # one compile: the step that also returns its gradients
        state, metrics, step_grads = trainer.step_and_grads(state, source(i))
        grads = trainer.model_order(jax.device_get(step_grads)) if i == 0 else grads  # reordered on the host
        losses.append(float(metrics["loss"]))
    scalars = {k: float(v) for k, v in jax.device_get(metrics).items() if getattr(v, "ndim", 0) == 0}
    return Run(losses, grads, trainer.model_order(jax.device_get(trainer.master_params(state))), scalars)


def initial_state(trainer) -> Any:
    """`trainer.init()`'s state without compiling its random draws: the model's initial
    weights (initial_weights) placed as the state holds them, so the step's donated buffers
    are the state's own. LoRA's adapters are drawn beside the base as the build draws them
    (jaxpar.step.lora.adapted_weights)."""
    from jaxpar.step.lora import adapted_weights

    config = trainer.config
    weights = initial_weights(config)
    if trainer.lora_targets:
        weights = adapted_weights(weights, trainer.lora_targets, config.lora, config.train.seed)
    return trainer.start_from(jax.device_put(weights, trainer.master_weights(trainer.state_shardings)))


def initial_weights(config: Config) -> dict:
    """The model's float32 weights at train.seed, as `trainer.init()` draws them, on the
    host: drawn once per model and seed (one small compile on one device) and given to each
    layout's `start_from`, whose compile is a tenth of `init`'s (no random draws in it)."""
    return _initial_weights(config.model, config.train.seed)


@functools.lru_cache(maxsize=16)
def _initial_weights(model, seed: int) -> dict:
    def draw():
        with nnx.use_eager_sharding(False):
            return nnx.to_pure_dict(nnx.state(model.build(nnx.Rngs(seed))))

    return jax.device_get(jax.jit(draw)())


def reference_run(config: Config, steps: int = 3) -> Run:
    """The single-device reference; under DiLoCo, its groups one after another (`diloco_reference`)."""
    if config.parallel.diloco.inner_steps:
        return diloco_reference(config, steps)
    return run_layout(*single_device(config), steps=steps)


def diloco_reference(config: Config, steps: int = 3) -> Run:
    """DiLoCo (parallel.diloco) as its papers write it, on one device: each of the
    mesh.data groups takes its inner steps on its rows of each batch (rows g x B/G on), one
    group after another, with its own optimizer state; when a fragment's period ends, numpy
    averages the groups' changes of it, takes the outer step (SGD, (Nesterov) momentum) and
    sets each group's weights to the new anchor, mixed with its own. Float32 outer
    exchange only (int8's rounding depends on the layout's shards). Run.params: the anchor;
    Run.grads: the groups' mean first gradient."""
    from jaxpar.step.diloco import NONE, WHOLE, fragment_plan, is_selection
    from jaxpar.step.trainer import build

    whole = build(config)  # its batches, and its groups: mesh.data resolved
    spec, groups = config.parallel.diloco, whole.mesh.shape["data"]
    one_config, devices = single_device(config)
    one_config = apply_overrides(one_config, ["parallel.diloco.inner_steps=0",
                                              f"train.global_batch={config.train.global_batch // groups}"])
    trainer = build(one_config, devices)
    source = make_source(whole.batch, config)
    start = initial_state(trainer)
    states = [jax.tree.map(lambda x: x.copy(), start) for _ in range(groups)]
    f32 = lambda st: jax.device_get(trainer.master_params(st))  # noqa: E731
    anchor = f32(start)
    momentum = jax.tree.map(np.zeros_like, anchor)
    plans = fragment_plan(trainer.param_names, anchor, spec.fragments)
    period, losses, grads = spec.inner_steps // spec.fragments, [], None
    for i in range(steps):
        batch, rows = source(i), config.train.global_batch // groups
        before = [f32(st) for st in states]  # delay 1: the pseudo-gradient from the weights before the step
        out = [trainer.step_and_grads(st, {k: v[g * rows:(g + 1) * rows] for k, v in batch.items()})
               for g, st in enumerate(states)]
        states = [o[0] for o in out]
        losses.append(float(np.mean([float(o[1]["loss"]) for o in out])))
        grads = jax.tree.map(lambda *g: np.mean(g, axis=0), *[jax.device_get(o[2]) for o in out]) if i == 0 else grads
        if (i + 1) % period:
            continue
        plan = jax.tree.leaves(plans[((i + 1) // period - 1) % spec.fragments], is_leaf=is_selection)
        after = [[np.array(w) for w in jax.tree.leaves(f32(st))] for st in states]
        taken = [jax.tree.leaves(w) for w in before] if spec.delay else after
        treedef = jax.tree.structure(anchor)
        a, m = [np.array(x) for x in jax.tree.leaves(anchor)], [np.array(x) for x in jax.tree.leaves(momentum)]
        for p, sel in enumerate(plan):
            if sel == NONE:
                continue
            at = slice(None) if sel == WHOLE else np.asarray(sel.index)
            delta = np.mean([a[p][at] - w[p][at] for w in taken], axis=0)
            m[p][at] = spec.outer_momentum * m[p][at] + delta
            a[p][at] -= spec.outer_lr * (delta + spec.outer_momentum * m[p][at] if spec.nesterov else m[p][at])
            for w in after:
                w[p][at] = (1 - spec.mix) * a[p][at] + spec.mix * w[p][at]
        anchor, momentum = jax.tree.unflatten(treedef, a), jax.tree.unflatten(treedef, m)
        states = [_with_weights(trainer, st, jax.tree.unflatten(treedef, w)) for st, w in zip(states, after)]
    return Run(losses, grads, anchor, {})


def _with_weights(trainer, state, weights: Any):
    """`state` with its float32 weights (and parameters cast from them) set to `weights`,
    its optimizer state kept."""
    from jaxpar.step.state import cast_floats

    weights = jax.device_put(weights, trainer.shardings.optimizer)
    params = jax.device_put(cast_floats(weights, trainer.config.train.compute_dtype), trainer.state_shardings.params)
    return dataclasses.replace(state, params=params, master=None if state.master is None else weights)


def compare(a: Run, b: Run) -> Comparison:
    return Comparison(
        losses=(a.losses, b.losses),
        loss_error=max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a.losses, b.losses)),
        grad_error=tree_error(a.grads, b.grads),
        param_error=tree_error(a.params, b.params),
    )


def compare_layouts(
    config: Config,
    layout_a: Sequence[str],
    layout_b: Sequence[str] | None = None,
    steps: int = 3,
) -> Comparison:
    """Train `config` with overrides `layout_a` on all devices and with `layout_b` (default:
    the single-device reference) and measure how far apart they end up."""
    a = run_layout(apply_overrides(config, list(layout_a)), steps=steps)
    b = reference_run(config, steps) if layout_b is None else run_layout(apply_overrides(config, list(layout_b)), steps=steps)
    return compare(a, b)


def tree_error(a, b) -> float:
    """Max over leaves of ||a - b||_inf / ||b||_inf (normwise relative error)."""
    errs = jax.tree.map(
        lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        / max(float(np.max(np.abs(np.asarray(y, np.float64)))), 1e-30),
        a,
        b,
    )
    return max(jax.tree.leaves(errs))


def check(c: Comparison, rtol: float = 1e-5, param_rtol: float | None = None, where: str = "") -> Comparison:
    """Assert losses and first-step gradients within `rtol`, final parameters within
    `param_rtol` (default `rtol`)."""
    param_rtol = rtol if param_rtol is None else param_rtol
    assert c.loss_error <= rtol, f"{where}: losses differ by {c.loss_error:.2e} > {rtol:.0e}: {c.losses}"
    assert c.grad_error <= rtol, f"{where}: gradients differ by {c.grad_error:.2e} > {rtol:.0e}"
    assert c.param_error <= param_rtol, f"{where}: parameters differ by {c.param_error:.2e} > {param_rtol:.0e}"
    return c


def assert_equivalent(
    config: Config,
    layout_a: Sequence[str],
    layout_b: Sequence[str] | None = None,
    steps: int = 3,
    rtol: float = 1e-5,
    param_rtol: float | None = None,
) -> Comparison:
    """compare_layouts, then check."""
    where = f"{list(layout_a)} vs {list(layout_b) if layout_b is not None else 'single device'}"
    return check(compare_layouts(config, layout_a, layout_b, steps), rtol, param_rtol, where)
