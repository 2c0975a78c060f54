"""ZeRO++ on CPU virtual devices: what hpZ, qwZ and qgZ do to the bytes, and to the loss.

  1. bytes (compile only): TinyLlama-1.1B's shape, ZeRO-3 over 64 devices as 8 simulated
     hosts of 8 (mesh.fsdp=8 inside, mesh.data=8 across), plain and with each of hpZ, qwZ,
     qgZ and all three. Per device per step: bytes crossing hosts; parameter all-gather bytes
     and, for qwZ, (int8 codes + scales) / the same elements at bf16; the gradient reduction
     over data, and for qgZ its int8 all-to-all / the fp32 reduce-scatter it replaces.
  2. loss (training): the `llama` recipe (8 devices, two simulated hosts, ZeRO-3), 50 steps,
     plain vs hpZ vs qwZ + qgZ; final losses and their ratio.

The CPU backend widens bf16 collectives to f32 and keeps int8 ones int8, so unquantized
gathers are counted here at the element count times 2 bytes, what a GPU moves.

  python benchmarks/zeropp.py [--devices 64] [--steps 50] [--out benchmarks/results/zeropp.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.targets

from jaxpar.mesh import force_cpu_devices  # noqa: E402

MODEL = dict(vocab_size=32000, embed=2048, num_layers=22, num_heads=32, num_kv_heads=4, head_dim=64, mlp=5632)
HOST_SIZE = 8
VARIANTS = {
    "zero3": [],
    "hpz": ["parallel.zero.hpz=true"],
    "qwz": ["parallel.zero.quantized_weights=true"],
    "qgz": ["parallel.zero.quantized_gradients=true"],
    "hpz+qwz+qgz": ["parallel.zero.hpz=true", "parallel.zero.quantized_weights=true", "parallel.zero.quantized_gradients=true"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=64)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default="benchmarks/results/zeropp.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    force_cpu_devices(max(args.devices, 8))
    import jax
    from tqdm import tqdm

    from jaxpar.config import Config, ParallelConfig, TrainConfig, ZeroConfig, apply_overrides
    from jaxpar.inspect import inspect_step
    from jaxpar.mesh import MeshConfig
    from jaxpar.train import build
    from jaxpar.loop.run import run
    from jaxpar.models.llama import LlamaConfig

    from jaxpar import recipes

    hosts = args.devices // HOST_SIZE
    base = Config(
        model=LlamaConfig(**MODEL),
        mesh=MeshConfig(data=hosts, fsdp=HOST_SIZE),
        parallel=ParallelConfig(zero=ZeroConfig(stage=3)),
        train=TrainConfig(global_batch=args.devices, seq_len=args.seq, compute_dtype="bfloat16"),
    )
    base = apply_overrides(base, [f"mesh.hosts.data={hosts}"])

    rows = []
    t0 = time.time()
    for name, overrides in tqdm(VARIANTS.items(), desc=f"compile x{args.devices}", file=sys.stderr):
        report = inspect_step(build(apply_overrides(base, overrides), jax.devices()[: args.devices]))
        codes = report.bytes_over(kinds=["all-gather"], dtypes=["s8"])
        wide = report.bytes_over(kinds=["all-gather"], dtypes=["f32", "bf16"])
        # Under qwZ every float gather is int8 codes plus their f32 scales; otherwise the
        # gathers are bf16 parameters, which the CPU runs as f32: half that is bf16.
        scales = wide if codes else 0
        gathered = codes * 2 if codes else wide // 2
        rows.append(
            dict(
                variant=name,
                cross_host_bytes=report.cross_host_bytes(),
                gather_bytes_bf16_equivalent=gathered,
                gather_int8_codes=codes,
                gather_scales=scales,
                grad_reduce_data_f32=report.bytes_over(["data"], ["reduce-scatter"], ["f32"]),
                grad_all_to_all_data=report.bytes_over(["data"], ["all-to-all"]),
                temporaries=report.memory.temporaries,
                compile_seconds=round(report.compile_seconds, 1),
            )
        )
    plain = rows[0]
    for r in rows:
        r["cross_host_vs_zero3"] = r["cross_host_bytes"] / plain["cross_host_bytes"]
        r["qwz_wire_vs_bf16"] = (r["gather_int8_codes"] + r["gather_scales"]) / (2 * r["gather_int8_codes"]) if r["gather_int8_codes"] else None
        r["qgz_wire_vs_fp32_reduce_scatter"] = (
            r["grad_all_to_all_data"] / plain["grad_reduce_data_f32"] if r["grad_all_to_all_data"] else None
        )
    compile_seconds = time.time() - t0

    # ---- the loss, on the llama recipe
    recipe = apply_overrides(
        recipes.load("llama"),
        ["mesh.data=2", "mesh.hosts.data=2", "parallel.zero.stage=3", f"train.steps={args.steps}"],
    )
    losses = {}
    for name in ("zero3", "hpz", "hpz+qwz+qgz"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            history = run(build(apply_overrides(recipe, VARIANTS[name]), jax.devices()[:8]), progress=True)
        losses[name] = [h["loss"] for h in history]
    final = {k: v[-1] for k, v in losses.items()}
    loss_rows = [dict(variant=k, final_loss=v, vs_zero3=v / final["zero3"]) for k, v in final.items()]

    print(f"\nZeRO-3 of a {MODEL['num_layers']}-layer d={MODEL['embed']} Llama over {hosts} hosts x {HOST_SIZE}, per device per step")
    print(f"{'variant':<13} {'cross-host MiB':>15} {'vs ZeRO-3':>10} {'gather MiB(bf16)':>17} {'qwZ wire/bf16':>14} "
          f"{'qgZ wire/fp32 RS':>17} {'temps GiB':>10}")
    for r in rows:
        qw = f"{r['qwz_wire_vs_bf16']:.3f}" if r["qwz_wire_vs_bf16"] else "-"
        qg = f"{r['qgz_wire_vs_fp32_reduce_scatter']:.3f}" if r["qgz_wire_vs_fp32_reduce_scatter"] else "-"
        wire = r["gather_int8_codes"] + r["gather_scales"] if r["gather_int8_codes"] else r["gather_bytes_bf16_equivalent"]
        print(f"{r['variant']:<13} {r['cross_host_bytes'] / 2**20:>15.1f} {r['cross_host_vs_zero3']:>10.3f} "
              f"{wire / 2**20:>17.1f} {qw:>14} {qg:>17} {r['temporaries'] / 2**30:>10.2f}")
    print(f"\nllama recipe, 8 devices (2 hosts), ZeRO-3, {args.steps} steps")
    for r in loss_rows:
        print(f"{r['variant']:<13} final loss {r['final_loss']:.4f}   vs ZeRO-3 {r['vs_zero3']:.4f}")

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        model=MODEL, devices=args.devices, hosts=hosts, seq=args.seq, platform=platform.platform(),
        jax=jax.__version__, bytes=rows, compile_seconds=round(compile_seconds, 1),
        loss=dict(steps=args.steps, final=loss_rows, curves=losses),
    ), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
