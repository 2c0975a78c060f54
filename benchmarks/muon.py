"""Muon against AdamW: steps to a loss, and what a step costs.

1. `--train` (CPU is enough): fine-tune the tiny Hugging Face Llama (tests/golden/llama_tied)
   on the shipped text (tests/golden/corpus.txt) for --steps steps on fsdp 2 x tensor 4 (so
   Muon's matrices are orthogonalised in pieces made whole), each optimizer at each of its
   learning rates. Its tuned rate is the one with the lowest final loss (mean of the last
   SMOOTH steps); the table gives, at the tuned rates, the steps each needs to reach LEVELS.
   The tuned rate reaches the last level first (then: the lowest final loss).
2. `--target benchmarks/targets/h100.pbtxt` (a venv with `jax[cuda13]`, no GPU): the 0.9B
   Llama of benchmarks/mfu.py compiled for 8 H100s (fsdp 8, bf16, remat full) with AdamW and
   with Muon (float32 and bfloat16 iterations, parameters cut alike joined or each alone:
   VARIANTS): the cost model's step time, the compiled peak, Muon's Newton-Schulz FLOPs and
   exchanged elements per device (explain's rows), and the share of its collectives' time
   that compute scheduled beside them covers.

  JAX_PLATFORMS=cpu python benchmarks/muon.py --train [--steps 200] [--out benchmarks/results/muon.json]
  <cuda venv>/bin/python benchmarks/muon.py --target benchmarks/targets/h100.pbtxt \\
      [--out benchmarks/results/muon_compile.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
FINETUNE = ["mesh.fsdp=2", "mesh.tensor=4", "data.source=text", f"data.path={ROOT}/tests/golden/corpus.txt",
            "data.order=epochs", "train.global_batch=8", "train.seq_len=64", "optim.warmup_steps=10"]
RATES = {"adamw": (3e-3, 1e-2, 3e-2), "muon": (3e-3, 1e-2, 3e-2, 1e-1)}
# The corpus is 2,282 tokens: the fine-tune learns it by heart, so the levels go far down.
LEVELS = (2.0, 1.0, 0.5, 0.25, 0.1)
SMOOTH = 5
SHAPE = ["model.vocab_size=32000", "model.embed=2048", "model.num_layers=16", "model.num_heads=16",
         "model.num_kv_heads=8", "model.head_dim=128", "model.mlp=5632"]
COMPILED = ["mesh.fsdp=8", "train.compute_dtype=bfloat16", "train.global_batch=16", "train.seq_len=2048",
            "model.remat=full", "parallel.attention=cudnn"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", action="store_true", help="section 1: the fine-tune's curves")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--target", help="section 2: a GPU target (benchmarks/targets/h100.pbtxt)")
    p.add_argument("--out", help="the JSON to write")
    return p.parse_args()


def curve(optimizer: str, lr: float, steps: int) -> list[float]:
    from jaxpar.loop.run import run
    from jaxpar.recipes import resolve_config
    from jaxpar.train import build

    config = resolve_config(f"hf:{ROOT}/tests/golden/llama_tied",
                            [*FINETUNE, f"optim.name={optimizer}", f"optim.lr={lr}", f"train.steps={steps}"], 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [h["loss"] for h in run(build(config), progress=False)]


def steps_to(losses: list[float], level: float) -> int | None:
    """The first step whose loss, averaged over the SMOOTH steps ending there, is at or below `level`."""
    for i in range(SMOOTH, len(losses) + 1):
        if sum(losses[i - SMOOTH:i]) / SMOOTH <= level:
            return i
    return None


def train(steps: int) -> dict:
    from jaxpar.mesh import force_cpu_devices

    force_cpu_devices(8)  # the layout's 8 devices, where no 8 GPUs are
    runs = {}
    for optimizer, rates in RATES.items():
        for lr in rates:
            t0 = time.time()
            losses = curve(optimizer, lr, steps)
            runs[f"{optimizer} {lr:g}"] = {"optimizer": optimizer, "lr": lr, "losses": losses,
                                            "final": sum(losses[-SMOOTH:]) / SMOOTH, "seconds": time.time() - t0}
            print(f"{optimizer} lr {lr:g}: final loss {runs[f'{optimizer} {lr:g}']['final']:.3f} "
                  f"({time.time() - t0:.0f} s)", file=sys.stderr)
    def rank(r: dict) -> tuple:
        reached = steps_to(r["losses"], LEVELS[-1])
        return (reached is None, reached or 0, r["final"])

    tuned = {o: min((r for r in runs.values() if r["optimizer"] == o), key=rank) for o in RATES}
    table = {o: {"lr": r["lr"], "final": r["final"], **{str(level): steps_to(r["losses"], level) for level in LEVELS}}
             for o, r in tuned.items()}
    print(f"\nfine-tune of tests/golden/llama_tied on tests/golden/corpus.txt, {steps} steps, fsdp 2 x tensor 4: "
          "steps to a training loss (mean of 5) at each optimizer's tuned learning rate")
    print(f"{'optimizer':<10}{'tuned lr':>10}{'final':>8}" + "".join(f"{'<= ' + str(v):>9}" for v in LEVELS))
    for o, row in table.items():
        print(f"{o:<10}{row['lr']:>10g}{row['final']:>8.3f}" + "".join(f"{str(row[str(v)]):>9}" for v in LEVELS))
    return {"steps": steps, "layout": FINETUNE, "levels": LEVELS, "runs": runs, "tuned": table}


# The compiled rows: AdamW; Muon; Muon iterating in bfloat16 (optim.ns_dtype); and Muon with
# each parameter's stack orthogonalised alone (`apart`), as before parameters cut alike joined.
VARIANTS = {"adamw": ["optim.name=adamw"], "muon": ["optim.name=muon"],
            "muon_bf16": ["optim.name=muon", "optim.ns_dtype=bfloat16"], "muon_apart": ["optim.name=muon"]}


@contextlib.contextmanager
def apart():
    """Each parameter its own stack: share_groups (where the step and explain read it) split
    into groups of one, for the side-by-side row."""
    import jaxpar.inspect.optimizer as explained
    import jaxpar.step.muon as step

    joined = step.share_groups
    alone = lambda matrices, shapes: [[p] for group in joined(matrices, shapes) for p in group]  # noqa: E731
    step.share_groups = explained.share_groups = alone
    try:
        yield
    finally:
        step.share_groups = explained.share_groups = joined


def compiled(target: str) -> dict:
    from jaxpar.deviceless import gpu_devices
    from jaxpar.inspect import inspect_step
    from jaxpar.inspect.explain import explain
    from jaxpar.recipes import resolve_config
    from jaxpar.train import build

    devices = gpu_devices(target, "1x1x8")  # before JAX starts a backend
    rows = {}
    for name, overrides in VARIANTS.items():
        config = resolve_config("llama", [*SHAPE, *COMPILED, *overrides], len(devices))
        t0 = time.time()
        with apart() if name == "muon_apart" else contextlib.nullcontext():
            trainer = build(config, devices)
            report = inspect_step(trainer)
            doc = explain(trainer, report)
        predicted = report.predicted or {}
        rows[name] = {
            "overrides": overrides, "step_s": predicted.get("seconds"), "by_kind_s": predicted.get("by_kind"),
            "peak_gib": report.memory.peak / 2**30, "compile_s": time.time() - t0,
            "newton_schulz_flops": doc.get("muon_flops"), "exchanged_elements": doc.get("muon_traffic"),
            "muon_formula": doc.get("muon_formula"), "muon_cover": predicted.get("muon_cover"),
        }
        print(f"{name}: predicted step {rows[name]['step_s'] * 1e3:.1f} ms", file=sys.stderr)
    print(table(rows))
    return {"target": target, "shape": SHAPE, "layout": COMPILED, "optimizers": rows}


def table(rows: dict) -> str:
    """The compiled rows side by side, as docs/muon.md shows them."""
    adamw = rows["adamw"]["step_s"]
    lines = ["\n0.9B Llama on 8 H100s (fsdp 8, deviceless, the cost model)",
             f"{'':12s} {'step':>9s} {'x AdamW':>8s} {'GEMMs':>8s} {'memory':>8s} {'peak':>9s} {'NS TFLOP':>9s} "
             f"{'exchanged':>10s} {'covered':>8s}"]
    for name, r in rows.items():
        kinds, flops, sent = r["by_kind_s"] or {}, r["newton_schulz_flops"], r["exchanged_elements"]
        cover = (r["muon_cover"] or {}).get("share")
        lines.append(f"{name:12s} {r['step_s'] * 1e3:7.1f}ms {r['step_s'] / adamw:7.3f}x "
                     f"{kinds.get('gemm', 0) * 1e3:6.1f}ms "
                     f"{kinds.get('memory', 0) * 1e3:6.1f}ms {r['peak_gib']:6.2f}GiB "
                     f"{flops['measured'] / 1e12 if flops else 0:9.2f} {sent['measured'] / 1e6 if sent else 0:9.1f}M "
                     f"{'' if cover is None else f'{cover:.0%}':>8s}")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.train == bool(args.target):
        raise SystemExit("give --train (the fine-tune's curves, on this machine's devices) or --target (the compiled "
                         "step's cost, deviceless GPUs): one process starts one backend")
    import jax

    out = {"jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
    if args.train:
        out["train"] = train(args.steps)
    if args.target:
        out["compiled"] = compiled(args.target)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
