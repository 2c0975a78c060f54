"""Gradient compression (parallel.compression.method) on CPU virtual devices: the bytes that
cross hosts, what compression does to learning, and when it pays.

  1. bytes (compiled): the `llama` recipe over two simulated hosts (mesh.data=2 across,
     fsdp 2 x tensor 2 inside, ZeRO-0), uncompressed and with each compressor. Per device per
     step: bytes crossing hosts in the compiled program (jaxpar.inspect) beside
     Compressor.cross_host_bytes(), the formula, and the ratio to uncompressed (ZeRO-0,
     whose uncompressed step all-reduces; ZeRO 1-3 reduce-scatter, half the bytes, so the
     ratios halve there).
  2. bytes at scale (formula only, nothing compiled): the same layouts for TinyLlama-1.1B's
     and Llama-2-7B's shapes on two hosts of 8 devices, where the ratios are the ones a
     real run sees.
  3. learning (training): the tiny Hugging Face Llama (tests/golden/llama_tied) fine-tuned on
     the shipped text (tests/golden/corpus.txt) on the same layout for --steps steps (default
     300), which keeps learning for the whole run; per method, the steps it takes to reach
     each of LEVELS (the training loss, mean of 5 steps), and a PNG of the curves.
  4. when it pays (estimated): at the scale shapes, the time per step at 25, 100 and 400
     Gb/s per GPU across hosts: compute from the H200 battery's measured throughput
     (benchmarks/results/gpu_battery_h200_jax0.11.2.json: tokens/s at its MFU, scaled by
     FLOPs), wire time from section 2's bytes, both without overlap and with the wire
     wholly hidden; and the time to reach each loss level, the steps of section 3 times
     that step time. The compressors' own compute is not in it (unmeasured on a GPU).

  python benchmarks/compression.py [--steps 300] [--out benchmarks/results/compression.json]
  python benchmarks/compression.py --target benchmarks/targets/h100.pbtxt   # the schedule, below

  --target FILE: instead, compile the compressed step of a 0.5B Llama for 2 hosts x 4 GPUs
  that FILE describes, deviceless (a venv with jax[cuda13]: docs/xla_options.md), and report
  from its scheduled HLO where the compressor's collectives run and the share of their bytes
  XLA issued asynchronously and overlapped with compute (`jaxpar explain`'s row); writes
  benchmarks/results/compression_schedule.json.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_checks import write  # noqa: E402  (the atomic JSON writer)

TWO_HOSTS = ["mesh.data=2", "mesh.hosts.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.zero.stage=0"]
METHODS = {
    "none": [],
    "powersgd r4": ["parallel.compression.method=powersgd", "parallel.compression.powersgd_rank=4"],
    "powersgd r1": ["parallel.compression.method=powersgd", "parallel.compression.powersgd_rank=1"],
    "topk 1%": ["parallel.compression.method=topk", "parallel.compression.topk_fraction=0.01"],
    "topk 10%": ["parallel.compression.method=topk", "parallel.compression.topk_fraction=0.1"],
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
    p.add_argument("--target", help="GpuTargetConfig file: only the deviceless schedule (see above)")
    return p.parse_args()


SCHEDULE_MODEL = dict(vocab_size=32000, embed=1024, num_layers=8, num_heads=8, num_kv_heads=8, head_dim=128, mlp=2816)


def schedule_setup(target: str) -> tuple[list, object]:
    """(2 hosts x 4 GPUs that `target` describes, deviceless; the 0.5B Llama's config, bf16,
    batch 16 x 1024): what the --target schedules of this benchmark and benchmarks/diloco.py
    compile. Call it before anything imports jax."""
    from jaxpar.deviceless import gpu_devices

    devices = gpu_devices(target, "1x2x4")
    from jaxpar.config import Config, TrainConfig
    from jaxpar.models.llama import LlamaConfig

    return devices, Config(model=LlamaConfig(**SCHEDULE_MODEL),
                           train=TrainConfig(global_batch=16, seq_len=1024, compute_dtype="bfloat16"))


def schedule(target: str, out: pathlib.Path) -> None:
    """The deviceless GPU compile (--target): each compressor at ZeRO-0 and -3."""
    devices, base = schedule_setup(target)
    import jax

    from jaxpar.config import apply_overrides
    from jaxpar.inspect import inspect_step
    from jaxpar.inspect.explain import explain
    from jaxpar.train import build as build_on

    rows = []
    print(f"{'method':<12} {'ZeRO':>4}  {'collectives':>11} {'async':>6} {'overlapped':>10}  where")
    for name, overrides in list(METHODS.items())[1:]:
        for stage in (0, 3):
            config = apply_overrides(base, ["mesh.data=2", "mesh.hosts.data=2", "mesh.fsdp=4",
                                            f"parallel.zero.stage={stage}", *overrides])
            trainer = build_on(config, devices)
            doc = explain(trainer, inspect_step(trainer))
            row = dict(method=name, zero_stage=stage, **doc["compressed_schedule"],
                       bytes=doc["compressed_traffic"]["measured"], options=trainer.compiler_options)
            rows.append(row)
            print(f"{name:<12} {stage:>4}  {row['collectives']:>11} {row['async_share']:>6.0%} "
                  f"{row['overlapped_share']:>10.0%}  {row['where']}", flush=True)
    write(dict(how=f"deviceless compile for 1x2x4 x {devices[0].device_kind} ({target})", jax=jax.__version__,
               model=SCHEDULE_MODEL, layout="mesh.data=2 (one per host) x fsdp=4, bf16, batch 16 x 1024", rows=rows,
               command="python benchmarks/compression.py --target " + target), out)
    print(f"wrote {out}")


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
        params = LlamaConfig(**fields).param_count()
        for name, overrides in METHODS.items():
            config = apply_overrides(base, ["mesh.data=2", "mesh.hosts.data=2", *inside, *overrides])
            compressor = build(config, jax.devices()[:16]).compressor
            c = (compressor or build(apply_overrides(config, list(METHODS.values())[1]), jax.devices()[:16]).compressor
                 ).cross_host_bytes()
            sent = c["compressed"] if compressor else c["uncompressed"]
            rows.append(dict(model=model, params=params, layout=" ".join(inside), method=name, compressed=sent,
                             uncompressed=c["uncompressed"], ratio=c["uncompressed"] / sent))
    return rows


FINETUNE = ["data.source=text", f"data.path={ROOT}/tests/golden/corpus.txt", "data.order=epochs",
            "train.global_batch=8", "train.seq_len=64", "optim.lr=1e-3"]
LEVELS = (3.0, 2.0, 1.5, 1.25)  # training losses whose first crossing section 3 reports
SMOOTH = 5  # steps averaged before a level counts as reached
BANDWIDTHS_GBIT = (25, 100, 400)
TOKENS_PER_GPU = 8192  # section 4's batch: 2 x 4096 tokens per GPU
BATTERY = "benchmarks/results/gpu_battery_h200_jax0.11.2.json"


def losses(steps: int) -> dict[str, list[float]]:
    """Each method's training losses on the fine-tune (section 3)."""
    from jaxpar.recipes import resolve_config
    from jaxpar.loop.run import run

    curves = {}
    for name, overrides in METHODS.items():
        config = resolve_config(f"hf:{ROOT}/tests/golden/llama_tied", [*TWO_HOSTS, *FINETUNE, *overrides,
                                                                       f"train.steps={steps}"], 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.time()
            history = run(build(config), progress=True)
        curves[name] = [h["loss"] for h in history]
        print(f"{name}: {steps} steps in {time.time() - t0:.0f} s", file=sys.stderr)
    return curves


def steps_to(curve: list[float], level: float) -> int | None:
    """The first step whose loss, averaged over the SMOOTH steps ending there, is at or
    below `level` (None: never)."""
    for i in range(SMOOTH, len(curve) + 1):
        if sum(curve[i - SMOOTH:i]) / SMOOTH <= level:
            return i
    return None


def step_times(scale: list[dict], battery: dict) -> list[dict]:
    """Section 4: per scale row, the compute time of one step (6 x params x tokens at the
    battery's measured FLOP rate per GPU) and the wire time at each bandwidth."""
    jaxpar = battery["summary"]["jaxpar_bf16"]
    flops_per_s = jaxpar["mfu"] * 989e12  # the battery's MFU is over an H100/H200's dense bf16 peak
    rows = []
    for r in scale:
        compute = 6 * r["params"] * TOKENS_PER_GPU / flops_per_s
        for gbit in BANDWIDTHS_GBIT:
            wire = r["compressed"] / (gbit / 8 * 1e9)
            rows.append(dict(model=r["model"], method=r["method"], gbit=gbit, compute_s=compute, wire_s=wire,
                             step_s=compute + wire, step_overlapped_s=max(compute, wire)))
    return rows


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
    if args.target:
        return schedule(args.target, ROOT / "benchmarks/results/compression_schedule.json")
    from jaxpar.mesh import force_cpu_devices  # imports jax: after --target's devices are set up

    force_cpu_devices(16)
    import json

    import jax

    from jaxpar import recipes
    from jaxpar.config import apply_overrides

    recipe = apply_overrides(recipes.load("llama"), TWO_HOSTS)
    compiled = measured_bytes(recipe)
    scale = bytes_at_scale()
    curves = losses(args.steps)
    reached = {name: {str(level): steps_to(curve, level) for level in LEVELS} for name, curve in curves.items()}
    battery = json.loads((ROOT / BATTERY).read_text())
    timed = step_times(scale, battery)

    psi = sum(x.size for x in jax.tree.leaves(build(recipe).abstract_state().params))
    print(f"\nllama recipe ({psi / 1e6:.2f}M params), 2 hosts x (fsdp 2 x tensor 2), ZeRO-0: per device per step, compiled")
    print(f"{'method':<12} {'cross-host KiB':>15} {'formula KiB':>12} {'vs none':>8} {'1/x':>6}")
    for r in compiled:
        formula = f"{r['formula'] / 1024:.1f}" if r["formula"] is not None else "-"
        print(f"{r['method']:<12} {r['cross_host_bytes'] / 1024:>15.1f} {formula:>12} {r['vs_uncompressed']:>8.4f} "
              f"{1 / r['vs_uncompressed']:>6.1f}")
    print("\nat scale, 2 hosts x 8 devices, ZeRO-0, per device per step, formula (Compressor.cross_host_bytes)")
    print(f"{'model':<15} {'in-host layout':<24} {'method':<12} {'MiB':>9} {'uncompressed MiB':>17} {'1/x':>7}")
    for r in scale:
        print(f"{r['model']:<15} {r['layout']:<24} {r['method']:<12} {r['compressed'] / 2**20:>9.2f} "
              f"{r['uncompressed'] / 2**20:>17.1f} {r['ratio']:>7.1f}")
    print(f"\nfine-tune of tests/golden/llama_tied on tests/golden/corpus.txt, {args.steps} steps: steps to reach a loss "
          f"(mean of {SMOOTH})")
    print(f"{'method':<12} " + " ".join(f"{'<= ' + str(level):>8}" for level in LEVELS) + f" {'final':>8}")
    for name, curve in curves.items():
        print(f"{name:<12} " + " ".join(f"{reached[name][str(level)] or '-':>8}" for level in LEVELS)
              + f" {sum(curve[-SMOOTH:]) / SMOOTH:>8.3f}")
    level = str(LEVELS[-2])
    print(f"\nwhen it pays: step time (s) with the wire unhidden / wholly hidden, and the time to reach loss {level}"
          f" at the fine-tune's steps; compute at {TOKENS_PER_GPU} tokens per GPU from the H200's measured throughput")
    print(f"{'model':<15} {'method':<12} " + " ".join(f"{str(g) + ' Gb/s':>24}" for g in BANDWIDTHS_GBIT))
    for (model, method), rows in _grouped(timed).items():
        steps = reached[method][level]
        cells = [f"{r['step_s']:.2f}/{r['step_overlapped_s']:.2f}" + (f" -> {steps * r['step_s']:.0f} s" if steps else "")
                 for r in rows]
        print(f"{model:<15} {method:<12} " + " ".join(f"{c:>24}" for c in cells))

    drawn = draw(curves, args.png, f"tiny HF Llama on the shipped text, 2 simulated hosts ({args.steps} steps)")
    out = pathlib.Path(args.out)
    payload = dict(layout=TWO_HOSTS, platform=platform.platform(), jax=jax.__version__, compiled_bytes=compiled,
                   bytes_at_scale=scale,
                   loss=dict(run="hf:tests/golden/llama_tied " + " ".join(FINETUNE).replace(f"{ROOT}/", ""), steps=args.steps, levels=LEVELS,
                             smooth=SMOOTH, steps_to_level=reached, curves=curves),
                   when_it_pays=dict(tokens_per_gpu=TOKENS_PER_GPU, battery=BATTERY, rows=timed),
                   png=args.png if drawn else None,
                   command="python benchmarks/compression.py " + " ".join(sys.argv[1:]))
    write(payload, out)
    print(f"wrote {out}" + (f" and {args.png}" if drawn else ""))


def _grouped(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        out.setdefault((r["model"], r["method"]), []).append(r)
    return out


if __name__ == "__main__":
    main()
