"""Pipeline parallelism on CPU virtual devices: bubbles of the schedules, and the compiled
activation memory of the executor as the microbatch count grows.

  1. bubble (no compile): idle slots / all slots of each schedule's timeline (forward 1
     step, backward 2, or 1 + 1 split) beside the published fraction, the microbatch
     chunks in flight on stage 0, and the executor's lockstep ticks.
  2. memory (compile only): a Llama step on mesh stage=4 x data=2, fp32, a fixed
     microbatch of 2 sequences of 256 tokens per replica, m = 4, 8, 16 microbatches (so
     the batch grows with m, as when a pipeline is filled deeper). Per schedule: the
     activation and gradient slots each stage needs, the buffers every device allocates
     (the most any stage needs, times one microbatch's hidden states), and the compiler's
     temporaries for the step. 1F1B's stay flat in m; GPipe's grow with m.

  python benchmarks/pipeline.py [--out benchmarks/results/pipeline.json]

The timing of a pipeline cannot be read here: the 8 virtual devices share the machine's
cores, so an idle stage frees cores for the others instead of wasting them.
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

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
MICROBATCHES = (4, 8, 16)
STAGES = 4
ROWS = 2  # sequences per microbatch per data replica
SEQ = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/pipeline.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    force_cpu_devices(8)
    import jax
    from tqdm import tqdm

    bubbles = [bubble_row(name, p, m, v) for name, v in SCHEDULES for p in (4, 8) for m in MICROBATCHES if m >= p or name == "gpipe"]
    work = [(name, v, m) for name, v in SCHEDULES for m in MICROBATCHES]
    memory = [memory_row(name, v, m) for name, v, m in tqdm(work, desc="compile steps", leave=False)]
    doc = {
        "setup": {"platform": jax.devices()[0].platform, "jax": jax.__version__, "machine": platform.machine(),
                  "date": time.strftime("%Y-%m-%d"), "stages": STAGES, "rows_per_microbatch": ROWS, "seq_len": SEQ},
        "bubble": bubbles,
        "memory": memory,
    }
    print(render(doc))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {out}")


def bubble_row(name: str, p: int, m: int, v: int) -> dict:
    from jaxpar.pipeline import bubble_fraction, build_schedule, peak_in_flight
    from jaxpar.pipeline.program import compile_schedule
    from jaxpar.pipeline.schedule import published_bubble

    timeline = build_schedule(name, p, m, v)
    return {
        "schedule": name, "p": p, "m": m, "v": v,
        "measured": bubble_fraction(timeline), "published": published_bubble(name, p, m, v),
        "in_flight_stage0": peak_in_flight(timeline), "executor_ticks": compile_schedule(name, p, m, v).ticks,
    }


def memory_row(name: str, v: int, m: int) -> dict:
    from jaxpar.config import Config, ParallelConfig, PipelineConfig, TrainConfig
    from jaxpar.mesh import MeshConfig
    from jaxpar.train import build
    from jaxpar.models.llama import LlamaConfig

    data = 2
    config = Config(
        model=LlamaConfig(vocab_size=256, embed=128, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=16, mlp=384),
        mesh=MeshConfig(stage=STAGES, data=data),
        parallel=ParallelConfig(pipeline=PipelineConfig(schedule=name, chunks=v)),
        train=TrainConfig(global_batch=data * ROWS * m, seq_len=SEQ, microbatches=m, compute_dtype="float32"),
    )
    trainer = build(config)
    stats = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile().memory_analysis()
    program = trainer.pipeline
    message = ROWS * SEQ * config.model.embed * 4
    return {
        "schedule": name, "v": v, "m": m,
        "activation_slots_per_stage": list(program.act_slots_used),
        "gradient_slots_per_stage": list(program.grad_slots_used),
        "buffer_bytes": (program.act_slots + program.grad_slots) * message,
        "temporaries_bytes": stats.temp_size_in_bytes,
        "message_bytes": message,
    }


def render(doc: dict) -> str:
    lines = ["bubble: idle / all slots of the timeline (forward 1, backward 2 or 1 + 1 split)",
             f"{'schedule':<16}{'p':>3}{'m':>4}{'measured':>10}{'published':>11}{'in flight':>11}{'ticks':>7}"]
    for r in doc["bubble"]:
        name = r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else "")
        lines.append(f"{name:<16}{r['p']:>3}{r['m']:>4}{r['measured']:>10.4f}{r['published']:>11.4f}"
                     f"{r['in_flight_stage0']:>11}{r['executor_ticks']:>7}")
    setup = doc["setup"]
    lines += ["", f"memory: Llama step, stage={setup['stages']} x data=2, fp32, microbatch {setup['rows_per_microbatch']} x "
              f"{setup['seq_len']} tokens per replica (one message {doc['memory'][0]['message_bytes'] / 2**20:.2f} MiB)",
              f"{'schedule':<16}{'m':>4}  {'activation slots per stage':<28}{'gradient slots':<16}{'buffers MiB':>12}{'temp MiB':>10}{'growth':>8}"]
    for r in doc["memory"]:
        name = r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else "")
        first = next(f for f in doc["memory"] if f["schedule"] == r["schedule"])  # the same schedule at the fewest microbatches
        growth = (r["temporaries_bytes"] - first["temporaries_bytes"]) / 2**20
        lines.append(f"{name:<16}{r['m']:>4}  {str(r['activation_slots_per_stage']):<28}{str(r['gradient_slots_per_stage']):<16}"
                     f"{r['buffer_bytes'] / 2**20:>12.2f}{r['temporaries_bytes'] / 2**20:>10.2f}{growth:>+8.2f}")
    lines.append("growth: temporaries beyond the same schedule's at m = 4 (MiB)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
