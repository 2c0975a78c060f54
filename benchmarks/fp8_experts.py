"""What FP8 does to the experts of a DeepSeek-like layer, read off the step compiled for
2 hosts x 8 H100s (deviceless; benchmarks/expert_overlap.py's layer and layout):

  bf16           the compute dtype everywhere
  dispatch       parallel.expert_dispatch_dtype=fp8: the dispatch all-to-all moves e4m3 and
                 a float32 scale per 128
  experts        and train.matmul_dtype=fp8: the projections per-tensor, the experts in
                 DeepSeek's tiles (train.fp8_expert_block=128)
  experts_rows   the experts with one scale per row and column (train.fp8_expert_block=0)

Per cell: the step's all-to-all bytes per device by element type, how many of its GEMMs
read FP8 operands, the all-to-alls' cover and the predicted step (jaxpar.inspect.cost).
Nothing here ran on a GPU: these are compiled programs and the cost model's times.

  <venv with jax[cuda13]>/bin/python benchmarks/fp8_experts.py [--out benchmarks/results/fp8_experts.json]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from expert_overlap import DEVICES, WIDE, write_json  # noqa: E402  (the same layer and layout)

FP8_EXPERTS = ["parallel.expert_dispatch_dtype=fp8", "train.matmul_dtype=fp8"]
CELLS = {"bf16": [], "dispatch": ["parallel.expert_dispatch_dtype=fp8"],
         "experts": [*FP8_EXPERTS, "train.fp8_expert_block=128"],
         "experts_rows": [*FP8_EXPERTS, "train.fp8_expert_block=0"]}


def cell(config, devices) -> dict:
    from jaxpar.inspect import inspect_step
    from jaxpar.train import build

    report = inspect_step(build(config, devices))
    moved: dict[str, float] = defaultdict(float)
    for c in report.collectives:
        if c.kind == "all-to-all":
            moved[c.dtype] += c.bytes_per_step
    predicted = report.predicted
    return {"all_to_all_bytes": dict(moved), "matmul_types": report.matmul_types,
            "fp8_matmuls": sum(n for t, n in report.matmul_types.items() if "f8" in t),
            "cover": predicted["all_to_all_cover"], "step_s": predicted["seconds"], "by_kind": predicted["by_kind"],
            "peak_gib": report.memory.peak / 2**30, "compile_s": report.compile_seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="benchmarks/targets/h100.pbtxt")
    p.add_argument("--cells", default=",".join(CELLS), help=f"some of {', '.join(CELLS)}")
    p.add_argument("--out", default="benchmarks/results/fp8_experts.json")
    args = p.parse_args()
    from jaxpar.deviceless import gpu_devices

    devices = gpu_devices(str(ROOT / args.target), f"1x1x{DEVICES}")
    import jax

    from jaxpar.recipes import resolve_config

    doc = {"device": devices[0].device_kind, "devices": DEVICES, "hosts": 2, "jax": jax.__version__,
           "overrides": WIDE + ["parallel.attention=reference"], "cells": {}}
    print(f"{'cell':<14}{'all-to-all':>12}{'of it 8-bit':>13}{'FP8 GEMMs':>11}{'covered':>9}{'step':>10}{'peak':>10}")
    for name in args.cells.split(","):
        t0 = time.perf_counter()
        config = resolve_config("deepseek", doc["overrides"] + CELLS[name], DEVICES)
        doc["cells"][name] = r = cell(config, devices)
        total = sum(r["all_to_all_bytes"].values())
        eight = sum(v for k, v in r["all_to_all_bytes"].items() if k in ("u8", "s8", "f8e4m3fn", "f8e5m2"))
        print(f"{name:<14}{total / 2**20:>8.0f} MiB{eight / 2**20:>9.0f} MiB{r['fp8_matmuls']:>11}"
              f"{r['cover']['share']:>9.0%}{r['step_s'] * 1e3:>7.1f} ms{r['peak_gib']:>6.1f} GiB"
              f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    write_json(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
