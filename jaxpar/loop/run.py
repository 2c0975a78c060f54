"""The training loop: compile once, run steps, evaluate on held-out batches, show progress,
write per-step metrics (jaxpar.loop.metrics).

Metrics of step i are read back while step i+1 runs, so the host never stalls the devices;
a held-out evaluation after step i is queued before step i+1 and read with step i's row.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable

import jax
from jax.experimental import multihost_utils
from tqdm import tqdm

from jaxpar.data.sources import make_source
from jaxpar.data.user import UserBatches, UserData
from jaxpar.errors import Preempted, TrainingStopped
from jaxpar.flops import mfu, peak_flops
from jaxpar.loop.checkpoint import Checkpoints
from jaxpar.loop.evaluation import Sums, collect, open_evaluation
from jaxpar.loop.metrics import Writers, open_writers, prepare_outputs
from jaxpar.loop.profile import Profiler
from jaxpar.loop.start import start_of, starting_state
from jaxpar.loop.stop import Interrupted, StopSignals, say
from jaxpar.step.trainer import Trainer


def tokens_per_step(trainer: Trainer) -> int:
    train = trainer.config.train
    return train.global_batch * (train.seq_len if trainer.config.model.task == "lm" else 1)


def run(trainer: Trainer, steps: int | None = None, metrics_file: str | None = None, progress: bool | None = None,
        data: UserData | None = None, eval_data: UserData | None = None, tensorboard_dir: str | None = None,
        wandb_project: str | None = None) -> list[dict]:
    """Train up to step `steps` (default train.steps) and return per-step metrics. With
    `checkpoint.dir` set, resume from its latest checkpoint (if any), save every
    `checkpoint.every` steps and at the end; with none to resume from and
    `checkpoint.init_from` set, start from that Hugging Face checkpoint's weights (jaxpar.hf). `data`: the user's own host-local batches, a
    function step -> batch or an iterable (jaxpar.data.user); default the config's source.
    With train.eval_every > 0, the held-out loss (jaxpar.loop.evaluation) joins the rows of
    every eval_every-th step and of the last, as `eval_loss`; `eval_data`: the held-out
    batches in the format of `data` (needed with `data`; default the config's held-out part,
    jaxpar.data.heldout). Rows go to `metrics_file` (JSON Lines) and, as TensorBoard scalars,
    to `tensorboard_dir` and to the W&B project `wandb_project` (jaxpar.loop.metrics).
    `progress`: a bar (default: when stderr is a terminal); without one, a plain line every
    train.log_every steps. Ctrl-C or SIGTERM stops at the next step, saved, and says so at
    once; a second Ctrl-C raises jaxpar.loop.stop.Interrupted without waiting for the save
    (jaxpar.loop.stop); a directory that holds the last step already is left alone. A row's
    `step` is the number of steps done (1 for the first), as the plain lines and checkpoints
    count; the row of a step that saved has `save_s`, the time the save held the loop, apart
    from `step_time_s`."""
    cfg = trainer.config
    progress = sys.stderr.isatty() if progress is None else progress
    steps = cfg.train.steps if steps is None else steps
    ckpt = cfg.checkpoint
    checkpoints = Checkpoints.open(ckpt.dir, ckpt.keep, ckpt.async_save, remove_partial=True) if ckpt.dir else None
    source = make_source(trainer.batch, cfg) if data is None else UserBatches(trainer.batch, data)
    if data is not None:  # the first batch is checked before the compile
        source.peek((checkpoints.latest_step() if checkpoints is not None else None) or 0)
    if jax.process_index() == 0:  # what the run trains on, in one line, before the compile
        print(source.describe(steps), flush=True)
    evaluation = open_evaluation(trainer, data, eval_data, source if data is None else None)
    prepare_outputs(metrics_file, tensorboard_dir, wandb_project)
    profiler = Profiler(cfg.train.profile_steps, cfg.train.profile_dir)
    profiler.prepare()
    resuming = checkpoints is not None and checkpoints.latest_step() is not None
    state, start = _restored(checkpoints, trainer, steps, ckpt.dir) if resuming else (None, 0)  # before the compile
    if start >= steps:
        return []
    fresh = start_of(trainer)  # also on resume: LoRA's frozen base and DPO's reference are read from the start

    t0 = time.perf_counter()
    step_fn = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    evaluation = evaluation.compile(trainer) if evaluation is not None else None
    dpo = cfg.data.source == "preference" and data is None
    state = starting_state(trainer, fresh, state, source if dpo else None)
    lines = not progress and cfg.train.log_every > 0 and jax.process_index() == 0  # plain log lines instead of a bar
    if progress or lines:
        tqdm.write(f"compiled the step in {time.perf_counter() - t0:.1f}s")
    if start and jax.process_index() == 0:
        print(f"resumed from step {start} ({ckpt.dir})", flush=True)
    elif ckpt.init_from and not start and jax.process_index() == 0:
        print(f"started from the weights of {ckpt.init_from}", flush=True)

    history: list[dict] = []
    writers = open_writers(metrics_file, tensorboard_dir, start, wandb_project, cfg)
    bar = tqdm(total=steps, initial=start, disable=not progress, unit="step", dynamic_ncols=True)
    rows = _Rows(trainer, writers, bar, cfg.train.log_every if lines else 0, steps)
    pending = None  # (step, its metrics, its held-out sums or None), read while the next step runs

    # With several processes JAX's preemption service takes SIGTERM: every process learns of
    # it, and all agree on the step after which to save and stop. One process stops on its
    # own signals (jaxpar.loop.stop).
    preemptible = jax.process_count() > 1
    preempted_at = None
    end = steps
    leader = jax.process_index() == 0
    stop = StopSignals(sigterm=not preemptible, first=start + 1, last=steps,
                       directory=str(ckpt.dir) if checkpoints is not None else None, say=say if leader else None)
    try:
        stop.install()
        step = start - 1
        while step < end:
            step += 1
            if step < end:
                with profiler.step(step):
                    state, metrics = step_fn(state, source(step))
                profiler.after(step, state)
            if pending is not None:  # read step-1 while `step` runs
                history.append(rows.row(*pending))
            pending = None
            if step < end:
                done = step + 1
                asked = stop.passed(done)  # both every step: the preemption sync point is collective
                if (preemptible and multihost_utils.reached_preemption_sync_point(done)) or asked:
                    preempted_at = end = done  # read this step's metrics, save, and stop
                    stop.ending()
                if checkpoints is not None and (done == end or (ckpt.every and done % ckpt.every == 0)):
                    # Every earlier step has been checked; check this one before saving it
                    # (the save waits for the step anyway), so no checkpoint holds a step
                    # past one that stopped the run.
                    if cfg.train.on_nonfinite == "stop" and float(metrics["nonfinite"]):
                        rows.check(done, {k: float(v) for k, v in jax.device_get(metrics).items()})
                    shown = leader and (progress or lines or preempted_at is not None)
                    rows.saved(_save(checkpoints, trainer, state, done, shown and done == end))
                # Queued before the next step, which then waits for it: it reads this step's weights.
                held_out = evaluation.start(trainer.weights(state)) if evaluation is not None and evaluation.due(done, steps) else None
                pending = (step, metrics, held_out)
        if checkpoints is not None and checkpoints.saving == end:
            _finish_save(checkpoints, leader and (progress or lines or preempted_at is not None), spinner=progress)
    except KeyboardInterrupt:  # a second Ctrl-C: out now, without waiting for a save in flight
        line, abandoned = (checkpoints.left_by_interrupt() if checkpoints is not None else
                           ("interrupted; no checkpoint.dir, nothing saved", None))
        checkpoints = None  # not closed: that would wait for the save
        raise Interrupted(line, abandoned) from None
    finally:
        stop.restore()
        profiler.stop()
        bar.close()
        writers.close()
        if checkpoints is not None:
            checkpoints.close()  # waits for saves in flight
    if preempted_at is not None:
        raise Preempted(preempted_at, ckpt.dir if checkpoints is not None else None, stop.asked or "SIGTERM")
    return history


def _save(checkpoints: Checkpoints, trainer: Trainer, state: Any, done: int, announce: bool) -> float:
    """Save the state after `done` steps; the seconds the save held the loop (the step's own
    compute is waited for first, so it is not counted). `announce`: a line before (the
    run's last save)."""
    jax.block_until_ready(state)
    if announce:
        tqdm.write(f"saving step {done} to {checkpoints.directory} ...")
    began = time.perf_counter()
    checkpoints.save(trainer, state, done)
    return time.perf_counter() - began


def _finish_save(checkpoints: Checkpoints, show: bool, spinner: bool) -> None:
    """Wait for the run's last save to be on disk; with `show` a line when it is, its time
    from the start of the save, and on a terminal (`spinner`) the seconds it has taken so far."""
    with tqdm(desc=f"saving step {checkpoints.saving}", bar_format="{desc}: {elapsed}", leave=False,
              disable=not (show and spinner)) as shown:
        while checkpoints.writing():  # polled: a second Ctrl-C lands in the sleep, not inside orbax's wait
            time.sleep(0.1)
            shown.refresh()
    checkpoints.wait()
    if show:
        tqdm.write(f"saved step {checkpoints.saving} ({time.perf_counter() - checkpoints.began:.1f} s)")


def _restored(checkpoints: Checkpoints, trainer: Trainer, steps: int, directory: str):
    """(state, step) from the latest checkpoint; a run that holds `steps` already is done:
    it says so, closes the checkpoints and compiles nothing (step >= steps)."""
    state, start = checkpoints.restore(trainer)
    if start >= steps:
        if jax.process_index() == 0:
            print(f"{directory} already holds step {start} of train.steps={steps}: nothing to do (raise train.steps "
                  "to train on)", flush=True)
        checkpoints.close()
    return state, start


class _Rows:
    """Each step's row, made while the next step runs: its metrics read back, its time,
    tokens/s and MFU, its held-out loss; then written and shown in the progress bar. A
    non-finite step stops the run here or is counted (train.on_nonfinite)."""

    def __init__(self, trainer: Trainer, writers: Writers, bar: tqdm, log_every: int, steps: int):
        cfg = trainer.config
        self.trainer, self.writers, self.bar = trainer, writers, bar
        self.log_every, self.steps = log_every, steps  # a plain line every log_every steps (0: none)
        self.devices = len(trainer.mesh.devices.flatten())
        self.tokens = tokens_per_step(trainer)
        self.flops = cfg.model.flops_per_token(cfg.train.seq_len) * self.tokens
        self.peak = peak_flops(trainer.mesh.devices.flatten()[0], cfg.train.peak_tflops)
        self.skipped = 0  # steps not applied for a non-finite loss or gradient
        self.eval_loss: float | None = None  # the latest, shown until the next
        self.last = time.perf_counter()
        self.save_s: float | None = None  # the save after the next row's step, which is not its time

    def check(self, done: int, values: dict) -> None:
        if values["nonfinite"]:
            self.skipped += 1
            if self.trainer.config.train.on_nonfinite == "stop":
                raise TrainingStopped(_nonfinite_message(self.trainer, done, values))

    def saved(self, seconds: float) -> None:
        """The step whose row comes next saved, holding the loop `seconds`."""
        self.save_s = seconds

    def row(self, step: int, metrics: dict, held_out: Sums | None) -> dict:
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self.check(step + 1, values)
        now = time.perf_counter()
        seconds, self.last = now - self.last - (self.save_s or 0.0), now
        record = {"step": step + 1, "time": time.time(), **values, "tokens_per_s": self.tokens / seconds,
                  "step_time_s": seconds}
        if self.save_s is not None:
            record["save_s"], self.save_s = self.save_s, None
        util = mfu(self.flops, seconds, self.devices, self.peak)
        if util is not None:
            record["mfu"] = util
        if held_out is not None:
            record["eval_loss"] = self.eval_loss = collect(held_out)
            self.last = time.perf_counter()  # the next step waited for the evaluation: not its time
        self.writers.write(record)
        self.bar.set_postfix_str(
            (f"skipped={self.skipped} " if self.skipped else "") + f"loss={values['loss']:.4f} "
            + (f"eval_loss={self.eval_loss:.4f} " if self.eval_loss is not None else "")
            + f"tok/s={record['tokens_per_s']:,.0f} mfu={'n/a' if util is None else f'{util:.1%}'}"
            + _expert_postfix(values),
            refresh=False,
        )
        self.bar.update(1)
        if self.log_every and (record["step"] % self.log_every == 0 or record["step"] == self.steps):
            print(log_line(record, self.steps, self.skipped), flush=True)
        return record


def log_line(record: dict, steps: int, skipped: int = 0) -> str:
    """A step's row as one plain line (the numbers the progress bar shows, and more); the
    step is the row's, the number of steps done."""
    parts = [f"step {record['step']}/{steps}", f"loss {record['loss']:.4f}"]
    if "mtp_loss" in record:  # DeepSeek's multi-token prediction (jaxpar.models.deepseek)
        parts.append(f"mtp_loss {record['mtp_loss']:.4f}")
    if "eval_loss" in record:
        parts.append(f"eval_loss {record['eval_loss']:.4f}")
    if "grad_norm" in record:
        parts.append(f"grad_norm {record['grad_norm']:.3g}")
    if "learning_rate" in record:
        parts.append(f"lr {record['learning_rate']:.3g}")
    parts.append(f"tokens/s {record['tokens_per_s']:,.0f}")
    if "mfu" in record:
        parts.append(f"mfu {record['mfu']:.1%}")
    if "moe_load" in record:
        parts.append(f"drop {record['moe_dropped']:.1%} load {record['moe_load']:.2f}")
    if "reward_margin" in record:  # DPO (jaxpar.step.preference)
        parts.append(f"margin {record['reward_margin']:.3g} accuracy {record['reward_accuracy']:.0%}")
    if skipped:
        parts.append(f"skipped {skipped}")
    if "save_s" in record:
        parts.append(f"save {record['save_s']:.2f}s")
    return " | ".join(parts)


def _nonfinite_message(trainer: Trainer, done: int, values: dict) -> str:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(trainer.abstract_state().params)[0]]
    index, count = int(values["first_nonfinite_grad"]), int(values["nonfinite_grads"])
    grads = f"the first non-finite gradient is {paths[index]} ({count} of {len(paths)} are)" if index >= 0 else "the gradients are finite"
    return (
        f"step {done}: the loss is {values['loss']} and {grads}; the step was not applied. Lower optim.lr, check the "
        "data, or set train.on_nonfinite=skip to go on without such steps"
    )


def _expert_postfix(values: dict) -> str:
    """MoE runs: dropped share and expert load max/mean (1.0 is balanced)."""
    if "moe_load" not in values:
        return ""
    return f" drop={values['moe_dropped']:.1%} load={values['moe_load']:.2f}"
