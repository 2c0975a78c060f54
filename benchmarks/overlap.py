"""The overlap report: compile the FSDP x TP (+SP) Llama step for 8 GPUs and read, from the
scheduled HLO, the share of collective bytes that run asynchronously with computation between
their start and done. Variants: XLA's defaults (compiler.preset=none), the overlap preset
(jaxpar.xla_options), and each with the sequence-parallel gathers and scatters as collective
matmuls (parallel.tensor.collective_matmul=ring).

  python benchmarks/overlap.py [--target benchmarks/targets/h100.pbtxt] [--out ...]

Nothing runs; the step is only compiled, by XLA's GPU compiler, in one of three ways:
  --target FILE   deviceless, for 8 GPUs described by a GpuTargetConfig (an H100 SXM is in
                  benchmarks/targets/): needs the CUDA plugin (pip install 'jax[cuda13]'),
                  not a GPU; the latency-hiding scheduler uses its analytical cost model
  on a GPU        for the mock topology --topology (jax_mock_gpu_topology; default 1x8x1:
                  a mock host holds as many GPUs as the machine, here one)
  otherwise       for 8 CPU devices, whose collectives are synchronous: the code path runs,
                  but the CPU share is 0 by construction and says nothing about GPUs
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.targets


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topology", help="GPU topology, slices x hosts x devices (default: 1x1x8 with --target, "
                   "one GPU a host on a GPU: 1x8x1)")
    p.add_argument("--target", help="GpuTargetConfig text file: compile for GPUs without one (deviceless)")
    p.add_argument("--collective-matmul", default="none,ring,bidirectional",
                   help="values of parallel.tensor.collective_matmul to compare")
    p.add_argument("--fsdp", type=int, default=4)
    p.add_argument("--tensor", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/overlap.json")
    return p.parse_args()


def model_config():
    """The 0.9B Llama of benchmarks/mfu.py in bf16, batch 16 x 2048."""
    from jaxpar.config import Config, TrainConfig
    from jaxpar.models.llama import LlamaConfig

    model = LlamaConfig(vocab_size=32000, embed=2048, num_layers=16, num_heads=16, num_kv_heads=8, head_dim=128, mlp=5632)
    return Config(model=model, train=TrainConfig(global_batch=16, seq_len=2048, compute_dtype="bfloat16"))


def report(trainer) -> dict:
    """Collective bytes per step by kind, and the share issued async with compute between."""
    from jaxpar.inspect import hlo

    text = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile().as_text()
    by_kind: dict[str, dict] = {}
    for c in hlo.collectives(text, trainer.mesh):
        row = by_kind.setdefault(c.kind, {"bytes": 0.0, "async_bytes": 0.0, "overlapped_bytes": 0.0, "count": 0})
        row["bytes"] += c.bytes_per_step
        row["async_bytes"] += c.bytes_per_step if c.is_async else 0
        row["overlapped_bytes"] += c.bytes_per_step if c.overlapped else 0
        row["count"] += 1
    total = sum(r["bytes"] for r in by_kind.values())
    overlapped = sum(r["overlapped_bytes"] for r in by_kind.values())
    return {"by_kind": by_kind, "bytes": total, "overlapped_share": overlapped / total if total else 0.0}


def devices_for(args):
    """The devices to compile for, and how they were found (before anything imports jax)."""
    if args.target:
        from jaxpar.deviceless import gpu_devices

        topology = args.topology or "1x1x8"
        devices = gpu_devices(args.target, topology)
        return devices, f"deviceless compile for {topology} x {devices[0].device_kind}"
    import jax

    # Both before the backends start: the mock topology shapes a GPU backend, the device
    # count a CPU one; whichever backend JAX picks reads its own. A mock host must hold as
    # many devices as the machine has (jaxlib 0.11.2 on one H200 refused 1x1x8: "The number
    # of devices per host in 'mock_gpu_topology' must be the same as the number of devices
    # in the local topology"), so on a one-GPU machine the 8 GPUs are 8 hosts of one.
    topology = args.topology or "1x8x1"
    jax.config.update("jax_mock_gpu_topology", topology)
    jax.config.update("jax_num_cpu_devices", args.fsdp * args.tensor)
    devices = jax.devices()
    if devices[0].platform == "gpu":
        return devices, f"mock topology {topology} on {devices[0].device_kind}"
    return devices, "no GPU: CPU devices, synchronous collectives (0% by construction); see --target"


def main() -> int:
    args = parse_args()
    devices, how = devices_for(args)
    import dataclasses

    import jax

    from jaxpar.config import apply_overrides
    from jaxpar.train import build

    base = model_config()
    sets = ["mesh.data=1", f"mesh.fsdp={args.fsdp}", f"mesh.tensor={args.tensor}", "parallel.tensor.sequence_parallel=true"]
    results = {"how": how, "platform": devices[0].platform, "devices": len(devices), "device_kind": devices[0].device_kind,
               "jax": jax.__version__, "layout": sets, "model": dataclasses.asdict(base.model), "variants": {}}
    print(f"{len(devices)} devices: {how}; {' '.join(sets)}")
    print(f"{'preset':8s} {'coll. matmul':12s} {'kind':20s} {'count':>5s} {'MiB/step':>10s} {'async':>7s} {'overlapped':>10s}")
    for matmul in args.collective_matmul.split(","):
        for preset in ("none", "overlap"):
            start = time.perf_counter()
            trainer = build(apply_overrides(base, sets + [f"compiler.preset={preset}", f"parallel.tensor.collective_matmul={matmul}"]), devices)
            found = report(trainer)
            found["compile_s"] = time.perf_counter() - start
            results["variants"][f"preset={preset},collective_matmul={matmul}"] = {**found, "options": trainer.compiler_options}
            for kind, row in sorted(found["by_kind"].items()):
                b = row["bytes"] or 1
                print(f"{preset:8s} {matmul:12s} {kind:20s} {row['count']:5d} {row['bytes'] / 2**20:10.1f} "
                      f"{row['async_bytes'] / b:7.1%} {row['overlapped_bytes'] / b:10.1%}")
            print(f"{preset:8s} {matmul:12s} {'all':20s} {'':5s} {found['bytes'] / 2**20:10.1f} {'':7s} "
                  f"{found['overlapped_share']:10.1%}", flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
