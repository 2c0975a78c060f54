"""One candidate layout of `jaxpar plan`, compiled in a child process.

XLA can abort the process it compiles in (a failed CHECK is SIGABRT), and a large layout can
run a machine out of memory or take too long. Compiled in a child, such a candidate is marked
failed with a short reason and the plan goes on with the others.

Parent: `compile_in_child(...)` writes a request file and runs
`python -m jaxpar.plan.compile_one REQUEST RESULT` (COMMAND). The request holds two
pickles: first what to set up before the model can be unpickled (the parent's sys.path,
and the recipe files it loaded by path, where a user's model class may live: the child
imports one only if the model refers to it), then the model and what to compile. The
child compiles on the same CPU devices, by id, as the parent's list (a single process
simulates hosts by contiguous blocks of that list, so the host layout is the same) and
writes JSON: {"memory", "prediction"} or {"refused"}.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile

from jaxpar.logs import last_words

COMMAND = [sys.executable, "-m", "jaxpar.plan.compile_one"]  # + REQUEST RESULT
# `jaxpar plan --target`: the GpuTargetConfig file and topology the parent's devices came
# from (jaxpar.deviceless), which the child describes again
TARGET_ENV, TOPOLOGY_ENV = "JAXPAR_PLAN_TARGET", "JAXPAR_PLAN_TOPOLOGY"


def compile_in_child(model, overrides: list[str], devices: list, seq_len: int, global_batch: int, hw,
                     hbm_bytes: float, timeout_s: float, host_s: float = 0.0) -> dict:
    """{"memory", "prediction"}, {"refused": why the framework refused it}, or
    {"failed": why the child died or was stopped}."""
    setup = {"sys_path": list(sys.path), "platform": devices[0].platform, "device_ids": [d.id for d in devices],
             "target": os.environ.get(TARGET_ENV), "topology": os.environ.get(TOPOLOGY_ENV),
             "recipe_files": {name: m.__file__ for name, m in list(sys.modules.items())
                              if name.startswith("jaxpar_recipe_") and getattr(m, "__file__", None)}}
    job = {"model": model, "overrides": overrides, "seq_len": seq_len, "global_batch": global_batch, "hw": hw,
           "hbm_bytes": hbm_bytes, "host_s": host_s}
    with tempfile.TemporaryDirectory(prefix="jaxpar-plan-") as tmp:
        request, result = os.path.join(tmp, "request.pickle"), os.path.join(tmp, "result.json")
        with open(request, "wb") as f:
            pickle.dump(setup, f)
            pickle.dump(job, f)
        try:
            done = subprocess.run([*COMMAND, request, result], capture_output=True, text=True, errors="replace",
                                  timeout=timeout_s,
                                  env={**os.environ, "JAX_PLATFORMS": "cpu" if setup["target"] else setup["platform"]})
        except subprocess.TimeoutExpired:  # run() has killed it
            return {"failed": f"compile took longer than {timeout_s:g} s (--compile-timeout); stopped it"}
        if done.returncode == 0 and os.path.exists(result):
            with open(result) as f:
                return json.load(f)
    return {"failed": _cause(done.returncode, done.stderr or done.stdout)}


def _cause(code: int, output: str) -> str:
    """A one-line reason for a child that ended without a result."""
    said = last_words(output)
    if code < 0:
        name = signal.Signals(-code).name
        how = {"SIGABRT": "compile aborted (SIGABRT) in XLA or the runtime",
               "SIGKILL": "compile killed (SIGKILL; out of memory, most likely)"}.get(name, f"compile killed ({name})")
    else:
        how = f"compile process exited with status {code} and no result"
    return f"{how}: {said}" if said else f"{how}, saying nothing"


def compile_layout(model, overrides: list[str], devices: list, seq_len: int, global_batch: int, hw,
                   hbm_bytes: float, host_s: float = 0.0) -> dict:
    """Compile one layout here, in this process: {"memory", "prediction"} or {"refused"}.
    `host_s`: the exposed copies to and from host memory (jaxpar.plan.layouts.estimate)."""
    from jaxpar.config import Config, TrainConfig, apply_overrides
    from jaxpar.errors import ConfigError
    from jaxpar.inspect import inspect_step
    from jaxpar.plan.step_time import roofline
    from jaxpar.step.trainer import build

    base = Config(model=model, train=TrainConfig(global_batch=global_batch, seq_len=seq_len, compute_dtype="bfloat16"))
    try:
        trainer = build(apply_overrides(base, overrides), devices)
        report = inspect_step(trainer)
    except (ConfigError, ValueError) as e:
        return {"refused": str(e).split("\n")[0]}
    memory = float(report.memory.on_device)
    if report.predicted:  # compiled for a GPU: its kernels' time (jaxpar.inspect.cost)
        return {"memory": memory, "prediction": compiled_prediction(report, trainer.config, trainer.layout, host_s)}
    return {"memory": memory, "prediction": roofline(report, trainer.config, trainer.layout, hw, hbm_bytes, host_s)}


def compiled_prediction(report, config, layout, host_s: float = 0.0) -> dict[str, float]:
    """The plan's prediction fields from a step compiled for a GPU (report.predicted): the
    average device's kernels, stretched by the pipeline's lockstep ticks (as `roofline`),
    plus the collective time no compute covers and `host_s`, the copies to and from host
    memory nothing covers (a deviceless compile has no host memory to time them in)."""
    from jaxpar.plan.step_time import pipeline_bubble

    kinds = report.predicted["by_kind"]
    collective = kinds.get("collective", 0.0)
    exposed = collective + host_s
    bubble = pipeline_bubble(config, layout.pipeline, report.mesh.get("stage", 1), layout.microbatches)
    step = (report.predicted["seconds"] - collective) / (1 - bubble) + exposed
    tokens = config.train.global_batch * config.train.seq_len
    model_flops = config.model.flops_per_token(config.train.seq_len) * tokens / report.num_devices
    peak = report.predicted["bf16_tflops"] * 1e12
    return {"step_s": step, "compute_s": kinds.get("gemm", 0.0) + kinds.get("attention", 0.0),
            "memory_s": kinds.get("memory", 0.0), "exposed_comm_s": exposed, "bubble": bubble,
            "tokens_per_s_per_device": tokens / report.num_devices / step, "mfu": model_flops / (peak * step),
            "how": f"compiled for the GPU: {report.predicted['gpu']}"}


def main(argv: list[str]) -> int:
    """The child: read the request, set up the same devices, compile, write the result."""
    request, result = argv
    with open(request, "rb") as f:
        setup = pickle.load(f)
        for path in reversed(setup["sys_path"]):  # modules the parent imported from there import here too
            if path not in sys.path:
                sys.path.insert(0, path)
        job = _Unpickler(f, setup["recipe_files"]).load()
    import jax

    from jaxpar.mesh import force_cpu_devices

    ids = setup["device_ids"]
    if setup["target"]:
        from jaxpar.deviceless import gpu_devices

        found = gpu_devices(setup["target"], setup["topology"])
    else:
        if setup["platform"] == "cpu":
            force_cpu_devices(max(ids) + 1)
        found = jax.devices()
    by_id = {d.id: d for d in found}
    missing = [i for i in ids if i not in by_id]
    if missing:
        print(f"jaxpar plan: this process has no {setup['platform']} devices {missing}", file=sys.stderr)
        return 1
    answer = compile_layout(job["model"], job["overrides"], [by_id[i] for i in ids], job["seq_len"],
                            job["global_batch"], job["hw"], job["hbm_bytes"], job["host_s"])
    with open(result, "w") as f:
        json.dump(answer, f)
    return 0


class _Unpickler(pickle.Unpickler):
    """Imports a recipe file the parent loaded by path (jaxpar.recipes.load_file: a module
    name made from the path, importable by no other means) when the model refers to it."""

    def __init__(self, file, recipe_files: dict[str, str]):
        super().__init__(file)
        self.recipe_files = recipe_files

    def find_class(self, module: str, name: str):
        if module not in sys.modules and module in self.recipe_files:
            from jaxpar import recipes

            recipes.load_file(self.recipe_files[module])
        return super().find_class(module, name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
