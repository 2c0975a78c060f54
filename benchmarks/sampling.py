"""Sampling speed with and without the key/value cache (jaxpar.generate.sample), side by side.

For each way, the same prompts (a batch of `--batch` rows of `--prompt` random tokens) are
continued by `--new` tokens, greedily: first once untimed (the compiles), then `--rounds`
timed calls, alternating the two ways each round. Before anything is timed the two ways'
tokens must be equal. Reports new tokens a second (rows x new tokens / wall time, the
median round) and the ratio of the two, measured in one process.

  python benchmarks/sampling.py [--recipe llama] [--shape recipe|0.9b] [--layout "mesh.tensor=4"] [--batch 8]
      [--prompt 64] [--new 64] [--rounds 5] [--dtype float32] [--devices 8]
      [--out benchmarks/results/sampling.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import platform
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxpar.mesh import force_cpu_devices


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="llama")
    p.add_argument("--shape", choices=["recipe", "0.9b"], default="recipe",
                   help="the recipe's model, or benchmarks/mfu.py's 0.9B Llama in its place (GPUs)")
    p.add_argument("--layout", default="mesh.tensor=4", help="--set overrides, space-separated")
    p.add_argument("--batch", type=int, default=8, help="prompts continued at once")
    p.add_argument("--prompt", type=int, default=64, help="tokens a prompt")
    p.add_argument("--new", type=int, default=64, help="new tokens a prompt")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="train.compute_dtype")
    p.add_argument("--devices", type=int, default=8, help="CPU devices to force (ignored on GPU)")
    p.add_argument("--out", default="benchmarks/results/sampling.json")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    force_cpu_devices(args.devices)
    import jax
    import numpy as np

    from jaxpar.recipes import resolve_config
    from jaxpar.commands.sample import sampling_config
    from jaxpar.testing import initial_state
    from jaxpar.train import build
    from jaxpar.generate.sample import generate_batch

    devices = jax.devices()
    config = resolve_config(args.recipe, args.layout.split() + [f"train.compute_dtype={args.dtype}"], len(devices))
    if args.shape == "0.9b":
        from benchmarks.mfu import SHAPE
        from jaxpar.models.llama import LlamaConfig

        config = dataclasses.replace(config, model=LlamaConfig(**SHAPE))
    config = sampling_config(config, len(devices), args.prompt + args.new)
    trainer = build(config, devices)
    params = initial_state(trainer).params
    vocab = config.model.vocab_size
    prompts = np.random.default_rng(0).integers(0, vocab, (args.batch, args.prompt)).tolist()

    def sample(cached: bool) -> list[list[int]]:
        return generate_batch(trainer, params, prompts, args.new, kv_cache=cached)

    firsts = {}
    for cached in (True, False):  # the compiles, untimed
        start = time.perf_counter()
        firsts[cached] = (sample(cached), time.perf_counter() - start)
    if firsts[True][0] != firsts[False][0]:
        raise SystemExit("sampling: the cached and recomputed tokens differ; nothing timed")
    seconds = {True: [], False: []}
    for r in range(args.rounds):
        for cached in ((True, False) if r % 2 == 0 else (False, True)):
            start = time.perf_counter()
            sample(cached)
            seconds[cached].append(time.perf_counter() - start)
    tokens = args.batch * args.new
    rows = {("kv cache" if cached else "no cache"): {
        "first_call_s": round(firsts[cached][1], 3), "median_s": round(statistics.median(s), 4),
        "tokens_per_s": round(tokens / statistics.median(s), 1), "rounds_s": [round(x, 4) for x in s]}
        for cached, s in seconds.items()}
    speedup = rows["kv cache"]["tokens_per_s"] / rows["no cache"]["tokens_per_s"]
    print(f"{args.recipe}{' (0.9B shape)' if args.shape == '0.9b' else ''} ({args.layout}, {args.dtype}) on {len(devices)} {devices[0].platform} devices: "
          f"{args.batch} prompts of {args.prompt} tokens, {args.new} new tokens each, greedy, tokens equal")
    print(f"| way | first call (compiles) | median of {args.rounds} | new tokens/s |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['first_call_s']:.2f} s | {row['median_s']:.3f} s | {row['tokens_per_s']:.0f} |")
    print(f"kv cache / no cache: {speedup:.2f}x new tokens/s")
    result = {"recipe": args.recipe, "shape": args.shape, "layout": args.layout, "dtype": args.dtype, "batch": args.batch,
              "prompt": args.prompt, "new": args.new, "rounds": args.rounds, "devices": len(devices),
              "platform": devices[0].platform, "device_kind": devices[0].device_kind, "jax": jax.__version__,
              "host": platform.node(), "cpus": __import__("os").cpu_count(), "tokens_equal": True, "ways": rows,
              "speedup": round(speedup, 2), "date": time.strftime("%Y-%m-%d")}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
