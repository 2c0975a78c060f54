"""Memory and communication of a ~1B-parameter Llama, compiled (never run) on 8, 64 and 256
virtual CPU devices, measured from the compiled program and divided by the published formula.

  1. model-state bytes per device, ZeRO 0-3 on a pure data-parallel mesh (bf16 parameters and
     gradients, fp32 master + Adam): 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N
  2. gradient / parameter traffic per device per step, elements: 2Ψ(N-1)/N (DP, ZeRO-1/2),
     3Ψ(N-1)/N (ZeRO-3)
  3. activation bytes per layer and sequence (growth of temporaries from 2 to 4 layers and
     from batch 1 to 2; and of the forward layer loop's stacks from batch 1 to 2) vs Korthikanti et al.: tensor parallel, + SP, + selective recompute;
     and remat dots (matmul outputs kept) vs formulas.matmul_outputs_bytes_per_layer, the
     planner's estimate
  4. cross-host bytes of hierarchical ZeRO (hybrid sharding: fsdp inside a host of 8, data
     across hosts) vs flat ZeRO-3 over the same devices

  python benchmarks/memory_comm.py [--devices 8,64,256] [--out benchmarks/results/memory_comm.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.targets

from jaxpar.mesh import force_cpu_devices  # noqa: E402

# TinyLlama-1.1B's shape: 22 layers, d=2048, 32 heads of 64 (4 KV heads), SwiGLU 5632, 32k vocab.
MODEL = dict(vocab_size=32000, embed=2048, num_layers=22, num_heads=32, num_kv_heads=4, head_dim=64, mlp=5632)
HOST_SIZE = 8


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", default="8,64,256", help="comma-separated device counts")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--out", default="benchmarks/results/memory_comm.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    counts = [int(n) for n in args.devices.split(",")]
    force_cpu_devices(max(counts))
    import jax
    from tqdm import tqdm

    from jaxpar.config import Config, ParallelConfig, TrainConfig, apply_overrides
    from jaxpar.inspect import formulas, inspect_step
    from jaxpar.inspect.hlo import loop_stacks
    from jaxpar.inspect.explain import explain
    from jaxpar.mesh import MeshConfig
    from jaxpar.train import build
    from jaxpar.models.llama import LlamaConfig

    devices = jax.devices()

    def config(n: int, overrides: list[str], layers: int = MODEL["num_layers"], batch: int | None = None) -> Config:
        base = Config(
            model=LlamaConfig(**{**MODEL, "num_layers": layers}),
            mesh=MeshConfig(data=-1),
            parallel=ParallelConfig(),
            train=TrainConfig(global_batch=batch or n, seq_len=args.seq, compute_dtype="bfloat16"),
        )
        return apply_overrides(base, overrides)

    def compile_step(n: int, overrides: list[str], **kw):
        trainer = build(config(n, overrides, **kw), devices[:n])
        return trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()

    def measure(n: int, overrides: list[str], **kw):
        trainer = build(config(n, overrides, **kw), devices[:n])
        report = inspect_step(trainer)
        return trainer, report, explain(trainer, report)

    jobs = [("zero", n, s) for n in counts for s in range(4)]
    jobs += [("activations", 4, v) for v in ("tp", "tp_sp", "tp_sp_selective", "tp_sp_dots")]
    jobs += [("hierarchical", n, v) for n in counts if n > HOST_SIZE for v in ("zero3", "hsdp")]
    results = {"zero": [], "activations": [], "hierarchical": []}
    started = time.perf_counter()
    for kind, n, variant in tqdm(jobs, desc="compiling", unit="step"):
        if kind == "zero":
            trainer, report, doc = measure(n, [f"mesh.data={n}", f"parallel.zero.stage={variant}"])
            state = next(r for r in doc["memory"] if r["name"] == "model state")
            psi = doc["params"]
            results["zero"].append({
                "devices": n, "stage": variant, "params": psi,
                "model_state_bytes": state["measured"],
                "formula_bytes": formulas.zero_paper_bytes(psi, variant, n),
                "ratio": state["measured"] / formulas.zero_paper_bytes(psi, variant, n),
                "traffic_elements": doc["gradient_traffic"]["measured"],
                "traffic_formula": formulas.gradient_traffic_elements(psi, n, variant),
                "traffic_ratio": doc["gradient_traffic"]["measured"] / formulas.gradient_traffic_elements(psi, n, variant),
                "temporaries_bytes": report.memory.temporaries,
                "compile_seconds": report.compile_seconds,
            })
        elif kind == "activations":
            t = 4  # the model's 4 KV heads cap tensor parallelism at 4
            overrides = ["mesh.data=1", f"mesh.tensor={t}"]
            overrides += ["parallel.tensor.sequence_parallel=true"] if "sp" in variant else []
            overrides += ["model.remat=selective"] if "selective" in variant else []
            # dots keeps every matmul's output, the reference attention's s x s scores among them:
            # the blockwise kernel (as the planner compiles on CPUs; cuDNN's on GPUs) has none
            overrides += ["model.remat=dots", "parallel.attention=flash"] if "dots" in variant else []
            # Per layer: temporaries of 4 layers minus 2, halved. That also holds per-layer
            # gradient and update buffers, which do not grow with the batch: the activations
            # of one sequence are the growth from batch 1 to batch 2. Beside it, exactly what
            # the forward layer loop keeps: the growth of its stacks (weights and gradients
            # do not grow), over its 4 layers. XLA shares temporaries whose lives do not
            # overlap, so the first can read less than the second.
            compiled = {(layers, b): compile_step(t, overrides, layers=layers, batch=b)
                        for layers in (2, 4) for b in (1, 2)}
            temps = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
            per_layer = ((temps[4, 2] - temps[2, 2]) - (temps[4, 1] - temps[2, 1])) / 2
            stacks = {b: loop_stacks(compiled[4, b].as_text(), 4)[0] for b in (1, 2)}
            kept = (stacks[2] - stacks[1]) / 4
            s, h, a = args.seq, MODEL["embed"], MODEL["num_heads"]
            if "dots" in variant:
                attention = 2 * (a + MODEL["num_kv_heads"]) * MODEL["head_dim"]  # q and its output, k and v
                formula = formulas.matmul_outputs_bytes_per_layer(s, 1, h, attention, 2 * MODEL["mlp"], t,
                                                                  sequence_parallel=True)
            else:
                formula = formulas.activation_bytes_per_layer(
                    s, 1, h, a, t, sequence_parallel="sp" in variant, selective="selective" in variant)
            results["activations"].append({
                "variant": variant, "tensor": t, "seq": s, "micro_batch": 1,
                "bytes_per_layer": per_layer, "formula_bytes": formula, "ratio": per_layer / formula,
                "kept_bytes_per_layer": kept, "kept_ratio": kept / formula,
            })
        else:
            hosts = n // HOST_SIZE
            overrides = {
                "zero3": ["mesh.data=1", f"mesh.fsdp={n}", f"mesh.hosts.fsdp={hosts}"],
                "hsdp": [f"mesh.data={hosts}", f"mesh.fsdp={HOST_SIZE}", f"mesh.hosts.data={hosts}"],
            }[variant]
            _, report, _ = measure(n, overrides)
            results["hierarchical"].append({
                "devices": n, "hosts": hosts, "variant": variant,
                "cross_host_bytes": report.cross_host_bytes(),
                "total_bytes": sum(c.bytes_per_step for c in report.collectives),
            })
    for row in results["hierarchical"]:
        flat = next(r for r in results["hierarchical"] if r["devices"] == row["devices"] and r["variant"] == "zero3")
        row["vs_zero3"] = row["cross_host_bytes"] / flat["cross_host_bytes"]

    print_tables(results)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": MODEL, "seq": args.seq, "host_size": HOST_SIZE, **results,
        "machine": platform.platform(), "jax": jax.__version__, "seconds": time.perf_counter() - started,
    }, indent=1))
    print(f"wrote {out}")


def print_tables(results: dict) -> None:
    gib = 2**30
    print(f"\nmodel state per device (GiB) and gradient traffic per device (elements), Ψ = {results['zero'][0]['params'] / 1e9:.3f}B")
    print(f"{'N':>5}{'stage':>6}{'measured':>11}{'formula':>11}{'ratio':>8}{'traffic':>12}{'formula':>12}{'ratio':>8}")
    for r in results["zero"]:
        print(f"{r['devices']:>5}{r['stage']:>6}{r['model_state_bytes'] / gib:>11.3f}{r['formula_bytes'] / gib:>11.3f}"
              f"{r['ratio']:>8.3f}{r['traffic_elements'] / 1e9:>11.3f}G{r['traffic_formula'] / 1e9:>11.3f}G{r['traffic_ratio']:>8.3f}")
    print("\nactivation bytes per layer (tensor=4, micro-batch 1), Korthikanti et al. (dots: the matmul outputs' formula)")
    print(f"{'variant':<18}{'temporaries MiB':>16}{'loop keeps MiB':>15}{'formula MiB':>13}{'ratio':>7}{'kept':>7}")
    for r in results["activations"]:
        print(f"{r['variant']:<18}{r['bytes_per_layer'] / 2**20:>16.1f}{r['kept_bytes_per_layer'] / 2**20:>15.1f}"
              f"{r['formula_bytes'] / 2**20:>13.1f}{r['ratio']:>7.3f}{r['kept_ratio']:>7.3f}")
    print(f"\ncross-host bytes per device per step ({HOST_SIZE} devices per host)")
    print(f"{'N':>5}{'hosts':>6}{'variant':>8}{'cross-host MiB':>16}{'vs ZeRO-3':>11}")
    for r in results["hierarchical"]:
        print(f"{r['devices']:>5}{r['hosts']:>6}{r['variant']:>8}{r['cross_host_bytes'] / 2**20:>16.1f}{r['vs_zero3']:>11.3f}")


if __name__ == "__main__":
    main()
