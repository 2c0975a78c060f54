"""What the 0.9B Llama step (benchmarks/mfu.py's shape) spends beyond its matmuls, kernel
by kernel, on the program XLA compiles for an H100 without one (a deviceless compile):
each memory-bound kernel labelled by phase and by the Python line that made it
(jaxpar.inspect.kernel_table), summed, largest first; the predicted step (jaxpar.inspect.cost)
on an H100 and an H200; the scanned stack's own share (zero fills, stack writes and reads).

  <venv with jax[cuda13]>/bin/python benchmarks/step_kernels.py --label after
  <venv with jax[cuda13]>/bin/python benchmarks/step_kernels.py --label before --runs none,dots
  <venv with jax[cuda13]>/bin/python benchmarks/step_kernels.py --label "+ uninitialised stacks" \
      --set compiler.uninitialised_stacks=true

Each call adds its label (with the commit it ran on) to the JSON file, so one file holds the
step before and after a change, measured by the same script: run it on the old code with
`--label before`, then on the new. `--runs`: which of RUNS (default all); `--set`: jaxpar
config overrides for every run (an option's effect, labelled as its own column).
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
sys.path.insert(0, str(ROOT))  # benchmarks.mfu, benchmarks.predict

from benchmarks.predict import Run, compile_run  # noqa: E402

TARGET = "benchmarks/targets/h100.pbtxt"
RUNS = {run.name: run for run in (Run("none"), Run("dots", "dots"), Run("fp8_none", matmul_dtype="fp8"),
                                  Run("selective_b16", "selective", 16))}


def measure(name: str, devices, overrides: tuple[str, ...] = ()) -> dict:
    from jaxpar.inspect.cost import GpuCost, step_cost
    from jaxpar.inspect.kernel_table import kernel_rows, totals

    run = dataclasses.replace(RUNS[name], overrides=overrides)
    config, compiled, compile_s = compile_run(run, devices)
    text = compiled.as_text()
    flops = config.model.flops_per_token(run.seq_len) * run.batch * run.seq_len
    out = {"remat": run.remat, "batch": run.batch, "matmul_dtype": run.matmul_dtype, "compile_s": compile_s,
           "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30}
    for device in ("H100", "H200"):
        gpu = GpuCost.of(device)
        cost = step_cost(text, gpu)
        rows = kernel_rows(text, gpu, cost)
        out[device] = {"predicted_s": cost.seconds, "predicted_mfu": flops / cost.seconds / (gpu.bf16_tflops * 1e12),
                       "by_kind_s": cost.by_kind(), "memory_bound": totals(rows),
                       "table": [dataclasses.asdict(r) for r in rows[:30]]}
    return out


def main() -> int:
    from jaxpar.commands.common import add_overrides

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", required=True, help="this code's name in the file (before, after, ...)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    add_overrides(p, "compiler.uninitialised_stacks=true")  # every run's
    p.add_argument("--out", default="benchmarks/results/step_kernels.json")
    args = p.parse_args()
    runs = args.runs.split(",")
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise SystemExit(f"--runs {','.join(unknown)}: unknown; use any of {', '.join(RUNS)}")
    from jaxpar.deviceless import gpu_devices
    from jaxpar.inspect.kernel_table import Row, describe

    devices = gpu_devices(str(ROOT / TARGET))[:1]
    out = ROOT / args.out if not pathlib.Path(args.out).is_absolute() else pathlib.Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {"about": __doc__.split("\n\n")[0].replace("\n", " "),
                                                            "target": TARGET, "labels": {}}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=ROOT).stdout.strip())
    import jax

    entry = doc["labels"].setdefault(args.label, {})
    entry.update(commit=commit + ("+changes" if dirty else ""), jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                 overrides=args.overrides)
    for name in runs:
        row = measure(name, devices, tuple(args.overrides))
        entry.setdefault("runs", {})[name] = row
        h100 = row["H100"]
        print(f"\n{args.label} / {name}: predicted H100 step {h100['predicted_s'] * 1e3:.1f} ms "
              f"({h100['predicted_mfu']:.1%} MFU), H200 {row['H200']['predicted_s'] * 1e3:.1f} ms, "
              f"temp {row['temp_gib']:.1f} GiB", flush=True)
        print(describe([Row(**r) for r in h100["table"]], top=12, total=h100["memory_bound"]))
        out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
