"""The overlap report: compile the FSDP x TP (+SP) Llama step for a mock 8-GPU topology and
read, from the scheduled HLO, the share of collective bytes that run asynchronously with
computation between their start and done; once with XLA's defaults (compiler.preset=none)
and once with the overlap preset (jaxpar.xla_options).

  python benchmarks/overlap.py [--topology 1x1x8] [--out benchmarks/results/overlap.json]

Nothing runs: the step is compiled for the mock topology (`jax_mock_gpu_topology`), which
needs one real GPU. Without a GPU the same step is compiled for 8 CPU devices, whose
collectives are synchronous: the code path is exercised, but the CPU share is 0 by
construction and says nothing about GPUs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # recipes/, models/


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topology", default="1x1x8", help="mock GPU topology, slices x hosts x devices (default 1x1x8)")
    p.add_argument("--fsdp", type=int, default=4)
    p.add_argument("--tensor", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/overlap.json")
    return p.parse_args()


def model_config():
    """A 1.1B Llama in bf16 (the shape benchmarks/mfu.py trains), batch 16 x 2048."""
    from jaxpar.config import Config, TrainConfig
    from models.llama import LlamaConfig

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


def main() -> int:
    args = parse_args()
    import jax

    # Both before the backends start: the mock topology shapes a GPU backend, the device
    # count a CPU one; whichever backend JAX picks reads its own.
    jax.config.update("jax_mock_gpu_topology", args.topology)
    jax.config.update("jax_num_cpu_devices", args.fsdp * args.tensor)
    import dataclasses

    from jaxpar.config import apply_overrides
    from jaxpar.train import build

    devices = jax.devices()
    gpu = devices[0].platform == "gpu"
    base = model_config()
    sets = ["mesh.data=1", f"mesh.fsdp={args.fsdp}", f"mesh.tensor={args.tensor}", "parallel.sequence_parallel=true"]
    results = {"platform": devices[0].platform, "devices": len(devices), "device_kind": devices[0].device_kind,
               "jax": jax.__version__, "layout": sets, "model": dataclasses.asdict(base.model), "presets": {}}
    print(f"{len(devices)} {devices[0].platform} devices ({'mock topology ' + args.topology if gpu else 'no GPU: CPU'}); "
          f"{' '.join(sets)}")
    print(f"{'preset':8s} {'kind':20s} {'count':>5s} {'MiB/step':>10s} {'async':>7s} {'overlapped':>10s}")
    for preset in ("none", "overlap"):
        trainer = build(apply_overrides(base, sets + [f"compiler.preset={preset}"]), devices)
        found = report(trainer)
        results["presets"][preset] = {**found, "options": trainer.compiler_options}
        for kind, row in sorted(found["by_kind"].items()):
            b = row["bytes"] or 1
            print(f"{preset:8s} {kind:20s} {row['count']:5d} {row['bytes'] / 2**20:10.1f} "
                  f"{row['async_bytes'] / b:7.1%} {row['overlapped_bytes'] / b:10.1%}")
        print(f"{preset:8s} {'all':20s} {'':5s} {found['bytes'] / 2**20:10.1f} {'':7s} {found['overlapped_share']:10.1%}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
