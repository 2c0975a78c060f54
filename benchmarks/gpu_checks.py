"""Checks that need one GPU, for kernels and placements the CPU suite can only lower:

  1. pallas: the fused Pallas (Triton) attention block forward against its plain
     reference, the pure-JAX block forward: output and log-normaliser error, and time
     side by side (same inputs, same run).
  2. grouped: the dropless experts' grouped matmul (jax.lax.ragged_dot, custom VJP)
     against a per-group loop of matmuls, values and gradients, and its time against
     running every row through every expert (the reference's dense cost).
  3. offload: the `llama` recipe on one GPU with `parallel.offload_optimizer` off and on:
     where the optimizer state rests between steps, the compiled device bytes, losses of
     the same steps (must agree), and step time side by side; and `model.remat=offload`
     beside `full`: pinned-host temporaries and device temporaries.

  python benchmarks/gpu_checks.py [--out benchmarks/results/gpu_checks.json]

Each section records its error instead of stopping the others. On a machine without a
GPU it says so and exits.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.targets


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/gpu_checks.json")
    p.add_argument("--repeats", type=int, default=20)
    return p.parse_args()


def timed(fn, *args, repeats: int = 20) -> float:
    """Median seconds of `repeats` calls after one warm-up (compile) call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel_error(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(b)
    return float(np.max(np.abs(a[finite] - b[finite])) / max(np.max(np.abs(b[finite])), 1e-30))


def pallas_rows(repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxpar.kernels.attention import blocks
    from jaxpar.kernels.attention.blocks import Masking

    rows = []
    for s, d, dtype, causal, packed in [
        (2048, 128, "bfloat16", True, False),
        (8192, 128, "bfloat16", True, False),
        (8192, 128, "bfloat16", False, False),
        (8192, 64, "bfloat16", True, True),
        (4096, 128, "float32", True, False),
    ]:
        b, g, r = 1, 2, 4
        k = jax.random.split(jax.random.key(s + d), 3)
        q = jax.random.normal(k[0], (b, s, g, r, d), dtype)
        kk = jax.random.normal(k[1], (b, s, g, d), dtype)
        v = jax.random.normal(k[2], (b, s, g, d), dtype)
        index = jnp.arange(s, dtype=jnp.int32)
        seg = (jnp.arange(s, dtype=jnp.int32)[None] * 3 // s).repeat(b, 0) if packed else None
        args = (q, kk, v, index, index, seg, seg)
        plain = jax.jit(lambda *a: blocks.forward(*a, Masking(causal, 512, 512)))
        fused = jax.jit(lambda *a: blocks.forward(*a, Masking(causal, 512, 512, kernel="pallas")))
        # the reference in float32: both kernels accumulate in float32
        want = jax.jit(lambda *a: blocks.forward(*a, Masking(causal, 512, 512)))(
            *(x.astype(jnp.float32) for x in args[:3]), *args[3:]
        )
        got_plain, got_fused = plain(*args), fused(*args)
        rows.append({
            "seq": s, "head_dim": d, "dtype": dtype, "causal": causal, "packed": packed,
            "pallas_out_error": rel_error(got_fused[0], want[0]),
            "jax_out_error": rel_error(got_plain[0], want[0]),
            "pallas_lse_error": rel_error(got_fused[1], want[1]),
            "jax_seconds": timed(plain, *args, repeats=repeats),
            "pallas_seconds": timed(fused, *args, repeats=repeats),
        })
    return rows


def grouped_rows(repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.kernels.experts.grouped import grouped_matmul

    rows = []
    for m, kdim, n, groups, dtype in [(8192, 1024, 2816, 8, "bfloat16"), (4096, 512, 1024, 8, "float32")]:
        rng = np.random.default_rng(0)
        sizes = rng.multinomial(m, np.ones(groups) / groups).astype(np.int32)
        k = jax.random.split(jax.random.key(1), 3)
        x = jax.random.normal(k[0], (m, kdim), dtype)
        w = (jax.random.normal(k[1], (groups, kdim, n), jnp.float32) * kdim**-0.5).astype(dtype)
        dy = jax.random.normal(k[2], (m, n), dtype)
        group_sizes = jnp.asarray(sizes)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])

        def looped(x, w):  # one matmul per group, float32
            return jnp.concatenate([x[a : a + c].astype(jnp.float32) @ w[g].astype(jnp.float32)
                                    for g, (a, c) in enumerate(zip(starts, sizes))])

        def dense(x, w):  # every row through every expert, then each row's own: the reference's cost
            ids = jnp.repeat(jnp.arange(groups), group_sizes, total_repeat_length=m)
            every = jnp.einsum("mk,gkn->gmn", x, w)
            return jnp.take_along_axis(every, ids[None, :, None], axis=0)[0]

        def vjp_of(fn):
            return jax.jit(lambda x, w, dy: jax.vjp(fn, x, w)[1](dy))

        grouped = lambda x, w: grouped_matmul(x, w, group_sizes)  # noqa: E731
        y, y_ref = jax.jit(grouped)(x, w), jax.jit(looped)(x, w)
        dx, dw = vjp_of(grouped)(x, w, dy)
        dx_ref, dw_ref = vjp_of(looped)(x.astype(jnp.float32), w.astype(jnp.float32), dy.astype(jnp.float32))
        rows.append({
            "rows": m, "k": kdim, "n": n, "groups": groups, "dtype": dtype,
            "out_error": rel_error(y, y_ref), "dx_error": rel_error(dx, dx_ref), "dw_error": rel_error(dw, dw_ref),
            "grouped_seconds": timed(jax.jit(grouped), x, w, repeats=repeats),
            "dense_seconds": timed(jax.jit(dense), x, w, repeats=repeats),
            "grouped_fwd_bwd_seconds": timed(vjp_of(grouped), x, w, dy, repeats=repeats),
        })
    return rows


def offload_rows(steps: int = 12) -> list[dict]:
    import jax

    from jaxpar.cli import resolve_config
    from jaxpar.config import apply_overrides
    from jaxpar.data.sources import make_source
    from jaxpar.train import build

    rows = []
    base = resolve_config("llama", [], 1)
    for name, overrides in [
        ("resident", []),
        ("offload_optimizer", ["parallel.offload_optimizer=true"]),
        ("remat_full", ["model.remat=full"]),
        ("remat_offload", ["model.remat=offload"]),
    ]:
        config = apply_overrides(base, overrides + [f"train.steps={steps}"])
        trainer = build(config, jax.devices()[:1])
        compiled = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
        stats = compiled.memory_analysis()
        state = trainer.init()
        kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)})
        source = make_source(trainer)
        losses, times = [], []
        for i in range(steps):
            t0 = time.perf_counter()
            state, metrics = trainer.step(state, source(i))
            losses.append(float(metrics["loss"]))  # waits for the step
            times.append(time.perf_counter() - t0)
        after = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)})
        rows.append({
            "setting": name, "optimizer_state_memory_kinds": kinds, "after_steps": after,
            "device_arguments_bytes": stats.argument_size_in_bytes,
            "device_temporaries_bytes": stats.temp_size_in_bytes,
            "host_arguments_bytes": getattr(stats, "host_argument_size_in_bytes", None),
            "host_temporaries_bytes": stats.host_temp_size_in_bytes,
            "losses": losses, "step_seconds": statistics.median(times[2:]),
        })
    return rows


def main() -> None:
    args = parse_args()
    import jax

    if jax.devices()[0].platform != "gpu":
        print(f"no GPU here ({jax.devices()[0].platform}): nothing to check")
        return
    doc = {"setup": {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "machine": platform.machine(),
                     "date": time.strftime("%Y-%m-%d")}}
    for name, fn in [("pallas", lambda: pallas_rows(args.repeats)), ("grouped", lambda: grouped_rows(args.repeats)),
                     ("offload", offload_rows)]:
        t0 = time.perf_counter()
        try:
            doc[name] = fn()
        except Exception:  # record and go on: each section stands alone
            doc[name] = {"error": traceback.format_exc()}
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        print(json.dumps(doc[name], indent=1), flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
