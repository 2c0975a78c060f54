"""Gradient compression (parallel.gradient_compression) on CPU virtual devices: the bytes that
cross hosts, and what compression does to the loss.

  1. bytes (compiled): the `llama` recipe over two simulated hosts (mesh.data=2 across,
     fsdp 2 x tensor 2 inside, ZeRO-0), uncompressed and with each compressor. Per device per
     step: bytes crossing hosts in the compiled program (jaxpar.inspect) beside
     Compressor.cross_host_bytes(), the formula, and the ratio to uncompressed.
  2. bytes at scale (formula only, nothing compiled): the same layouts for TinyLlama-1.1B's
     and Llama-2-7B's shapes on two hosts of 8 devices, where the ratios are the ones a
     real run sees.
  3. loss (training): the recipe on the same layout for --steps steps (default 300),
     uncompressed and compressed; the mean loss of the last 10 steps of each and its ratio
     to uncompressed, and a PNG of the curves.

  python benchmarks/compression.py [--steps 300] [--out benchmarks/results/compression.json]
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.gpu_checks import write  # noqa: E402  (the atomic JSON writer)
from jaxpar.mesh import force_cpu_devices  # noqa: E402

TWO_HOSTS = ["mesh.data=2", "mesh.hosts.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.zero_stage=0"]
METHODS = {
    "none": [],
    "powersgd r4": ["parallel.gradient_compression=powersgd", "parallel.powersgd_rank=4"],
    "powersgd r1": ["parallel.gradient_compression=powersgd", "parallel.powersgd_rank=1"],
    "topk 1%": ["parallel.gradient_compression=topk", "parallel.topk_fraction=0.01"],
    "topk 10%": ["parallel.gradient_compression=topk", "parallel.topk_fraction=0.1"],
}
SHAPES = {  # name -> (LlamaConfig fields, the in-host layout on 8 devices)
    "TinyLlama-1.1B": (dict(vocab_size=32000, embed=2048, num_layers=22, num_heads=32, num_kv_heads=4, head_dim=64,
                            mlp=5632), ["mesh.fsdp=8", "mesh.tensor=1"]),
    "Llama-2-7B": (dict(vocab_size=32000, embed=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                        mlp=11008), ["mesh.fsdp=4", "mesh.tensor=2"]),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="benchmarks/results/compression.json")
    p.add_argument("--png", default="benchmarks/results/compression.png")
    return p.parse_args()


def build(config, devices=None):
    """The trainer on 8 devices (16 are forced, for the scale table)."""
    import jax

    from jaxpar.train import build as build_on

    return build_on(config, devices or jax.devices()[:8])


def measured_bytes(recipe) -> list[dict]:
    from jaxpar.config import apply_overrides
    from jaxpar.inspect import inspect_step

    rows = []
    for name, overrides in METHODS.items():
        trainer = build(apply_overrides(recipe, overrides))
        report = inspect_step(trainer)
        formula = trainer.compressor.cross_host_bytes() if trainer.compressor else None
        rows.append(dict(method=name, cross_host_bytes=report.cross_host_bytes(),
                         formula=formula["compressed"] if formula else None,
                         uncompressed_formula=formula["uncompressed"] if formula else None,
                         compile_seconds=round(report.compile_seconds, 1)))
    for r in rows:
        r["vs_uncompressed"] = r["cross_host_bytes"] / rows[0]["cross_host_bytes"]
    return rows


def bytes_at_scale() -> list[dict]:
    """Compressor.cross_host_bytes at real shapes: built, nothing compiled."""
    import jax

    from jaxpar.config import Config, TrainConfig, apply_overrides
    from jaxpar.mesh import MeshConfig
    from jaxpar.models.llama import LlamaConfig

    rows = []
    for model, (fields, inside) in SHAPES.items():
        base = Config(model=LlamaConfig(**fields), mesh=MeshConfig(data=2),
                      train=TrainConfig(global_batch=16, seq_len=2048, compute_dtype="bfloat16"))
        for name, overrides in list(METHODS.items())[1:]:
            config = apply_overrides(base, ["mesh.data=2", "mesh.hosts.data=2", *inside, *overrides])
            c = build(config, jax.devices()[:16]).compressor.cross_host_bytes()
            rows.append(dict(model=model, layout=" ".join(inside), method=name, compressed=c["compressed"],
                             uncompressed=c["uncompressed"], ratio=c["uncompressed"] / c["compressed"]))
    return rows


def losses(recipe, steps: int) -> dict[str, list[float]]:
    from jaxpar.config import apply_overrides
    from jaxpar.train.loop import run

    curves = {}
    for name, overrides in METHODS.items():
        config = apply_overrides(recipe, [*overrides, f"train.steps={steps}"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.time()
            history = run(build(config), progress=True)
        curves[name] = [h["loss"] for h in history]
        print(f"{name}: {steps} steps in {time.time() - t0:.0f} s", file=sys.stderr)
    return curves


def draw(curves: dict[str, list[float]], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, label=name, linewidth=1.2 if name == "none" else 0.9)
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    args = parse_args()
    force_cpu_devices(16)
    import jax

    from jaxpar import recipes
    from jaxpar.config import apply_overrides

    recipe = apply_overrides(recipes.load("llama"), TWO_HOSTS)
    compiled = measured_bytes(recipe)
    scale = bytes_at_scale()
    curves = losses(recipe, args.steps)
    tail = {k: sum(v[-10:]) / len(v[-10:]) for k, v in curves.items()}
    loss_rows = [dict(method=k, last10_mean_loss=v, vs_uncompressed=v / tail["none"]) for k, v in tail.items()]

    psi = sum(x.size for x in jax.tree.leaves(build(recipe).abstract_state().params))
    print(f"\nllama recipe ({psi / 1e6:.2f}M params), 2 hosts x (fsdp 2 x tensor 2), ZeRO-0: per device per step, compiled")
    print(f"{'method':<12} {'cross-host KiB':>15} {'formula KiB':>12} {'vs none':>8} {'1/x':>6}")
    for r in compiled:
        formula = f"{r['formula'] / 1024:.1f}" if r["formula"] is not None else "-"
        print(f"{r['method']:<12} {r['cross_host_bytes'] / 1024:>15.1f} {formula:>12} {r['vs_uncompressed']:>8.4f} "
              f"{1 / r['vs_uncompressed']:>6.1f}")
    print("\nat scale, 2 hosts x 8 devices, per device per step, formula (Compressor.cross_host_bytes)")
    print(f"{'model':<15} {'in-host layout':<24} {'method':<12} {'MiB':>9} {'uncompressed MiB':>17} {'1/x':>7}")
    for r in scale:
        print(f"{r['model']:<15} {r['layout']:<24} {r['method']:<12} {r['compressed'] / 2**20:>9.2f} "
              f"{r['uncompressed'] / 2**20:>17.1f} {r['ratio']:>7.1f}")
    print(f"\nllama recipe, {args.steps} steps: mean loss of the last 10 steps")
    for r in loss_rows:
        print(f"{r['method']:<12} {r['last10_mean_loss']:.4f}   vs none {r['vs_uncompressed']:.4f}")

    drawn = draw(curves, args.png, f"llama recipe, 2 simulated hosts: gradient compression ({args.steps} steps)")
    out = pathlib.Path(args.out)
    payload = dict(layout=TWO_HOSTS, platform=platform.platform(), jax=jax.__version__, compiled_bytes=compiled,
                   bytes_at_scale=scale, loss=dict(steps=args.steps, final=loss_rows, curves=curves),
                   png=args.png if drawn else None,
                   command="python benchmarks/compression.py " + " ".join(sys.argv[1:]))
    write(payload, out)
    print(f"wrote {out}" + (f" and {args.png}" if drawn else ""))


if __name__ == "__main__":
    main()
