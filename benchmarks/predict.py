"""Step times predicted from the program XLA compiles for an H100, without one
(jaxpar.inspect.cost over a deviceless compile), for benchmarks/mfu.py's runs: the rows
measured on an H100 before, each beside its measurement, and shapes nobody has measured,
registered here before the battery (benchmarks/gpu_battery.py, section `predicted`) measures
them and reports each prediction's error. Each row holds the H100's prediction and, under
by_device_s, the H100's and H200's.

  <venv with jax[cuda13]>/bin/python benchmarks/predict.py [--out benchmarks/results/predictions.json]

Registering: the file keeps the commit the predictions were made at; a prediction already
registered is kept as it was (the point is to have made it first), so re-running adds only
new shapes. --redo replaces them all (say why in the commit). --recheck predicts the measured
rows again with today's cost model (run it on the measured code: a worktree, today's
jaxpar/inspect/cost.py copied in) and writes their errors beside the old ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.targets, benchmarks.mfu

TARGET = "benchmarks/targets/h100.pbtxt"


@dataclasses.dataclass(frozen=True)
class Run:
    """One benchmarks/mfu.py run (the 0.9B Llama), by its flags."""

    name: str
    remat: str = "none"
    batch: int = 8
    seq_len: int = 2048
    matmul_dtype: str = "compute"
    unroll_layers: bool = False
    shape: str = "0.9b"  # benchmarks/mfu.py --shape
    loss_chunks: int = 1
    xla_options: str = ""  # benchmarks/mfu.py --xla-options (jaxpar compiler.options)
    overrides: tuple[str, ...] = ()  # benchmarks/mfu.py --set KEY=VALUE, each
    measured_s: float | None = None  # on an H100 before this file existed (the table), or None
    measured_how: str = ""

    @classmethod
    def from_flags(cls, name: str, flags: list[str]) -> Run:
        """The run a registered row's mfu_flags describe."""
        given = {f: flags[i + 1] for i, f in enumerate(flags[:-1]) if f.startswith("--")}
        overrides = tuple(flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--set")
        return cls(name, given.get("--remat", "none"), int(given.get("--batch", 8)), int(given.get("--seq-len", 2048)),
                   given.get("--matmul-dtype", "compute"), "--unroll-layers" in flags, given.get("--shape", "0.9b"),
                   int(given.get("--loss-chunks", 1)), given.get("--xla-options", ""), overrides)

    def mfu_flags(self) -> list[str]:
        return ["--remat", self.remat, "--batch", str(self.batch), "--seq-len", str(self.seq_len),
                "--matmul-dtype", self.matmul_dtype, *(["--unroll-layers"] if self.unroll_layers else []),
                *(["--shape", self.shape] if self.shape != "0.9b" else []),
                *(["--loss-chunks", str(self.loss_chunks)] if self.loss_chunks != 1 else []),
                *(["--xla-options", self.xla_options] if self.xla_options else []),
                *(arg for item in self.overrides for arg in ("--set", item))]


# Measured on one H100, jax 0.11.2 (benchmarks/results/mfu*.json, the issue 34 table).
MEASURED = [
    Run("bf16_none_b8", "none", 8, measured_s=0.230, measured_how="H100, jax 0.11.2, benchmarks/mfu.py"),
    Run("bf16_dots_b8", "dots", 8, measured_s=0.192, measured_how="H100, jax 0.11.2, the mean of 0.193 and 0.191"),
    Run("bf16_selective_b16", "selective", 16, measured_s=0.370, measured_how="H100, jax 0.11.2"),
]
# Nobody has measured these: predicted first, measured by the battery's `predicted` section.
# Once measured, a registered prediction moves to the file's "checked" (by hand, with its
# measurement), where it is kept as it was: bf16 at seq 4096, FP8 and full remat went there
# after the H100 battery of 2026-11-26, the four unrolled runs (model.unroll_layers) after the
# H200 battery of the same day. None is waiting now.
# Registered after issue 56's changes (rms_norm's and gated's own backward passes, the fused
# attention kept by dots and selective), before any GPU ran them: the 0.9B rows the battery
# times, FP8 under dots, and Llama 3.2 3B's shape (tied head, 128k vocabulary) on one GPU.
UNMEASURED: list[Run] = [
    Run("bf16_none_b8_lean", "none", 8),
    Run("bf16_dots_b8_lean", "dots", 8),
    Run("fp8_none_b8_lean", "none", 8, matmul_dtype="fp8"),
    Run("fp8_dots_b8_lean", "dots", 8, matmul_dtype="fp8"),
    Run("bf16_selective_b16_lean", "selective", 16),
    Run("bf16_3b_full_b4", "full", 4, shape="3b", loss_chunks=8),
    Run("bf16_3b_dots_b4", "dots", 4, shape="3b", loss_chunks=8),
    # Registered once the cost model read cuBLAS calls inside XLA's dynamic-slice fusions:
    # every matmul through cuBLAS (Triton GEMMs off), where XLA multiplies a layer's saved
    # activations straight out of the scan's stacks, no copy; the deviceless compile otherwise
    # makes Triton GEMMs, which a GPU's autotuner may or may not keep.
    Run("bf16_none_b8_cublas", "none", 8, xla_options="xla_gpu_enable_triton_gemm=false"),
    Run("bf16_dots_b8_cublas", "dots", 8, xla_options="xla_gpu_enable_triton_gemm=false"),
    # The predicted best bf16 setting at 0.9B: dots at batch 16 (36.5 GiB) beats selective at
    # 16 and none at 16 (54.1 GiB), whose stacks cost more traffic than dots' recompute.
    Run("bf16_dots_b16", "dots", 16),
    # A scan's stacks allocated without their zero fill (compiler.uninitialised_stacks: lax.empty,
    # XLA's AllocateBuffer, which launches nothing), the same runs as *_lean otherwise.
    Run("bf16_none_b8_unfilled", "none", 8, overrides=("compiler.uninitialised_stacks=true",)),
    Run("bf16_dots_b8_unfilled", "dots", 8, overrides=("compiler.uninitialised_stacks=true",)),
    # The two together with the best settings before them: cuBLAS's in-place stack writes, and
    # the predicted best bf16 batch.
    Run("bf16_dots_b8_cublas_unfilled", "dots", 8, xla_options="xla_gpu_enable_triton_gemm=false",
        overrides=("compiler.uninitialised_stacks=true",)),
    Run("bf16_dots_b16_unfilled", "dots", 16, overrides=("compiler.uninitialised_stacks=true",)),
]


def compile_run(run: Run, devices):
    """(config, compiled step, seconds the compile took) of one run, for `devices`."""
    from benchmarks.mfu import SHAPES, jaxpar_config
    from jaxpar.train import build

    config = jaxpar_config(dict(SHAPES[run.shape]), run.batch, run.seq_len, run.remat, 1, run.matmul_dtype,
                           run.loss_chunks, run.unroll_layers, run.xla_options, run.overrides)
    trainer = build(config, devices)
    t0 = time.perf_counter()
    compiled = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    return config, compiled, round(time.perf_counter() - t0, 1)


def predict(run: Run, devices) -> dict:
    from jaxpar.inspect.cost import GpuCost, step_cost

    config, compiled, compile_s = compile_run(run, devices)
    text = compiled.as_text()
    cost = step_cost(text, GpuCost())
    flops = config.model.flops_per_token(run.seq_len) * run.batch * run.seq_len
    # The same program timed with an H200's constants (its HBM; the H100 target compiles
    # what an H200 runs: one sm_90 compiler), for a battery that draws one.
    by_device = {d: step_cost(text, GpuCost.of(d)).seconds for d in ("H100", "H200")}
    return {"predicted_s": cost.seconds, "predicted_mfu": flops / cost.seconds / (GpuCost().bf16_tflops * 1e12),
            "by_device_s": by_device, "by_kind_s": cost.by_kind(), "kernels": cost.to_json()["kernels"],
            "compile_s": compile_s}


def recheck(doc: dict, devices, commit: str) -> dict:
    """Every measured row predicted again by today's cost model, on the device it was
    measured on: run on the code that was measured (a worktree of it, with today's
    jaxpar/inspect/cost.py), this says how far the corrected model is from each measurement."""
    import jax

    from jaxpar.inspect.cost import GpuCost

    rows = {}
    for name, old in {**doc["measured"], **doc["checked"]}.items():
        device = "H200" if "H200" in old.get("measured_how", "") else "H100"
        predicted = predict(Run.from_flags(name, old["mfu_flags"]), devices)["by_device_s"][device]
        rows[name] = {"device": device, "predicted_s": predicted, "measured_s": old["measured_s"],
                      "error": predicted / old["measured_s"] - 1, "before_s": old["predicted_s"]}
        print(f"{name:28s} {device} {predicted:.3f} vs {old['measured_s']:.3f} ({rows[name]['error']:+.1%}; "
              f"registered {old['predicted_s']:.3f})", flush=True)
    return {"commit": commit, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
            "gpu": GpuCost().describe(), "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/predictions.json")
    p.add_argument("--redo", action="store_true", help="replace registered predictions too")
    p.add_argument("--recheck", action="store_true", help="only predict every measured row again (on the device it "
                   "was measured on) and write the errors under 'recheck': after a change to the cost model")
    args = p.parse_args()
    from jaxpar.deviceless import gpu_devices

    devices = gpu_devices(str(ROOT / TARGET))[:1]
    import jax

    from jaxpar.inspect.cost import GpuCost

    out = ROOT / args.out if not pathlib.Path(args.out).is_absolute() else pathlib.Path(args.out)
    old = json.loads(out.read_text()) if out.exists() and not args.redo else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    if args.recheck:
        old["recheck"] = recheck(old, devices, commit)
        out.write_text(json.dumps(old, indent=1) + "\n")
        print(f"wrote {out}")
        return 0
    doc = {"about": __doc__.split("\n\n")[0].replace("\n", " "), "gpu": GpuCost().describe(), "target": TARGET,
           "measured": old.get("measured", {}), "registered": old.get("registered", {}),
           "checked": old.get("checked", {}), **({"recheck": old["recheck"]} if "recheck" in old else {})}
    width = max(len(run.name) for run in MEASURED + UNMEASURED)
    print(f"{'run':{width}s} {'predicted':>10s} {'H200':>7s} {'measured':>9s} {'error':>7s}  by kind (ms)")
    for run in MEASURED + UNMEASURED:
        kept = doc["measured" if run.measured_s is not None else "registered"]
        if run.name in kept:  # made first, kept as it was (--redo replaces)
            row = kept[run.name]
        else:
            row = {**predict(run, devices), "mfu_flags": run.mfu_flags(), "commit": commit, "jax": jax.__version__,
                   "date": time.strftime("%Y-%m-%d")}
            if run.measured_s is not None:
                row.update(measured_s=run.measured_s, measured_how=run.measured_how,
                           error=row["predicted_s"] / run.measured_s - 1)
        (doc["measured"] if run.measured_s is not None else doc["registered"])[run.name] = row
        error = f"{row['error']:+.1%}" if "error" in row else ""
        measured = f"{row['measured_s']:.3f}" if "measured_s" in row else "-"
        kinds = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in row["by_kind_s"].items())
        h200 = row.get("by_device_s", {}).get("H200")
        h200 = f"{h200:.3f}" if h200 else "-"
        print(f"{run.name:{width}s} {row['predicted_s']:10.3f} {h200:>7s} {measured:>9s} {error:>7s}  {kinds}", flush=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
