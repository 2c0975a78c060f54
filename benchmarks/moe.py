"""Mixture of experts on CPU virtual devices: all-to-all traffic against the formula, and
load balancing over training.

  1. traffic (compile only): the `moe` recipe's training step (fp32, so the CPU backend's
     collectives carry the model's own element type) at mesh.expert = 2, 4, 8 (the rest
     data) and capacity factors 1.0, 1.25, 2.0, plus dropless routing. Elements per device
     per all-to-all (the step's expert all-to-alls / (4 per MoE layer x layers)), against
     tokens x k x hidden x capacity factor (reference.md), tokens being one device's. The
     dropless rows show the padded exchange this backend needs: n x the formula.
  2. balance (run): the `moe` recipe trained on a Zipfian token stream (frequent tokens, as
     in text, pull the router towards a few experts) with no balancing, the Switch
     auxiliary loss at two weights, and bias balancing without an auxiliary loss. Expert load
     max / mean (1.0 is even), the share of (token, choice) pairs dropped at capacity
     factor 1.25, and the loss, early and late in training.

  python benchmarks/moe.py [--steps 150] [--out benchmarks/results/moe.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.targets

from jaxpar.mesh import force_cpu_devices  # noqa: E402

BALANCING = {
    "none": ["model.aux_loss_weight=0"],
    "aux loss 0.01": ["model.aux_loss_weight=0.01"],
    "aux loss 0.1": ["model.aux_loss_weight=0.1"],
    "bias 0.01, no aux loss": ["model.aux_loss_weight=0", "model.bias_update_rate=0.01"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150, help="training steps per balancing setting")
    p.add_argument("--out", default="benchmarks/results/moe.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    force_cpu_devices(8)
    import jax
    from tqdm import tqdm

    work = [(n, "capacity", f) for n in (2, 4, 8) for f in (1.0, 1.25, 2.0)] + [(n, "dropless", 1.0) for n in (2, 4, 8)]
    traffic = [traffic_row(n, routing, f) for n, routing, f in tqdm(work, desc="compile steps", leave=False)]
    with tempfile.TemporaryDirectory() as tmp:
        path = zipf_tokens(pathlib.Path(tmp) / "zipf.npy")
        balance = [balance_row(name, sets, path, args.steps) for name, sets in tqdm(BALANCING.items(), desc="train", leave=False)]
    doc = {
        "setup": {"recipe": "moe", "platform": jax.devices()[0].platform, "jax": jax.__version__,
                  "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"), "steps": args.steps},
        "traffic": traffic,
        "balance": balance,
    }
    print(render(doc))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {out}")


def recipe(overrides: list[str]):
    from jaxpar.config import apply_overrides
    from jaxpar.recipes import load

    return apply_overrides(load("moe"), overrides)


def traffic_row(n: int, routing: str, factor: float) -> dict:
    from jaxpar.inspect import inspect_step
    from jaxpar.inspect.explain import explain
    from jaxpar.train import build

    config = recipe([f"mesh.expert={n}", f"model.routing={routing}", f"model.capacity_factor={factor}",
                     "train.compute_dtype=float32"])
    trainer = build(config)
    doc = explain(trainer, inspect_step(trainer))
    row = doc["expert_traffic"]
    per = 4 * config.model.num_layers * config.train.microbatches
    return {
        "expert": n, "routing": routing, "capacity_factor": factor,
        "measured_per_all_to_all": row["measured"] / per, "formula_per_all_to_all": row["formula"] / per,
        "ratio": row["ratio"],
        "temporaries_bytes": next(r["measured"] for r in doc["memory"] if r["name"] == "temporaries (compiler)"),
    }


def zipf_tokens(path: pathlib.Path, vocab: int = 256, length: int = 300_000) -> pathlib.Path:
    """Half the time a Zipf(1.2) draw, half the time that draw's image under a per-token
    permutation of the previous token: text-like frequencies, some structure to learn."""
    import numpy as np

    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, vocab + 1) ** 1.2
    draws = rng.choice(vocab, size=length, p=p / p.sum())
    follow = rng.random(length) < 0.5
    successor = np.stack([rng.permutation(vocab) for _ in range(vocab)])
    tokens = np.empty(length, np.int64)
    tokens[0] = draws[0]
    for i in range(1, length):
        tokens[i] = successor[tokens[i - 1], draws[i]] if follow[i] else draws[i]
    np.save(path, tokens.astype(np.uint16))
    return path


def balance_row(name: str, overrides: list[str], path: pathlib.Path, steps: int) -> dict:
    from jaxpar.train import build
    from jaxpar.loop.run import run

    config = recipe(overrides + [f"train.steps={steps}", "data.source=tokens", f"data.path={path}"])
    history = run(build(config), progress=False)
    window = lambda key, lo, hi: statistics.fmean(r[key] for r in history[lo:hi])  # noqa: E731
    early, late = (1, 11), (steps - 20, steps)  # rows 1..10: steps 2-11 (a row's step counts the steps done)
    return {
        "setting": name, "overrides": overrides,
        "load_step0": history[0]["moe_load"],
        "load_early": window("moe_load", *early), "load_late": window("moe_load", *late),
        "peak_load": max(r["moe_load"] for r in history),
        "dropped_early": window("moe_dropped", *early), "dropped_late": window("moe_dropped", *late),
        "aux_loss_late": window("moe_aux_loss", *late),
        "loss_late": window("loss", *late) - config.model.aux_loss_weight * window("moe_aux_loss", *late)
        - config.model.z_loss_weight * window("moe_z_loss", *late),
        "load_curve": [r["moe_load"] for r in history],
    }


def render(doc: dict) -> str:
    lines = ["expert all-to-all per MoE layer: elements per device per all-to-all, compiled `moe` step (fp32)",
             f"{'expert':>7}{'routing':>10}{'factor':>8}{'measured':>12}{'formula':>12}{'ratio':>8}{'temp MiB':>10}"]
    for r in doc["traffic"]:
        lines.append(f"{r['expert']:>7}{r['routing']:>10}{r['capacity_factor']:>8.2f}{r['measured_per_all_to_all']:>12,.0f}"
                     f"{r['formula_per_all_to_all']:>12,.0f}{r['ratio']:>8.3f}{r['temporaries_bytes'] / 2**20:>10.2f}")
    steps = doc["setup"]["steps"]
    lines += ["", f"load balancing on Zipfian tokens, `moe` recipe, {steps} steps: expert load max / mean (1.0 even)",
              f"{'setting':<24}{'step 1':>8}{'2-11':>8}{'peak':>8}{'last 20':>9}{'dropped 2-11':>14}{'dropped last 20':>17}{'CE loss last 20':>17}"]
    for r in doc["balance"]:
        lines.append(f"{r['setting']:<24}{r['load_step0']:>8.3f}{r['load_early']:>8.3f}{r['peak_load']:>8.3f}{r['load_late']:>9.3f}"
                     f"{r['dropped_early']:>14.1%}{r['dropped_late']:>17.1%}{r['loss_late']:>17.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
