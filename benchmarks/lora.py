"""LoRA against full fine-tuning, side by side in one process: the compiled step's model
state against its formula (2 bytes a frozen weight and 16 an adapter parameter, against
16 a parameter: ZeRO's mixed-precision Adam), its peak memory, and step time.

  python benchmarks/lora.py [--rank 16] [--batch 8] [--seq-len 2048] [--steps 10] [--warmup 3]
      [--out benchmarks/results/lora.json]
  python benchmarks/lora.py --tiny      # a toy shape on 8 CPU devices (fsdp 4 x tensor 2), to check the script

The model is benchmarks/mfu.py's 0.9B Llama in bf16 (remat none), on every device the run
has (one GPU: the whole model on it). Each way compiles once, runs --warmup steps untimed
and --steps timed ones; the table gives the median step. Model state comes from the
compiled step's shardings (`jaxpar explain`'s rows), peak memory from the compiler's
buffer assignment.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.mfu import SHAPE, TINY, jaxpar_config


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a toy shape, 8 CPU devices, 2 x 64 tokens a device")
    p.add_argument("--out", default="benchmarks/results/lora.json")
    return p.parse_args()


def measure(config, steps: int, warmup: int) -> dict:
    import jax

    from jaxpar.data.sources import make_source
    from jaxpar.inspect.explain import explain
    from jaxpar.inspect.report import inspect_step
    from jaxpar.train import build

    trainer = build(config)
    t0 = time.perf_counter()
    report = inspect_step(trainer)
    compile_s = time.perf_counter() - t0
    rows = {r["name"]: r for r in explain(trainer, report)["memory"]}
    step = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    state = trainer.init()
    source = make_source(trainer.batch, config)
    times, losses = [], []
    for i in range(warmup + steps):
        batch = source(i)
        jax.block_until_ready(batch)
        start = time.perf_counter()
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))  # waits for the step
        if i >= warmup:
            times.append(time.perf_counter() - start)
    del state
    adapters = sum(x.size for x in jax.tree.leaves(trainer.abstract_state().params))
    frozen = sum(x.size for x in jax.tree.leaves(trainer.abstract_state().frozen or {}))
    step_s = statistics.median(times)
    tokens = config.train.global_batch * config.train.seq_len
    m = report.memory
    return {
        "trained_params": adapters, "frozen_params": frozen, "compile_s": round(compile_s, 1),
        "model_state_bytes": m.model_state, "model_state_formula_bytes": rows["model state"]["formula"],
        "model_state_ratio": round(rows["model state"]["ratio"], 4),
        "arguments_bytes": m.arguments, "temporaries_bytes": m.temporaries, "peak_bytes": m.peak,
        "step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s, 1),
        "first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4),
    }


def main() -> int:
    args = parse_args()
    if args.tiny:
        from jaxpar.mesh import force_cpu_devices

        force_cpu_devices(8)
    import tempfile

    import jax

    from jaxpar.config import apply_overrides
    from jaxpar.units import byte_size

    # explain's compile and the timed step's are one program: the second is read from here
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jaxpar-lora-bench-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    shape, batch, seq = (TINY, 16, 64) if args.tiny else (SHAPE, args.batch, args.seq_len)
    base = jaxpar_config(shape, batch, seq, "none", args.steps + args.warmup)
    layout = ["mesh.fsdp=4", "mesh.tensor=2"] if args.tiny else []
    ways = {"full": apply_overrides(base, layout),
            f"lora r={args.rank}": apply_overrides(base, layout + [f"lora.rank={args.rank}"])}
    results = {}
    for name, config in ways.items():
        results[name] = measure(config, args.steps, args.warmup)
        jax.clear_caches()
    devices = jax.devices()
    print(f"0.9B Llama{' (tiny shape)' if args.tiny else ''}, bf16, batch {batch} x {seq}, on {len(devices)} "
          f"{devices[0].device_kind}; median of {args.steps} steps after {args.warmup}")
    print("| way | trained params | model state (formula) | peak | step | tokens/s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['trained_params']:,} | {byte_size(r['model_state_bytes'])} "
              f"({byte_size(r['model_state_formula_bytes'])}) | {byte_size(r['peak_bytes'])} | {r['step_s'] * 1e3:.1f} ms | "
              f"{r['tokens_per_s']:,.0f} |")
    full, lora = results["full"], results[f"lora r={args.rank}"]
    print(f"lora / full: model state {lora['model_state_bytes'] / full['model_state_bytes']:.3f}, peak "
          f"{lora['peak_bytes'] / full['peak_bytes']:.3f}, step time {lora['step_s'] / full['step_s']:.3f}")
    out = {"shape": "tiny" if args.tiny else "0.9b", "rank": args.rank, "batch": batch, "seq_len": seq,
           "steps": args.steps, "warmup": args.warmup, "devices": len(devices), "platform": devices[0].platform,
           "device_kind": devices[0].device_kind, "jax": jax.__version__, "host": platform.node(), "ways": results,
           "date": time.strftime("%Y-%m-%d")}
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
