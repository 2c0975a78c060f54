"""Checks that need one GPU, for kernels and placements the CPU suite can only lower:

  1. pallas: the fused Pallas (Triton) attention block forward against its plain
     reference, the pure-JAX block forward: output and log-normaliser error, and time
     side by side (same inputs, same run); one case with a sliding window of 1024.
  2. grouped: the dropless experts' grouped matmul (jax.lax.ragged_dot, custom VJP)
     against a per-group loop of matmuls, values and gradients, and its time against
     running every row through every expert (the reference's dense cost).
  3. offload: the `llama` recipe on one GPU with `parallel.zero.offload_optimizer` and
     `offload_params` off and on: where the optimizer state and parameters rest between
     steps, the compiled device bytes, losses of the same steps (must agree), and step time side by side; and `model.remat=offload`
     beside `full`: pinned-host temporaries and device temporaries.
  4. cudnn: cuDNN's fused attention as jaxpar runs it for parallel.attention=cudnn (and
     auto on GPUs): `attend` under a layout whose attention is cudnn, that is
     jax.nn.dot_product_attention(implementation="cudnn"), against the plain reference
     attention (scores materialised, softmax in float32) in the same dtype, both measured
     against that reference in float32: output and dq, dk, dv errors, bf16 and fp16,
     causal and not, grouped-query heads, a sliding window; forward and forward+backward
     time side by side.
     Packed documents are not checked: jaxpar's cuDNN path takes no segment ids (attend
     refuses them, and the checks refuse attention=cudnn with data.eos_id set).
  5. muon: the 0.9B Llama (benchmarks/mfu.py's shape, batch 8, remat dots) with AdamW, Muon and
     Muon in bfloat16 (optim.ns_dtype): the step measured beside the cost model's prediction
     of the same program.

  python benchmarks/gpu_checks.py [--out benchmarks/results/gpu_checks.json]
  python benchmarks/gpu_checks.py --only cudnn        # one section (or several: pallas,grouped)

Each section records its error instead of stopping the others, and the JSON is rewritten
after each section, so a run stopped part way keeps the sections it finished. On a machine
without a GPU it says so and exits.
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
    p.add_argument("--only", metavar="SECTION[,SECTION]", help=f"run only these sections, of {','.join(SECTIONS)}")
    args = p.parse_args()
    args.only = args.only.split(",") if args.only else list(SECTIONS)
    unknown = [name for name in args.only if name not in SECTIONS]
    if unknown:
        p.error(f"--only: unknown section {','.join(unknown)}; use some of {','.join(SECTIONS)}")
    return args


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
    from jaxpar.kernels.attention.tiles import Masking

    rows = []
    for s, d, dtype, causal, packed, window in [
        (2048, 128, "bfloat16", True, False, 0),
        (8192, 128, "bfloat16", True, False, 0),
        (8192, 128, "bfloat16", False, False, 0),
        (8192, 64, "bfloat16", True, True, 0),
        (4096, 128, "float32", True, False, 0),
        (8192, 128, "bfloat16", True, False, 1024),  # a sliding window (Mistral's, Gemma 3's local 1024)
    ]:
        b, g, r = 1, 2, 4
        k = jax.random.split(jax.random.key(s + d), 3)
        q = jax.random.normal(k[0], (b, s, g, r, d), dtype)
        kk = jax.random.normal(k[1], (b, s, g, d), dtype)
        v = jax.random.normal(k[2], (b, s, g, d), dtype)
        index = jnp.arange(s, dtype=jnp.int32)
        seg = (jnp.arange(s, dtype=jnp.int32)[None] * 3 // s).repeat(b, 0) if packed else None
        args = (q, kk, v, index, index, seg, seg)
        plain = jax.jit(lambda *a: blocks.forward(*a, Masking(causal, 512, 512, window=window)))
        fused = jax.jit(lambda *a: blocks.forward(*a, Masking(causal, 512, 512, kernel="pallas", window=window)))
        # the reference in float32: both kernels accumulate in float32
        want = jax.jit(lambda *a: blocks.forward(*a, Masking(causal, 512, 512, window=window)))(
            *(x.astype(jnp.float32) for x in args[:3]), *args[3:]
        )
        got_plain, got_fused = plain(*args), fused(*args)
        rows.append({
            "seq": s, "head_dim": d, "dtype": dtype, "causal": causal, "packed": packed, "window": window,
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


def run_steps(step, state, source, steps: int) -> tuple:
    """(the state after, each step's loss, each step's seconds) of `steps` steps on the
    source's batches, each timed to its loss (which waits for it)."""
    losses, times = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, source(i))
        losses.append(float(metrics["loss"]))
        times.append(time.perf_counter() - t0)
    return state, losses, times


def offload_rows(steps: int = 12) -> list[dict]:
    import jax

    from jaxpar.recipes import resolve_config
    from jaxpar.config import apply_overrides
    from jaxpar.data.sources import make_source
    from jaxpar.train import build

    rows = []
    base = resolve_config("llama", [], 1)
    for name, overrides in [
        ("resident", []),
        ("offload_optimizer", ["parallel.zero.offload_optimizer=true"]),
        ("offload_params", ["parallel.zero.offload_params=true"]),
        ("remat_full", ["model.remat=full"]),
        ("remat_offload", ["model.remat=offload"]),
    ]:
        config = apply_overrides(base, overrides + [f"train.steps={steps}"])
        trainer = build(config, jax.devices()[:1])
        compiled = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
        stats = compiled.memory_analysis()
        state = trainer.init()
        kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)})
        param_kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.params)})
        source = make_source(trainer.batch, trainer.config)
        state, losses, times = run_steps(trainer.step, state, source, steps)
        after = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)})
        rows.append({
            "setting": name, "optimizer_state_memory_kinds": kinds, "after_steps": after,
            "param_memory_kinds": param_kinds,
            "device_arguments_bytes": stats.argument_size_in_bytes,
            "device_temporaries_bytes": stats.temp_size_in_bytes,
            "host_arguments_bytes": getattr(stats, "host_argument_size_in_bytes", None),
            "host_temporaries_bytes": stats.host_temp_size_in_bytes,
            "losses": losses, "step_seconds": statistics.median(times[2:]),
        })
    return rows


def muon_rows(steps: int = 10) -> list[dict]:
    """The 0.9B Llama of benchmarks/mfu.py (batch 8 x 2048, bf16, remat dots) on one GPU with
    AdamW, Muon and Muon iterating in bfloat16: the median step beside the cost model's
    prediction of the same compiled program (jaxpar.inspect.cost), and the losses."""
    import jax

    from benchmarks.mfu import SHAPE, jaxpar_config
    from jaxpar.config import apply_overrides
    from jaxpar.data.sources import make_source
    from jaxpar.inspect.cost import GpuCost, step_cost
    from jaxpar.train import build

    rows = []
    for name, overrides in [("adamw", []), ("muon", ["optim.name=muon"]),
                            ("muon_bf16", ["optim.name=muon", "optim.ns_dtype=bfloat16"])]:
        config = apply_overrides(jaxpar_config(dict(SHAPE), 8, 2048, "dots", steps), overrides)
        trainer = build(config, jax.devices()[:1])
        compiled = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
        gpu = GpuCost.of(jax.devices()[0].device_kind)
        predicted = step_cost(compiled.as_text(), gpu).seconds if gpu else None
        state, source = trainer.init(), make_source(trainer.batch, trainer.config)
        state, losses, times = run_steps(compiled, state, source, steps)
        measured = statistics.median(times[2:])
        rows.append({"setting": name, "overrides": overrides, "step_seconds": measured, "predicted_seconds": predicted,
                     "error": predicted / measured - 1 if predicted else None, "losses": losses})
        del state
    return rows


# batch, seq, heads, kv heads, head dim, dtype, causal, sliding window (0: none): mfu.py's
# attention first (GQA 2:1)
CUDNN_CASES = [
    (4, 2048, 16, 8, 128, "bfloat16", True, 0),
    (1, 8192, 16, 8, 128, "bfloat16", True, 0),
    (2, 4096, 16, 8, 128, "bfloat16", False, 0),
    (4, 2048, 16, 8, 128, "float16", True, 0),
    (2, 4096, 32, 4, 64, "bfloat16", True, 0),
    (1, 8192, 16, 8, 128, "bfloat16", True, 1024),  # the second case's, windowed: its time against it
]


def attention_as_jaxpar_runs_it(impl: str, causal: bool, window: int = 0):
    """`attend` under a one-device layout whose attention is `impl`: the call the models make,
    so this checks whatever jaxpar's cudnn path is, not a copy of it."""
    import jax

    from jaxpar.sharding import Layout, Rules, use_layout
    from jaxpar.sharding.attend import attend

    layout = Layout(mesh=jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]), rules=Rules.of({}, {}),
                    attention=impl)

    def fn(q, k, v):
        with use_layout(layout):
            return attend(q, k, v, causal=causal, window=window)

    return fn


def fwd_bwd(fn):
    """jit of (output, (dq, dk, dv)) for a cotangent dy."""
    import jax

    def both(q, k, v, dy):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(dy)

    return jax.jit(both)


def cudnn_case(b, s, h, g, d, dtype, causal, window, repeats: int, impl: str) -> dict:
    import re

    import jax
    import jax.numpy as jnp

    from jaxpar.kernels.attention import reference_attention

    k = jax.random.split(jax.random.key(s + h + d), 4)
    q = jax.random.normal(k[0], (b, s, h, d), dtype)
    kk, v = (jax.random.normal(key, (b, s, g, d), dtype) for key in k[1:3])
    dy = jax.random.normal(k[3], (b, s, h, d), dtype)
    args = (q, kk, v, dy)
    fused_fn = attention_as_jaxpar_runs_it(impl, causal, window)
    plain_fn = lambda q, k, v: reference_attention(q, k, v, causal=causal, window=window)  # noqa: E731
    fused, plain = fwd_bwd(fused_fn), fwd_bwd(plain_fn)
    want = plain(*(x.astype(jnp.float32) for x in args))  # the ground truth: the reference in float32
    got, same_dtype = fused(*args), plain(*args)
    compiled = fused.lower(*args).compile().as_text()  # the library calls it makes: cuDNN's, on a GPU
    row = {"kernels": sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled)))}
    for name, i in (("out", None), ("dq", 0), ("dk", 1), ("dv", 2)):
        pick = (lambda r: r[0]) if i is None else (lambda r, i=i: r[1][i])  # noqa: E731
        row[f"{impl}_{name}_error"] = rel_error(pick(got), pick(want))
        row[f"reference_{name}_error"] = rel_error(pick(same_dtype), pick(want))
    row.update({
        f"{impl}_forward_seconds": timed(jax.jit(fused_fn), q, kk, v, repeats=repeats),
        "reference_forward_seconds": timed(jax.jit(plain_fn), q, kk, v, repeats=repeats),
        f"{impl}_fwd_bwd_seconds": timed(fused, *args, repeats=repeats),
        "reference_fwd_bwd_seconds": timed(plain, *args, repeats=repeats),
    })
    return row


def cudnn_rows(repeats: int, cases=CUDNN_CASES, impl: str = "cudnn") -> list[dict]:
    """One row a case; a case cuDNN refuses (a dtype, a head dim) records why, the rest go on."""
    rows = []
    for b, s, h, g, d, dtype, causal, window in cases:
        row = {"batch": b, "seq": s, "heads": h, "kv_heads": g, "head_dim": d, "dtype": dtype, "causal": causal,
               "window": window}
        try:
            row.update(cudnn_case(b, s, h, g, d, dtype, causal, window, repeats, impl))
        except Exception as e:  # noqa: BLE001  (recorded: an unsupported case is a result too)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rows.append(row)
    rows.append({"packed": True, "skipped": "jaxpar's cudnn path takes no segment ids: attend raises on them and the "
                 "checks refuse attention=cudnn with packed documents (data.eos_id >= 0); flash covers packing"})
    return rows


SECTIONS = {
    "pallas": lambda args: pallas_rows(args.repeats),
    "grouped": lambda args: grouped_rows(args.repeats),
    "offload": lambda args: offload_rows(),
    "muon": lambda args: muon_rows(),
    "cudnn": lambda args: cudnn_rows(args.repeats),
}


def write(doc: dict, out: pathlib.Path) -> None:
    """Atomically (a temporary file renamed): a reader (the GPU battery) never sees half a
    file, and an interrupted run leaves the last whole one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(out)


def main() -> None:
    args = parse_args()
    from jaxpar.device_memory import share_gpu_memory

    share_gpu_memory()  # as jaxpar's commands do
    import jax

    if jax.devices()[0].platform != "gpu":
        print(f"no GPU here ({jax.devices()[0].platform}): nothing to check")
        return
    doc = {"setup": {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "machine": platform.machine(),
                     "date": time.strftime("%Y-%m-%d")}}
    out = pathlib.Path(args.out)
    for name in args.only:
        t0 = time.perf_counter()
        try:
            doc[name] = SECTIONS[name](args)
        except Exception:  # record and go on: each section stands alone
            doc[name] = {"error": traceback.format_exc()}
        doc["setup"][f"{name}_seconds"] = time.perf_counter() - t0
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        print(json.dumps(doc[name], indent=1), flush=True)
        write(doc, out)  # after each section: a run stopped later keeps this one
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
