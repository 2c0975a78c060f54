"""Step times predicted from the program XLA compiles for an H100, without one
(jaxpar.inspect.cost over a deviceless compile), for benchmarks/mfu.py's runs: the rows
measured on an H100 before, each beside its measurement, and shapes nobody has measured,
registered here before the battery (benchmarks/gpu_battery.py, section `predicted`) measures
them and reports each prediction's error.

  <venv with jax[cuda13]>/bin/python benchmarks/predict.py [--out benchmarks/results/predictions.json]

Registering: the file keeps the commit the predictions were made at; a prediction already
registered is kept as it was (the point is to have made it first), so re-running adds only
new shapes. --redo replaces them all (say why in the commit).
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
    measured_s: float | None = None  # on an H100 before this file existed (the table), or None
    measured_how: str = ""

    def mfu_flags(self) -> list[str]:
        return ["--remat", self.remat, "--batch", str(self.batch), "--seq-len", str(self.seq_len),
                "--matmul-dtype", self.matmul_dtype, *(["--unroll-layers"] if self.unroll_layers else [])]


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
UNMEASURED: list[Run] = []


def predict(run: Run, devices) -> dict:
    from benchmarks.mfu import SHAPE, jaxpar_config
    from jaxpar.inspect.cost import GpuCost, step_cost
    from jaxpar.train import build

    config = jaxpar_config(dict(SHAPE), run.batch, run.seq_len, run.remat, 1, run.matmul_dtype,
                           unroll_layers=run.unroll_layers)
    trainer = build(config, devices)
    t0 = time.perf_counter()
    text = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile().as_text()
    cost = step_cost(text, GpuCost())
    flops = config.model.flops_per_token(run.seq_len) * run.batch * run.seq_len
    return {"predicted_s": cost.seconds, "predicted_mfu": flops / cost.seconds / (GpuCost().bf16_tflops * 1e12),
            "by_kind_s": cost.by_kind(), "kernels": cost.to_json()["kernels"],
            "compile_s": round(time.perf_counter() - t0, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/predictions.json")
    p.add_argument("--redo", action="store_true", help="replace registered predictions too")
    args = p.parse_args()
    from jaxpar.deviceless import gpu_devices

    devices = gpu_devices(str(ROOT / TARGET))[:1]
    import jax

    from jaxpar.inspect.cost import GpuCost

    out = ROOT / args.out if not pathlib.Path(args.out).is_absolute() else pathlib.Path(args.out)
    old = json.loads(out.read_text()) if out.exists() and not args.redo else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    doc = {"about": __doc__.split("\n\n")[0].replace("\n", " "), "gpu": GpuCost().describe(), "target": TARGET,
           "measured": {}, "registered": old.get("registered", {}), "checked": old.get("checked", {})}
    print(f"{'run':24s} {'predicted':>10s} {'measured':>9s} {'error':>7s}  by kind (ms)")
    for run in MEASURED + UNMEASURED:
        if run.measured_s is None and run.name in doc["registered"]:
            row = doc["registered"][run.name]
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
        print(f"{run.name:24s} {row['predicted_s']:10.3f} {measured:>9s} {error:>7s}  {kinds}", flush=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
