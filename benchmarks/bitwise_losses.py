"""The first losses of the shipped recipes under a spread of layouts, as exact floats: the
check that a refactor changed no arithmetic. Run it on the code before and after, and
compare the two files (`--against`): every case must be equal to the last bit.

  python benchmarks/bitwise_losses.py --out before.json          # on the old commit
  python benchmarks/bitwise_losses.py --out benchmarks/results/bitwise_losses.json --against before.json

On an older commit (a worktree of it), run the same script with that tree first on the
path: `PYTHONPATH=OLD_TREE python benchmarks/bitwise_losses.py --out before.json`, where
OLD_TREE/jaxpar holds links to OLD_TREE/models and OLD_TREE/recipes (the installed package
maps those folders to jaxpar.models and jaxpar.recipes). 8 CPU devices, 3 steps a case.
"""

from __future__ import annotations

import argparse
import json
import sys

CASES = {  # name: (recipe, overrides)
    "llama default": ("llama", []),
    "llama fsdp2 tensor4 zero3": ("llama", ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4", "parallel.zero.stage=3"]),
    "llama data8 zero1 microbatches2": ("llama", ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "parallel.zero.stage=1",
                                                  "train.microbatches=2"]),
    "llama_pp (recipe)": ("llama_pp", []),
    "llama_pp interleaved": ("llama_pp", ["parallel.pipeline.schedule=interleaved", "parallel.pipeline.chunks=2",
                                          "train.microbatches=4"]),
    "llama_long ulysses": ("llama_long", ["parallel.context.impl=ulysses", "train.seq_len=512"]),
    "moe (recipe)": ("moe", []),
    "mlp_dp (recipe)": ("mlp_dp", []),
    "deepseek (recipe)": ("deepseek", []),
    "llama powersgd": ("llama", ["mesh.data=2", "mesh.hosts.data=2", "mesh.fsdp=4", "mesh.tensor=1",
                                 "parallel.compression.method=powersgd", "train.compute_dtype=float32"]),
}


def losses(steps: int) -> dict[str, list[str]]:
    """Each case's losses as float.hex, so equality is to the bit."""
    from jaxpar.mesh import force_cpu_devices

    force_cpu_devices(8)
    try:
        from jaxpar.recipes import resolve_config
    except ImportError:  # before resolve_config moved to jaxpar.recipes
        from jaxpar.commands.common import resolve_config
    from jaxpar.train import build, run

    out = {}
    for name, (recipe, sets) in CASES.items():
        config = resolve_config(recipe, [*sets, f"train.steps={steps}", "train.log_every=0"], 8)
        out[name] = [float(r["loss"]).hex() for r in run(build(config), progress=False)]
        print(f"{name:34s} {' '.join(f'{float.fromhex(x):.6f}' for x in out[name])}", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--against", help="a file this script wrote on other code: every case must equal it")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    got = losses(args.steps)
    record = {"steps": args.steps, "losses": got}
    if args.against:
        before = json.load(open(args.against))
        before = before.get("losses", before)
        record["equal"] = {name: before.get(name) == value for name, value in got.items()}
        for name, same in record["equal"].items():
            print(f"{'equal' if same else 'DIFFERENT':9s} {name}")
    json.dump(record, open(args.out, "w"), indent=1)
    return 0 if all(record.get("equal", {}).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
