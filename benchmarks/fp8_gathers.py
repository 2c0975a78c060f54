"""ZeRO-3 weight gathers in FP8, read off the step compiled for 8 H100s without them: the
0.9B Llama of benchmarks/mfu.py (4 of its 16 layers, to compile quickly), fsdp 8, bf16
compute, once with bf16 matmuls and once with train.matmul_dtype=fp8. Each collective's
bytes per device per step by kind and element type, and the FP8 gathers against their
formula: the layers' projection weights (every stacked weight of two or more dimensions),
gathered forward and again backward, (n - 1) / n of them, one byte an element.

  <venv with jax[cuda13]>/bin/python benchmarks/fp8_gathers.py [--out benchmarks/results/fp8_gathers.json]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.mfu

LAYERS, DEVICES = 4, 8


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="benchmarks/targets/h100.pbtxt")
    p.add_argument("--out", default="benchmarks/results/fp8_gathers.json")
    args = p.parse_args()
    from jaxpar.deviceless import gpu_devices

    devices = gpu_devices(str(ROOT / args.target), f"1x1x{DEVICES}")
    import jax

    from benchmarks.mfu import SHAPE, jaxpar_config
    from jaxpar.config import apply_overrides
    from jaxpar.inspect import inspect_step
    from jaxpar.inspect.hlo import summarize
    from jaxpar.train import build

    doc = {"device": devices[0].device_kind, "devices": DEVICES, "layers": LAYERS, "jax": jax.__version__, "runs": {}}
    for matmuls in ("compute", "fp8"):
        config = apply_overrides(jaxpar_config(dict(SHAPE, num_layers=LAYERS), 8, 2048, "dots", 1, matmuls),
                                 ["mesh.data=1", f"mesh.fsdp={DEVICES}", "parallel.zero.stage=3"])
        trainer = build(config, devices)
        rows = summarize(inspect_step(trainer).collectives)
        doc["runs"][matmuls] = [{k: r[k] for k in ("kind", "dtype", "count", "bytes_per_step")} for r in rows]
        stacked = jax.tree.leaves(trainer.abstract_state().params["layers"])
        projections = sum(math.prod(x.shape) for x in stacked if x.ndim >= 3)  # [layers, in, out...]
    measured = sum(r["bytes_per_step"] for r in doc["runs"]["fp8"] if r["kind"] == "all-gather" and r["dtype"].startswith("f8"))
    formula = 2 * (DEVICES - 1) / DEVICES * projections
    doc.update(fp8_gather_bytes=measured, formula_bytes=formula, ratio=measured / formula)
    for matmuls, rows in doc["runs"].items():
        print(f"{matmuls} matmuls:")
        for r in rows:
            if r["bytes_per_step"] > 2**20:
                print(f"  {r['kind']:20s} {r['dtype']:10s} {r['count']:4d} ops {r['bytes_per_step'] / 2**20:9.1f} MiB")
    print(f"FP8 weight gathers: {measured / 2**20:.1f} MiB against the formula's {formula / 2**20:.1f} MiB "
          f"(2 x (n-1)/n x {projections / 1e6:.1f}M projection weights x 1 B): {measured / formula:.4f}")
    out = ROOT / args.out if not pathlib.Path(args.out).is_absolute() else pathlib.Path(args.out)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
