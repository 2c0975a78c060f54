"""Where a training step's time goes: trace a few steps of benchmarks/mfu.py's 0.9B Llama with
jax.profiler, and sum the device time of each compiled HLO instruction over the traced steps.
Prints the top costs (time per step, share of the step, what kind of work) and writes JSON.

  python benchmarks/profile_step.py [--remat none] [--batch 8] [--seq-len 2048] [--out ...]
  python benchmarks/profile_step.py --tiny    # a toy shape on a CPU, to check the script

Each instruction is classed from its line in the compiled HLO: a GEMM (cuBLAS or a Triton
GEMM fusion), cuDNN attention, a collective, or a fusion of element-wise / reduction work.
The trace is read with jax.profiler.ProfileData, on the machine that made it: on a GPU the
kernels of the device's streams (XLA names its own kernels after their instructions; cuBLAS's
and cuDNN's are classed by name), elsewhere the events named after an instruction of the step.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.mfu

INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--remat", default="none")
    p.add_argument("--matmul-dtype", choices=["compute", "fp8"], default="compute")
    p.add_argument("--steps", type=int, default=3, help="steps traced (after 3 untraced)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default="benchmarks/results/profile_step.json")
    return p.parse_args()


def kind_of(line: str) -> str:
    """What one compiled HLO instruction does, from its text."""
    if "cudnn" in line and ("fmha" in line or "Fmha" in line or "flash" in line):
        return "attention (cuDNN)"
    if "__cublas" in line or "gemm" in line.lower() or re.search(r"=\s*\S+\s+dot\(", line):
        return "matmul"
    for c in COLLECTIVES:
        if f" {c}(" in line or f" {c}-start(" in line or f" {c}-done(" in line:
            return f"collective ({c})"
    if " fusion(" in line:
        m = re.search(r"kind=(k\w+)", line)
        return f"fusion ({m.group(1) if m else '?'})"
    m = re.search(r"=\s*\S+\s+([\w\-]+)\(", line)
    return m.group(1) if m else "other"


def instructions(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its line (entry and nested computations alike)."""
    out = {}
    for line in hlo_text.splitlines():
        m = INSTRUCTION.match(line)
        if m:
            out[m.group(1)] = line.strip()
    return out


def leaves(events) -> list:
    """The events of one trace line that hold no other: a while loop's event spans its body's
    (counted once, as its body's instructions)."""
    evs = sorted(events, key=lambda e: (e.start_ns, -e.duration_ns))
    return [e for e, nxt in zip(evs, evs[1:] + [None]) if nxt is None or nxt.start_ns >= e.end_ns]


KERNEL_KINDS = (("attention (cuDNN)", ("cudnn", "sdpa", "fmha")), ("matmul", ("nvjet", "gemm", "cublas", "cutlass", "xmma")),
                ("copy", ("memcpy", "memset")), ("collective", ("nccl",)),
                ("fusion (kLoop)", ("loop_",)), ("fusion (kInput)", ("input_",)))


def kernel_kind(name: str) -> str:
    """What a GPU kernel does, from its name, when no instruction of the step is named so."""
    low = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in low for w in words)), "other kernel")


def device_time(trace_dir: pathlib.Path, names: dict[str, str]) -> tuple[dict[str, float], list[str]]:
    """Nanoseconds per event name, summed over the trace, and the trace lines there were. On a
    GPU: the kernels of its streams (jax 0.11.2's trace has no "XLA Ops" line); elsewhere the
    events named after an instruction of the step."""
    import jax

    files = sorted(trace_dir.rglob("*.xplane.pb"))
    if not files:
        raise SystemExit(f"profile_step: no .xplane.pb under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(str(files[-1]))
    gpu = [p for p in data.planes if p.name.startswith("/device:GPU")]
    total: dict[str, float] = collections.defaultdict(float)
    if gpu:
        for ev in (ev for p in gpu for ln in p.lines if ln.name.startswith("Stream") for ev in ln.events):
            total[ev.name] += ev.duration_ns
    else:
        for ln in (ln for p in data.planes for ln in p.lines):
            for ev in leaves([e for e in ln.events if e.name.lstrip("%") in names]):
                total[ev.name.lstrip("%")] += ev.duration_ns
    return total, sorted({f"{p.name}: {ln.name}" for p in (gpu or data.planes) for ln in p.lines})[:40]


def profile(args) -> dict:
    import jax

    from benchmarks.mfu import SHAPE, TINY, jaxpar_config
    from jaxpar.data.sources import make_source
    from jaxpar.train import build

    shape = TINY if args.tiny else SHAPE
    batch, seq = (2, 64) if args.tiny else (args.batch, args.seq_len)
    trainer = build(jaxpar_config(shape, batch, seq, args.remat, 100, args.matmul_dtype), jax.devices()[:1])
    step = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    names = instructions(step.as_text())
    state, source = trainer.init(), make_source(trainer.batch, trainer.config)
    batches = [source(i) for i in range(2)]
    for i in range(3):
        state, metrics = step(state, batches[i % 2])
    float(metrics["loss"])
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        with jax.profiler.trace(tmp):
            for i in range(args.steps):
                state, metrics = step(state, batches[i % 2])
            float(metrics["loss"])
        wall = (time.perf_counter() - t0) / args.steps
        total, lines_read = device_time(pathlib.Path(tmp), names)
    setup = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "batch": batch, "seq_len": seq,
             "remat": args.remat, "matmul_dtype": args.matmul_dtype, "traced_steps": args.steps,
             "wall_s_per_step": wall, "trace_lines": lines_read}
    return {**setup, **summarize(total, names, args.steps, args.top)}


def summarize(total: dict[str, float], names: dict[str, str], steps: int, top: int) -> dict:
    """Seconds a step per event and per kind. An event is an HLO instruction, or a GPU kernel
    that XLA named after one (gemm_fusion_dot_23 is gemm_fusion_dot.23), or a library's kernel
    (cuBLAS, cuDNN) classed by its name."""
    by_underscore = {n.replace(".", "_").replace("-", "_"): n for n in names}
    per_step = {n: t / steps / 1e9 for n, t in total.items()}
    busy = sum(per_step.values())

    def row(name: str) -> dict:
        hlo = names.get(name) or names.get(by_underscore.get(name, ""), "")
        return {"name": name[:120], "kind": kind_of(hlo) if hlo else kernel_kind(name), "hlo": hlo[:240]}

    rows = [{**row(n), "s": s, "share": s / busy if busy else 0.0} for n, s in per_step.items()]
    by_kind: dict[str, float] = collections.defaultdict(float)
    for r in rows:
        by_kind[r["kind"]] += r["s"]
    return {"device_busy_s_per_step": busy, "events_timed": len(rows),
            "by_kind": {k: {"s": v, "share": v / busy if busy else 0.0}
                        for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": sorted(rows, key=lambda r: -r["s"])[:top]}


def render(doc: dict) -> str:
    rows = [f"step {doc['wall_s_per_step']:.4f} s wall, {doc['device_busy_s_per_step']:.4f} s of device ops "
            f"({doc['events_timed']} kinds of event) on {doc['device']}, jax {doc['jax']}",
            "", f"{'kind':<34}{'s/step':>10}{'share':>8}"]
    rows += [f"{k:<34}{v['s']:>10.4f}{v['share']:>8.1%}" for k, v in doc["by_kind"].items()]
    rows += ["", f"{'instruction':<40}{'kind':<26}{'s/step':>10}{'share':>8}"]
    rows += [f"{t['name'][:39]:<40}{t['kind'][:25]:<26}{t['s']:>10.4f}{t['share']:>8.1%}" for t in doc["top"]]
    return "\n".join(rows)


def main() -> int:
    args = parse_args()
    from jaxpar.device_memory import share_gpu_memory

    share_gpu_memory()  # as jaxpar's commands do
    doc = profile(args)
    print(render(doc))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0 if doc["events_timed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
