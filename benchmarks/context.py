"""Context parallelism on CPU virtual devices: memory, causal load balance and traffic of the
ring, Ulysses and all-gather attention kernels, and whole-model memory of `llama_long`.

  1. memory (compile only): forward + backward of one attention layer (batch 1, 8 heads of
     64, fp32, tiles of 512) for n = 2, 4, 8 devices and several sequence lengths. Per
     device: the compiler's arguments + outputs + temporaries; its slope, the bytes each
     further token held per device adds (d bytes / d(s/n) between neighbouring lengths: the
     same for every n when memory grows as s/n, the rest being fixed tile buffers); and the
     largest single buffer in the compiled program against one (s/n) x (s/n) score block,
     with the plain single-device attention for contrast.
  2. causal load balance (run): score tiles each device's kernel computed in the forward
     pass, as attention FLOPs per device; max / min across devices, zigzag vs contiguous.
  3. traffic (compile only): collective bytes per device over the context axis, measured in
     the compiled program against jaxpar.inspect.formulas.context_traffic_elements.
  4. llama_long (compile only): the recipe's whole training step at sequence 8k to 128k on
     8 devices (context=8, ring): per-device memory from the compiled step.
  5. window: a sliding window of w = s/8 keys on a context of 8 (ring, Ulysses, all-gather;
     zigzag and contiguous order): collective bytes per device from the compiled layer
     against the formula (the contiguous ring stops after 2 of 8 blocks), and attention
     FLOPs per device from the kernel's tile count against formulas.windowed_tile_pairs,
     beside causal attention without a window.

  python benchmarks/context.py [--out benchmarks/results/context.json]
  python benchmarks/context.py --only window --out benchmarks/results/context_window.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.targets

from jaxpar.mesh import force_cpu_devices  # noqa: E402

HEADS, HEAD_DIM, BLOCK = 8, 64, 512
IMPLS = ("ring", "ulysses", "allgather")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", default="4096,8192,16384,32768,65536", help="sequence lengths for the memory table")
    p.add_argument("--long-seqs", default="8192,16384,32768,65536,131072", help="llama_long sequence lengths")
    p.add_argument("--out", default="benchmarks/results/context.json")
    p.add_argument("--only", choices=["window"], help="only this section (the others take about an hour)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    force_cpu_devices(8)
    import jax
    from tqdm import tqdm

    setup = {"heads": HEADS, "head_dim": HEAD_DIM, "batch": 1, "block": BLOCK, "dtype": "float32",
             "platform": jax.devices()[0].platform, "jax": jax.__version__, "machine": platform.machine(),
             "date": time.strftime("%Y-%m-%d")}
    window = [window_row(impl, layout, w) for impl, layout, w in tqdm(WINDOW_CASES, desc="windowed layers", leave=False)]
    if args.only == "window":
        return finish({"setup": setup, "window": window}, args.out)
    seqs = [int(x) for x in args.seqs.split(",")]
    long_seqs = [int(x) for x in args.long_seqs.split(",")]
    work = [(impl, n, s) for impl in IMPLS for n in (2, 4, 8) for s in seqs]
    memory, traffic = [], []
    for impl, n, s in tqdm(work, desc="compile attention layers", leave=False):
        compiled, mesh = compile_layer(impl, n, s)
        memory.append(memory_row(impl, n, s, compiled))
        if s == seqs[0]:
            traffic.append(traffic_row(impl, n, s, compiled, mesh))
    for s in tqdm(seqs[:2], desc="plain attention", leave=False):
        memory.append(memory_row("plain (1 device)", 1, s, compile_layer("plain", 1, s)[0]))
    add_slopes(memory)
    balance = [balance_row(impl, layout, n) for impl in IMPLS for layout in ("zigzag", "contiguous") for n in (2, 4, 8)]
    long = [long_row(s) for s in tqdm(long_seqs, desc="llama_long steps", leave=False)]
    finish({"setup": setup, "memory": memory, "balance": balance, "traffic": traffic, "llama_long": long,
            "window": window}, args.out)


def finish(doc: dict, out: str) -> None:
    print(render(doc))
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {path}")


WINDOW_SEQ, WINDOW_DEVICES = 16384, 8
# (impl, order, window): causal attention without a window first, the baseline
WINDOW_CASES = [("ring", "zigzag", 0), ("ring", "zigzag", WINDOW_SEQ // 8), ("ring", "contiguous", WINDOW_SEQ // 8),
                ("ulysses", "contiguous", WINDOW_SEQ // 8), ("allgather", "contiguous", WINDOW_SEQ // 8)]


def window_row(impl: str, layout: str, window: int, s: int = WINDOW_SEQ, n: int = WINDOW_DEVICES) -> dict:
    """One causal layer with a sliding window on context=n: collective bytes per device
    (compiled, forward + backward) against formulas.context_traffic_elements, and the
    forward's attention FLOPs per device from the kernel's tile count (run with 1 head of 8
    and scaled to HEADS x HEAD_DIM, as balance_row) against formulas.windowed_tile_pairs."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpar.inspect.formulas import context_traffic_elements, windowed_tile_pairs
    from jaxpar.inspect.hlo import collectives
    from jaxpar.kernels.attention import executed_tiles
    from jaxpar.kernels.attention.order import chunk_length
    from jaxpar.kernels.attention.tiles import tile

    mesh, f, spec = layer_fn(impl, n, layout, window=window)
    sharding = NamedSharding(mesh, P(None, "context"))
    arg = jax.ShapeDtypeStruct((1, s, HEADS, HEAD_DIM), "float32", sharding=sharding)
    compiled = jax.jit(f, out_shardings=sharding).lower(arg, arg, arg, arg).compile()
    sent = sum(c.bytes_per_step for c in collectives(compiled.as_text(), mesh) if c.axes == ("context",))
    formula = context_traffic_elements(impl, s, 1, HEADS * HEAD_DIM, HEADS * HEAD_DIM, n, window, layout)
    want = 4 * sum(sum(part.values()) for part in formula.values())
    small = jax.random.normal(jax.random.key(0), (1, s, n, 8))  # the tile count needs no more than n heads of 8
    tiles = np.asarray(jax.jit(lambda q: executed_tiles(q, q, q, None, spec))(small)).astype(np.int64)
    heads = HEADS // n if impl == "ulysses" else HEADS  # Ulysses: every device the whole sequence, 1/n of the heads
    bq = tile(chunk_length(layout, n, s), BLOCK)  # the kernels' tiles divide the layout's chunks
    per_tile = 4 * bq * bq * HEAD_DIM * heads  # QK^T and PV
    # a device away from the sequence's start; Ulysses' devices each hold the whole sequence
    pairs = (windowed_tile_pairs(s, bq, window, start=0) if impl == "ulysses" else windowed_tile_pairs(s // n, bq, window)
             ) if window else None
    return {"impl": impl, "layout": layout, "window": window, "devices": n, "seq": s,
            "measured_bytes": sent, "formula_bytes": want, "bytes_ratio": sent / want if want else None,
            "flops_per_device": (tiles * per_tile).tolist(), "max_flops": float(tiles.max() * per_tile),
            "formula_flops": pairs * per_tile if pairs else None}


def layer_fn(impl: str, n: int, layout: str = "zigzag", block: int = BLOCK, window: int = 0):
    """(mesh, f(q, k, v, do) -> (o, dq, dk, dv)) for one causal attention layer."""
    import jax
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    from jaxpar.kernels.attention import ContextSpec, Masking, context_attention, reference_attention

    mesh = jax.make_mesh((n,), ("context",), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))
    spec = None
    if impl == "plain":
        attend = lambda q, k, v: reference_attention(q, k, v, None, True)  # noqa: E731
    else:
        spec = ContextSpec(impl, mesh, ("context",), P(None, "context"), P(None, "context"), layout,
                           Masking(True, block, block, window=window))
        attend = lambda q, k, v: context_attention(q, k, v, None, spec)  # noqa: E731

    def f(q, k, v, do):
        o, vjp = jax.vjp(attend, q, k, v)
        return (o, *vjp(do))

    return mesh, f, spec


def compile_layer(impl: str, n: int, s: int):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh, f, _ = layer_fn(impl, n)
    sharding = NamedSharding(mesh, P(None, "context"))
    arg = jax.ShapeDtypeStruct((1, s, HEADS, HEAD_DIM), "float32", sharding=sharding)
    return jax.jit(f, out_shardings=sharding).lower(arg, arg, arg, arg).compile(), mesh


def largest_buffer(hlo: str) -> int:
    """Elements of the largest array any instruction of the compiled program produces."""
    import math

    best = 0
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s[a-z\-]+\(", line)
        if not m:
            continue
        for dims in re.findall(r"[a-z][a-z0-9]*\[([\d,]*)\]", m.group(1)):
            best = max(best, math.prod(int(d) for d in dims.split(",") if d))
    return best


def memory_row(impl: str, n: int, s: int, compiled) -> dict:
    stats = compiled.memory_analysis()
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    largest = largest_buffer(compiled.as_text())
    return {
        "impl": impl, "devices": n, "seq": s,
        "bytes_per_device": total, "temporaries": stats.temp_size_in_bytes,
        "bytes_x_n_over_s": total * n / s,
        "largest_buffer_elements": largest,
        "largest_over_score_block": largest / (s // n) ** 2,
        "holds_s_by_s": largest >= s * s,
    }


def add_slopes(rows: list[dict]) -> None:
    """Each row's bytes per further token held per device, from the row of the next shorter
    sequence with the same impl and n (None for the shortest)."""
    previous = {}
    for r in rows:
        key = (r["impl"], r["devices"])
        before = previous.get(key)
        r["bytes_per_local_token"] = None
        if before is not None:
            tokens = (r["seq"] - before["seq"]) / r["devices"]
            r["bytes_per_local_token"] = (r["bytes_per_device"] - before["bytes_per_device"]) / tokens
        previous[key] = r


def traffic_row(impl: str, n: int, s: int, compiled, mesh) -> dict:
    from jaxpar.inspect.formulas import context_traffic_elements
    from jaxpar.inspect.hlo import collectives

    colls = [c for c in collectives(compiled.as_text(), mesh) if c.axes == ("context",)]
    formula = context_traffic_elements(impl, s, 1, HEADS * HEAD_DIM, HEADS * HEAD_DIM, n)
    expected = {}
    for part in formula.values():
        for kind, elements in part.items():
            expected[kind] = expected.get(kind, 0) + 4 * elements  # fp32 everywhere here
    rows = []
    for kind, want in expected.items():
        got = sum(c.bytes_per_step for c in colls if c.kind == kind)
        rows.append({"kind": kind, "measured_bytes": got, "formula_bytes": want, "ratio": got / want})
    other = sorted({c.kind for c in colls} - set(expected))
    return {"impl": impl, "devices": n, "seq": s, "by_kind": rows, "unexpected_kinds": other}


def balance_row(impl: str, layout: str, n: int, s: int = 2048, heads: int = 8, head_dim: int = 8, block: int = 512) -> dict:
    """Attention FLOPs each device computed in the forward pass, from the kernel's own tile count."""
    import jax
    import numpy as np
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    from jaxpar.kernels.attention import ContextSpec, Masking, executed_tiles
    from jaxpar.kernels.attention.tiles import tile
    from jaxpar.kernels.attention.order import chunk_length

    mesh = jax.make_mesh((n,), ("context",), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))
    spec = ContextSpec(impl, mesh, ("context",), P(None, "context"), P(None, "context"), layout, Masking(True, block, block))
    x = jax.random.normal(jax.random.key(0), (1, s, heads, head_dim))
    tiles = np.asarray(jax.jit(lambda q: executed_tiles(q, q, q, None, spec))(x))
    local_heads = heads // n if impl == "ulysses" else heads
    bq = tile(chunk_length(layout, n, s), block)  # the kernels' tiles divide the layout's chunks
    flops = tiles * 4 * bq * bq * head_dim * local_heads  # QK^T and PV per tile
    return {"impl": impl, "layout": layout, "devices": n, "seq": s, "flops_per_device": flops.tolist(),
            "max_over_min": float(flops.max() / flops.min()),
            "useful_flops": 4 * head_dim * heads * s * (s + 1) / 2 / n}


def long_row(s: int) -> dict:
    from jaxpar.config import apply_overrides
    from jaxpar.inspect import inspect_step
    from jaxpar.train import build
    from jaxpar.recipes import load

    config = apply_overrides(load("llama_long"), [f"train.seq_len={s}"])
    report = inspect_step(build(config))
    m = report.memory
    total = m.total
    return {"seq": s, "mesh": {k: v for k, v in report.mesh.items() if v > 1}, "bytes_per_device": total,
            "temporaries": m.temporaries, "model_state": m.model_state, "bytes_x_8_over_s": total * 8 / s,
            "compile_seconds": report.compile_seconds}


def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def render(doc: dict) -> str:
    lines = render_window(doc["window"]) if doc.get("window") else []
    if "memory" not in doc:
        return "\n".join(lines)
    lines += ["", "per-device memory of one causal attention layer, forward + backward "
              f"(batch 1, {HEADS} heads x {HEAD_DIM}, fp32, tiles {BLOCK})",
             f"{'impl':<18}{'n':>3}{'seq':>8}{'MiB/device':>12}{'B per token held':>18}{'largest buf / (s/n)^2':>23}{'s x s?':>8}"]
    for r in doc["memory"]:
        slope = "" if r["bytes_per_local_token"] is None else f"{r['bytes_per_local_token']:,.0f}"
        lines.append(f"{r['impl']:<18}{r['devices']:>3}{r['seq']:>8}{_mib(r['bytes_per_device']):>12}"
                     f"{slope:>18}{r['largest_over_score_block']:>23.3f}{'yes' if r['holds_s_by_s'] else 'no':>8}")
    lines += ["", "causal load balance: attention FLOPs per device in the forward pass (kernel tile counts)",
              f"{'impl':<11}{'layout':<12}{'n':>3}{'max/min':>9}{'computed/useful':>17}"]
    for r in doc["balance"]:
        lines.append(f"{r['impl']:<11}{r['layout']:<12}{r['devices']:>3}{r['max_over_min']:>9.3f}"
                     f"{max(r['flops_per_device']) / r['useful_flops']:>17.3f}")
    lines += ["", "collective bytes per device over the context axis, one layer forward + backward",
              f"{'impl':<11}{'n':>3}{'kind':<20}{'measured':>14}{'formula':>14}{'ratio':>8}"]
    for r in doc["traffic"]:
        for k in r["by_kind"]:
            lines.append(f"{r['impl']:<11}{r['devices']:>3}  {k['kind']:<18}{k['measured_bytes']:>14,}"
                         f"{k['formula_bytes']:>14,.0f}{k['ratio']:>8.3f}")
        if r["unexpected_kinds"]:
            lines.append(f"{'':<14}also: {', '.join(r['unexpected_kinds'])}")
    lines += ["", "llama_long whole training step (context=8, ring): per-device memory from the compiled step",
              f"{'seq':>8}{'MiB/device':>12}{'temporaries':>13}{'x 8/s (B)':>11}{'compile s':>11}"]
    for r in doc["llama_long"]:
        lines.append(f"{r['seq']:>8}{_mib(r['bytes_per_device']):>12}{_mib(r['temporaries']):>13}"
                     f"{r['bytes_x_8_over_s']:>11,.0f}{r['compile_seconds']:>11.1f}")
    return "\n".join(lines)


def render_window(rows: list[dict]) -> list[str]:
    lines = [f"a sliding window over context={rows[0]['devices']}, seq {rows[0]['seq']}: one causal layer, forward + "
             "backward (bytes) and the forward's attention FLOPs per device",
             f"{'impl':<11}{'order':<12}{'window':>7}{'MiB sent':>10}{'formula':>10}{'ratio':>7}"
             f"{'GFLOP max':>11}{'formula':>9}{'ratio':>7}"]
    for r in rows:
        fl = r["formula_flops"]
        flops = f"{fl / 1e9:>9.2f}{r['max_flops'] / fl:>7.3f}" if fl else f"{'-':>9}{'-':>7}"
        lines.append(f"{r['impl']:<11}{r['layout']:<12}{r['window'] or '-':>7}{_mib(r['measured_bytes']):>10}"
                     f"{_mib(r['formula_bytes']):>10}{r['bytes_ratio']:>7.3f}{r['max_flops'] / 1e9:>11.2f}{flops}")
    return lines


if __name__ == "__main__":
    main()
