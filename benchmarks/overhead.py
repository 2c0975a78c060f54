"""jaxpar's train step vs a hand-written `jax.jit` step: same model, layout, optimizer, data.

A: `trainer.step(state, batch)` from `jaxpar.train.build(recipes.load("llama") + layout)`.
B: what a user writes without the trainer: the same `jaxpar.models.llama.Llama` (activation
   annotations active via `use_layout` while tracing), the same optax optimizer, the same
   parameter/optimizer-state shardings, mixed-precision cast, mean token cross-entropy,
   `jax.value_and_grad`, `tx.update`, `optax.apply_updates`, one donated `jax.jit`.

Both start from the same parameters; the first step's loss must agree before anything is
timed. Then R rounds, each timing N steps of A and N steps of B (order alternating per
round, one block_until_ready per timed block).

On a 2-core machine a process's luck (where its buffers and threads land) moves one side's
time by up to 20% for its whole life, both ways; rounds inside one process cannot average
that out. So P processes each run the R rounds, one after the other, and the figure is the
median ratio over all P x R rounds, with its spread: the interquartile range of the
rounds and the range of the processes' own medians. Quote the median with that spread.

  python benchmarks/overhead.py [--devices 8] [--steps 20] [--rounds 9] [--processes 3]
      [--dtype float32] [--layout "mesh.data=2 mesh.fsdp=2 mesh.tensor=2 parallel.tensor.sequence_parallel=true"]
      [--out benchmarks/results/overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.targets

from jaxpar.mesh import force_cpu_devices  # noqa: E402  (imports jax but starts no backend)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=8, help="CPU devices to force (ignored on GPU/TPU)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=9, help="rounds per process")
    p.add_argument("--processes", type=int, default=3, help="processes run one after the other, each R rounds")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one process's rounds, as JSON into this file
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="train.compute_dtype")
    p.add_argument("--layout", default="mesh.data=2 mesh.fsdp=2 mesh.tensor=2 parallel.tensor.sequence_parallel=true")
    p.add_argument("--out", default="benchmarks/results/overhead.json")
    return p.parse_args()


def hand_written(config, trainer):
    """The step a user writes with plain JAX; only the shardings are borrowed from jaxpar."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxpar.sharding import use_layout
    from jaxpar.step.loss import cross_entropy_sum
    from jaxpar.step.optim import make_optimizer

    tx, lr_schedule = make_optimizer(config.optim, config.train.steps)
    dtype = jnp.dtype(config.train.compute_dtype)
    ss = trainer.state_shardings
    state_sh = {"step": ss.step, "params": ss.params, "opt_state": ss.opt_state}
    replicated = ss.step

    def build_model():
        with nnx.use_eager_sharding(False):
            return config.model.build(nnx.Rngs(config.train.seed))

    graphdef, _ = nnx.split(nnx.eval_shape(build_model))

    def init():
        params = nnx.to_pure_dict(nnx.state(build_model()))
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    def loss_fn(params, batch):
        cast = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
        logits = nnx.merge(graphdef, cast)(batch["inputs"])
        total, weight = cross_entropy_sum(logits, batch["targets"], batch["weights"])
        return total / weight

    def step(state, batch):
        with use_layout(trainer.layout):
            loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": jnp.asarray(lr_schedule(state["step"]), jnp.float32),
        }
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    init = jax.jit(init, out_shardings=state_sh)
    step = jax.jit(step, in_shardings=(state_sh, trainer.batch.shardings),
                   out_shardings=(state_sh, replicated), donate_argnums=0)
    return init, step


def timed_block(fn, state, batches, n):
    import jax

    t0 = time.perf_counter()
    for i in range(n):
        state, metrics = fn(state, batches[i % len(batches)])
    jax.block_until_ready((state, metrics))
    return state, (time.perf_counter() - t0) / n


def measure(args) -> dict:
    """One process: compile both steps, check they agree, time the rounds."""
    force_cpu_devices(args.devices)
    import jax

    import jaxpar.train
    from jaxpar import recipes
    from jaxpar.config import apply_overrides, flatten
    from jaxpar.data.sources import make_source

    overrides = args.layout.split() + [f"train.compute_dtype={args.dtype}"]
    config = apply_overrides(recipes.load("llama"), overrides)
    trainer = jaxpar.train.build(config)
    source = make_source(trainer.batch, trainer.config)
    batches = [source(i) for i in range(4)]  # made once, shared: data generation is not timed
    hand_init, hand_step = hand_written(config, trainer)

    fns = {"jaxpar": trainer.step, "hand": hand_step}
    states = {"jaxpar": trainer.init(), "hand": hand_init()}
    first = {}
    for name, fn in fns.items():  # first call compiles; its loss is the equivalence check
        states[name], metrics = fn(states[name], batches[0])
        first[name] = {k: float(v) for k, v in jax.device_get(metrics).items()}
    rel = abs(first["jaxpar"]["loss"] - first["hand"]["loss"]) / abs(first["hand"]["loss"])
    tol = 1e-4 if args.dtype == "float32" else 1e-2
    assert rel < tol, f"losses differ by {rel:.2e} (> {tol:.0e}): not the same computation"

    for _ in range(2):  # warm up (thread pools, allocator) alternately, like the rounds
        for name, fn in fns.items():
            states[name], _ = timed_block(fn, states[name], batches, args.steps)
    rounds = []
    for r in range(args.rounds):
        order = ["jaxpar", "hand"] if r % 2 == 0 else ["hand", "jaxpar"]
        ms = {}
        for name in order:
            states[name], sec = timed_block(fns[name], states[name], batches, args.steps)
            ms[name] = 1e3 * sec
        rounds.append({"order": order, "jaxpar_ms": ms["jaxpar"], "hand_ms": ms["hand"], "ratio": ms["jaxpar"] / ms["hand"]})
    dev = jax.devices()[0]
    return {"first_step": first, "loss_rel_diff": rel, "rounds": rounds, "overrides": overrides,
            "config": {k: str(v) for k, v in flatten(config).items()}, "jax_version": jax.__version__,
            "device": f"{len(jax.devices())} x {dev.device_kind} ({dev.platform}), {os.cpu_count()} host cores"}


def run_processes(args) -> list[dict]:
    """Each process's measure(), one after the other (they would share the cores)."""
    results = []
    for i in range(args.processes):
        with tempfile.TemporaryDirectory() as tmp:
            out = pathlib.Path(tmp) / "rounds.json"
            command = [sys.executable, __file__, "--child", str(out), "--devices", str(args.devices),
                       "--steps", str(args.steps), "--rounds", str(args.rounds), "--dtype", args.dtype, "--layout", args.layout]
            subprocess.run(command, check=True)
            results.append(json.loads(out.read_text()))
        r = results[-1]
        print(f"process {i}: first-step loss difference {r['loss_rel_diff']:.1e}; median ratio "
              f"{statistics.median(x['ratio'] for x in r['rounds']):.3f} over {len(r['rounds'])} rounds", flush=True)
    return results


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def main() -> None:
    args = parse_args()
    if args.child:
        pathlib.Path(args.child).write_text(json.dumps(measure(args)))
        return
    processes = run_processes(args)
    rounds = [x for p in processes for x in p["rounds"]]
    ratios = [x["ratio"] for x in rounds]
    q1, median, q3 = quartiles(ratios)
    per_process = [statistics.median(x["ratio"] for x in p["rounds"]) for p in processes]
    print(f"\n{processes[0]['device']}; layout: {args.layout}; compute_dtype={args.dtype}; {args.steps} steps/block")
    print(f"{'process':>7} {'jaxpar ms':>10} {'hand ms':>9} {'ratio':>7}   (medians of {args.rounds} rounds)")
    for i, p in enumerate(processes):
        print(f"{i:>7} {statistics.median(x['jaxpar_ms'] for x in p['rounds']):>10.2f} "
              f"{statistics.median(x['hand_ms'] for x in p['rounds']):>9.2f} {per_process[i]:>7.3f}")
    print(f"median ratio jaxpar/hand over {len(ratios)} rounds = {median:.3f} (interquartile {q1:.3f}-{q3:.3f}; "
          f"process medians {min(per_process):.3f}-{max(per_process):.3f}); target <= 1.00: "
          f"{'ok' if median <= 1.0 else 'MISSED'}")

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    first = processes[0]
    out.write_text(json.dumps({
        "layout": args.layout, "overrides": first["overrides"], "config": first["config"], "steps_per_block": args.steps,
        "first_step": first["first_step"], "loss_rel_diff": max(p["loss_rel_diff"] for p in processes),
        "processes": [p["rounds"] for p in processes], "process_medians": per_process, "median_ratio": median,
        "interquartile": [q1, q3], "jax_version": first["jax_version"], "python": platform.python_version(),
        "device": first["device"],
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
