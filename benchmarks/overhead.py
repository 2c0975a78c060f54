"""jaxpar's train step vs a hand-written `jax.jit` step: same model, layout, optimizer, data.

A: `trainer.step(state, batch)` from `jaxpar.train.build(recipes.load("llama") + layout)`.
B: what a user writes without the trainer: the same `jaxpar.models.llama.Llama` (activation
   annotations active via `use_layout` while tracing), the same optax optimizer, the same
   parameter/optimizer-state shardings, mixed-precision cast, mean token cross-entropy,
   `jax.value_and_grad`, `tx.update`, `optax.apply_updates`, one donated `jax.jit`.

Both start from the same parameters; the first step's loss must agree before anything is
timed. Then R rounds, each timing N steps of A and N steps of B (order alternating per
round, one block_until_ready per timed block). Reported: ms/step and ratio A/B per round,
and the median ratio (quote that one: CPU timings are noisy).

  python benchmarks/overhead.py [--devices 8] [--steps 20] [--rounds 9] [--dtype float32]
      [--layout "mesh.data=2 mesh.fsdp=2 mesh.tensor=2 parallel.sequence_parallel=true"]
      [--out benchmarks/results/overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks.targets

from jaxpar.mesh import force_cpu_devices  # noqa: E402  (imports jax but starts no backend)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=8, help="CPU devices to force (ignored on GPU/TPU)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="train.compute_dtype")
    p.add_argument("--layout", default="mesh.data=2 mesh.fsdp=2 mesh.tensor=2 parallel.sequence_parallel=true")
    p.add_argument("--out", default="benchmarks/results/overhead.json")
    return p.parse_args()


def hand_written(config, trainer):
    """The step a user writes with plain JAX; only the shardings are borrowed from jaxpar."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxpar.sharding import use_layout
    from jaxpar.train.loss import cross_entropy_sum
    from jaxpar.train.optim import make_optimizer

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
    step = jax.jit(step, in_shardings=(state_sh, trainer.batch_shardings),
                   out_shardings=(state_sh, replicated), donate_argnums=0)
    return init, step


def timed_block(fn, state, batches, n):
    import jax

    t0 = time.perf_counter()
    for i in range(n):
        state, metrics = fn(state, batches[i % len(batches)])
    jax.block_until_ready((state, metrics))
    return state, (time.perf_counter() - t0) / n


def main() -> None:
    args = parse_args()
    force_cpu_devices(args.devices)
    import jax

    import jaxpar.train
    from jaxpar import recipes
    from jaxpar.config import apply_overrides, flatten
    from jaxpar.data.sources import make_source

    overrides = args.layout.split() + [f"train.compute_dtype={args.dtype}"]
    config = apply_overrides(recipes.load("llama"), overrides)
    trainer = jaxpar.train.build(config)
    source = make_source(trainer)
    batches = [source(i) for i in range(4)]  # made once, shared: data generation is not timed
    hand_init, hand_step = hand_written(config, trainer)

    t0 = time.perf_counter()
    fns = {"jaxpar": trainer.step, "hand": hand_step}
    states = {"jaxpar": trainer.init(), "hand": hand_init()}
    first = {}
    for name, fn in fns.items():  # first call compiles; its loss is the equivalence check
        states[name], metrics = fn(states[name], batches[0])
        first[name] = {k: float(v) for k, v in jax.device_get(metrics).items()}
    print(f"compiled both in {time.perf_counter() - t0:.1f}s; first-step metrics:")
    for name, m in first.items():
        print(f"  {name:7s} " + "  ".join(f"{k}={v:.6g}" for k, v in m.items()))
    rel = abs(first["jaxpar"]["loss"] - first["hand"]["loss"]) / abs(first["hand"]["loss"])
    tol = 1e-4 if args.dtype == "float32" else 1e-2
    assert rel < tol, f"losses differ by {rel:.2e} (> {tol:.0e}): not the same computation"
    print(f"  loss relative difference {rel:.2e} (< {tol:.0e})")

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

    median = statistics.median(x["ratio"] for x in rounds)
    dev = jax.devices()[0]
    device = f"{len(jax.devices())} x {dev.device_kind} ({dev.platform}), {os.cpu_count()} host cores"
    print(f"\n{device}; layout: {args.layout}; compute_dtype={args.dtype}; {args.steps} steps/block")
    print(f"{'round':>5} {'first':>7} {'jaxpar ms':>10} {'hand ms':>9} {'ratio':>7}")
    for i, x in enumerate(rounds):
        print(f"{i:>5} {x['order'][0]:>7} {x['jaxpar_ms']:>10.2f} {x['hand_ms']:>9.2f} {x['ratio']:>7.3f}")
    print(f"{'median':>5} {'':>7} {statistics.median(x['jaxpar_ms'] for x in rounds):>10.2f} "
          f"{statistics.median(x['hand_ms'] for x in rounds):>9.2f} {median:>7.3f}")
    print(f"median ratio jaxpar/hand = {median:.3f} (target <= 1.03: {'ok' if median <= 1.03 else 'MISSED'})")

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "layout": args.layout, "overrides": overrides, "config": {k: str(v) for k, v in flatten(config).items()},
        "steps_per_block": args.steps, "first_step": first, "loss_rel_diff": rel, "rounds": rounds,
        "median_ratio": median, "jax_version": jax.__version__, "python": platform.python_version(), "device": device,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
