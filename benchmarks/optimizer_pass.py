"""The optimizer's passes over the gradient, read off the compiled 0.9B step (benchmarks/mfu.py's
shape: seq 2048, batch 8, remat dots, one device): the compiler's temporaries, the float32
parameter-shaped temporaries larger than a layer (whole stacked-layer gradients or moments
written by the update), and `jaxpar explain`'s findings.

  python benchmarks/optimizer_pass.py                       # XLA:CPU
  python benchmarks/optimizer_pass.py --target benchmarks/targets/h100.pbtxt   # an H100, deviceless

jaxpar.step.update divides, clips, updates and applies in one elementwise expression per
parameter. A GPU compile fuses it into one multi-output loop per parameter, which leaves no
such temporary; XLA:CPU has no multi-output loop fusion, so its program still holds some
(each new moment is its own loop, and the ones overwritten in place are copied first).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.targets


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="GpuTargetConfig file: compile for that GPU (deviceless; needs jax[cuda13])")
    p.add_argument("--out", help="JSON file (default: print only)")
    args = p.parse_args()
    if args.target:
        from jaxpar.deviceless import gpu_devices

        devices = gpu_devices(args.target)[:1]
    import jax

    from benchmarks.mfu import SHAPE, jaxpar_config
    from jaxpar.inspect.buffers import temporaries
    from jaxpar.inspect.report import temporary_findings
    from jaxpar.train import build
    from jaxpar.xla_options import layer_params

    devices = devices if args.target else jax.devices()[:1]
    trainer = build(jaxpar_config(dict(SHAPE), 8, 2048, "dots", 10), devices)
    compiled = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    text = compiled.as_text()
    layer_bytes = 4 * layer_params(trainer.config.model)  # one layer's parameters in float32
    f32 = [b for b in temporaries(text) if b.dtype == "f32" and b.bytes > layer_bytes]
    findings = [str(f) for f in temporary_findings(trainer, text)]
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    row = {"device": devices[0].device_kind, "jax": jax.__version__,
           "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
           "bytes_accessed": cost.get("bytes accessed"),  # None from a deviceless GPU compile
           "f32_temporaries": len(f32), "f32_temporary_bytes": sum(b.bytes for b in f32),
           "findings": findings}
    accessed = f", bytes accessed {row['bytes_accessed'] / 2**30:.1f} GiB" if row["bytes_accessed"] else ""
    print(f"0.9B step compiled for {row['device']} (jax {row['jax']}): "
          f"temporaries {row['temp_bytes'] / 2**30:.2f} GiB{accessed}")
    print(f"  float32 temporaries larger than a layer in float32 ({layer_bytes / 2**20:.0f} MiB): {len(f32)} ({row['f32_temporary_bytes'] / 2**30:.1f} GiB"
          " summed; buffers whose lives do not overlap share memory)")
    print("  explain's findings:" + "".join(f"\n    {f}" for f in findings) if findings else "  explain's findings: none")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(row, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
