"""How much of the expert all-to-alls' time compute hides, read off the step compiled for
2 hosts x 8 H100s (deviceless): a DeepSeek-like layer width (hidden 7168, 128 latent-attention
heads, experts of 2048 with 8 of 64 chosen, capacity routing at factor 1), 2 MoE layers after a
dense one, expert 8 over both hosts x data 2, ZeRO-1, full remat, 2 sequences of 2048 tokens
a device.

Per cell, each all-to-all's transfer at the cost model's link speeds (a share over NVLink,
the rest over the 400 Gb/s NIC, in parallel) against the compute XLA scheduled between its
start and done (jaxpar.inspect.cost.collective_covers), and the share of all-to-all time
so covered:

  xla          XLA's own schedule (its scheduler takes one small constant per collective)
  halves       parallel.two_batch_overlap: each layer on two halves of the rows
  costs        scheduled by jaxpar's cost model (explain --cost-profile: a second compile)
  halves+costs both
  two_hops     model.group_capacity=true: each of the 8 groups of 8 experts also has a
               capacity, and a token crosses to the other host once per group it chose (4)
               instead of once per expert (8): jaxpar.kernels.experts.two_hop
  two_hops+costs  and scheduled by jaxpar's costs

Attention is the reference kernel (one fused program; cuDNN's would be one call too): the
blockwise flash kernel is a loop, which the scheduler does not place beside a transfer
(`--attention flash` shows it). Nothing here ran on a GPU: these are the compiled schedules
and the cost model's times.

  <venv with jax[cuda13]>/bin/python benchmarks/expert_overlap.py [--out benchmarks/results/expert_overlap.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICES = 16
WIDE = ["model.embed=7168", "model.num_heads=128", "model.num_kv_heads=128", "model.head_dim=192",
        "model.q_lora_rank=1536", "model.kv_lora_rank=512", "model.qk_nope_head_dim=128", "model.qk_rope_head_dim=64",
        "model.v_head_dim=128", "model.mlp=2048", "model.dense_mlp=18432", "model.num_experts=64", "model.top_k=8",
        "model.expert_groups=8", "model.top_groups=4", "model.vocab_size=32768", "model.routing=capacity",
        "model.capacity_factor=1.0", "model.remat=full", "train.seq_len=2048", "train.global_batch=32",
        "train.loss_chunks=4", "mesh.expert=8", "mesh.hosts.expert=2", "mesh.data=2", "parallel.zero.stage=1"]
HOPS = ["model.group_capacity=true"]  # a token crosses to a host once per group (jaxpar.kernels.experts.two_hop)
CELLS = {"xla": ([], False), "halves": (["parallel.two_batch_overlap=true"], False), "costs": ([], True),
         "halves+costs": (["parallel.two_batch_overlap=true"], True), "two_hops": (HOPS, False),
         "two_hops+costs": (HOPS, True)}


def cell(config, devices, by_costs: bool) -> dict:
    """One compile (two with `by_costs`): the all-to-alls' cover and the predicted step."""
    from jaxpar.inspect import inspect_step
    from jaxpar.train import build

    report = inspect_step(build(config, devices), with_latency_profile=by_costs)
    if by_costs:
        with tempfile.NamedTemporaryFile("w", suffix=".pbtxt", delete=False) as f:
            f.write(report.latency_profile)
        option = f"xla_gpu_pgle_profile_file_or_directory_path={f.name}"
        config = dataclasses.replace(config, compiler=dataclasses.replace(config.compiler, options=option))
        report = inspect_step(build(config, devices))
        pathlib.Path(f.name).unlink()
    predicted = report.predicted
    return {"cover": predicted["all_to_all_cover"], "step_s": predicted["seconds"], "by_kind": predicted["by_kind"],
            "compile_s": report.compile_seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="benchmarks/targets/h100.pbtxt")
    p.add_argument("--attention", default="reference", help="parallel.attention of every cell")
    p.add_argument("--cells", default=",".join(CELLS), help=f"some of {', '.join(CELLS)}")
    p.add_argument("--out", default="benchmarks/results/expert_overlap.json")
    args = p.parse_args()
    from jaxpar.deviceless import gpu_devices

    devices = gpu_devices(str(ROOT / args.target), f"1x1x{DEVICES}")
    import jax

    from jaxpar.recipes import resolve_config

    doc = {"device": devices[0].device_kind, "devices": DEVICES, "hosts": 2, "jax": jax.__version__,
           "overrides": WIDE + [f"parallel.attention={args.attention}"], "cells": {}}
    print(f"{'cell':<14}{'all-to-all':>12}{'covered':>10}{'share':>8}{'step':>10}  (per step, cost model)")
    for name in args.cells.split(","):
        sets, by_costs = CELLS[name]
        t0 = time.perf_counter()
        config = resolve_config("deepseek", doc["overrides"] + sets, DEVICES)
        doc["cells"][name] = result = cell(config, devices, by_costs)
        c = result["cover"]
        print(f"{name:<14}{c['transfer_s'] * 1e3:>9.2f} ms{c['covered_s'] * 1e3:>7.2f} ms{c['share']:>8.0%}"
              f"{result['step_s'] * 1e3:>7.1f} ms  ({time.perf_counter() - t0:.0f} s)", flush=True)
    write_json(doc, args.out)
    return 0


def write_json(doc: dict, path: str) -> None:
    """The results, at `path` (relative to the repository)."""
    out = pathlib.Path(path) if pathlib.Path(path).is_absolute() else ROOT / path
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
