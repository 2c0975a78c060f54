"""The training loop: compile once, run steps, show progress, write per-step metrics.

Metrics of step i are read back while step i+1 runs, so the host never stalls the devices.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import IO

import jax
from jax.experimental import multihost_utils
from tqdm import tqdm

from jaxpar.data.sources import make_source
from jaxpar.data.user import UserBatches, UserData
from jaxpar.errors import Preempted, TrainingStopped
from jaxpar.flops import mfu, peak_flops
from jaxpar.train.checkpoint import Checkpoints
from jaxpar.train.trainer import Trainer


def tokens_per_step(trainer: Trainer) -> int:
    train = trainer.config.train
    return train.global_batch * (train.seq_len if trainer.config.model.task == "lm" else 1)


def run(trainer: Trainer, steps: int | None = None, metrics_file: str | None = None, progress: bool = True,
        data: UserData | None = None) -> list[dict]:
    """Train up to step `steps` (default train.steps) and return per-step metrics. With
    `checkpoint.dir` set, resume from its latest checkpoint (if any), save every
    `checkpoint.every` steps and at the end. `data`: the user's own host-local batches, a
    function step -> batch or an iterable (jaxpar.data.user); default the config's source."""
    cfg = trainer.config
    steps = cfg.train.steps if steps is None else steps
    ckpt = cfg.checkpoint
    checkpoints = Checkpoints.open(ckpt.dir, ckpt.keep, ckpt.async_save) if ckpt.dir else None
    source = make_source(trainer) if data is None else UserBatches(trainer, data)
    if data is not None:  # the first batch is checked before the compile
        source.peek((checkpoints.latest_step() if checkpoints is not None else None) or 0)
    devices = trainer.mesh.devices.flatten()
    tokens = tokens_per_step(trainer)
    flops = cfg.model.flops_per_token(cfg.train.seq_len) * tokens
    peak = peak_flops(devices[0], cfg.train.peak_tflops)

    t0 = time.perf_counter()
    step_fn = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    start = 0
    if checkpoints is not None and checkpoints.latest_step() is not None:
        state, start = checkpoints.restore(trainer)
    else:
        state = trainer.init()
    if progress:
        tqdm.write(f"compiled the step in {time.perf_counter() - t0:.1f}s")
    if start and jax.process_index() == 0:
        print(f"resumed from step {start} ({ckpt.dir})", flush=True)

    history: list[dict] = []
    if metrics_file and start:  # a resumed run replaces what the lost one logged past the checkpoint
        _truncate_metrics(metrics_file, start)
    out: IO | None = open(metrics_file, "a" if start else "w") if metrics_file else None
    bar = tqdm(total=steps, initial=start, disable=not progress, unit="step", dynamic_ncols=True)
    pending = None
    skipped = 0  # steps not applied for a non-finite loss or gradient
    last = time.perf_counter()

    def check(step: int, values: dict) -> None:
        nonlocal skipped
        if values["nonfinite"]:
            skipped += 1
            if cfg.train.on_nonfinite == "stop":
                raise TrainingStopped(_nonfinite_message(trainer, step, values))

    # With several processes JAX's preemption service takes SIGTERM: every process learns of
    # it, and all agree on the step after which to save and stop.
    preemptible = jax.process_count() > 1
    preempted_at = None
    end = steps
    try:
        step = start - 1
        while step < end:
            step += 1
            if step < end:
                state, metrics = step_fn(state, source(step))
            if pending is not None:  # read step-1 while `step` runs
                values = {k: float(v) for k, v in jax.device_get(pending[1]).items()}
                check(pending[0], values)
                now = time.perf_counter()
                seconds, last = now - last, now
                record = {"step": pending[0], **values, "tokens_per_s": tokens / seconds, "step_time_s": seconds}
                util = mfu(flops, seconds, len(devices), peak)
                if util is not None:
                    record["mfu"] = util
                history.append(record)
                if out:
                    out.write(json.dumps(record) + "\n")
                    out.flush()
                bar.set_postfix_str(
                    (f"skipped={skipped} " if skipped else "") + f"loss={values['loss']:.4f} tok/s={record['tokens_per_s']:,.0f} "
                    f"mfu={'n/a' if util is None else f'{util:.1%}'}" + _expert_postfix(values),
                    refresh=False,
                )
                bar.update(1)
            pending = None
            if step < end:
                done = step + 1
                if preemptible and multihost_utils.reached_preemption_sync_point(done):
                    preempted_at = end = done  # read this step's metrics, save, and stop
                if checkpoints is not None and (done == end or (ckpt.every and done % ckpt.every == 0)):
                    # Every earlier step has been checked; check this one before saving it
                    # (the save waits for the step anyway), so no checkpoint holds a step
                    # past one that stopped the run.
                    if cfg.train.on_nonfinite == "stop" and float(metrics["nonfinite"]):
                        check(step, {k: float(v) for k, v in jax.device_get(metrics).items()})
                    checkpoints.save(trainer, state, done)
                pending = (step, metrics)
    finally:
        bar.close()
        if out:
            out.close()
        if checkpoints is not None:
            checkpoints.close()  # waits for saves in flight
    if preempted_at is not None:
        raise Preempted(preempted_at, ckpt.dir if checkpoints is not None else None)
    return history


def _truncate_metrics(path: str, start: int) -> None:
    file = pathlib.Path(path)
    if file.exists():
        rows = [line for line in file.read_text().splitlines() if line and json.loads(line)["step"] < start]
        file.write_text("".join(row + "\n" for row in rows))


def _nonfinite_message(trainer: Trainer, step: int, values: dict) -> str:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(trainer.abstract_state().params)[0]]
    index, count = int(values["first_nonfinite_grad"]), int(values["nonfinite_grads"])
    grads = f"the first non-finite gradient is {paths[index]} ({count} of {len(paths)} are)" if index >= 0 else "the gradients are finite"
    return (
        f"step {step}: the loss is {values['loss']} and {grads}; the step was not applied. Lower optim.lr, check the "
        "data, or set train.on_nonfinite=skip to go on without such steps"
    )


def _expert_postfix(values: dict) -> str:
    """MoE runs: dropped share and expert load max/mean (1.0 is balanced)."""
    if "moe_load" not in values:
        return ""
    return f" drop={values['moe_dropped']:.1%} load={values['moe_load']:.2f}"
