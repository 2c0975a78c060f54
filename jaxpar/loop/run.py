"""The training loop: compile once, run steps, evaluate on held-out batches, show progress,
write per-step metrics (jaxpar.loop.metrics).

Metrics of step i are read back while step i+1 runs, so the host never stalls the devices;
a held-out evaluation after step i is queued before step i+1 and read with step i's row.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any, Callable

import jax
from jax.experimental import multihost_utils
from tqdm import tqdm

from jaxpar.data.sources import make_source
from jaxpar.data.user import UserBatches, UserData
from jaxpar.errors import Preempted, TrainingStopped
from jaxpar.flops import mfu, peak_flops
from jaxpar.loop.checkpoint import Checkpoints
from jaxpar.loop.evaluation import Evaluation, Sums, collect, open_evaluation
from jaxpar.loop.fits import check_fits
from jaxpar.loop.metrics import Writer, Writers
from jaxpar.loop.profile import Profiler
from jaxpar.loop.start import start_of, starting_state
from jaxpar.loop.stop import Interrupted, StopSignals, say
from jaxpar.step.trainer import Trainer
from jaxpar.step.update import COUNTS


def tokens_per_step(trainer: Trainer) -> int:
    train = trainer.config.train
    return train.global_batch * (train.seq_len if trainer.config.model.task == "lm" else 1)


def run(trainer: Trainer, steps: int | None = None, progress: bool | None = None, data: UserData | None = None,
        eval_data: UserData | None = None, writers: Sequence[Writer] = ()) -> list[dict]:
    """Train up to step `steps` (default train.steps) and return per-step metrics. With
    `checkpoint.dir` set, resume from its latest checkpoint (if any), save every
    `checkpoint.every` steps and at the end; with none to resume from and
    `checkpoint.init_from` set, start from that Hugging Face checkpoint's weights
    (jaxpar.loop.start). `data`: the user's own host-local batches, a function step -> batch
    or an iterable (jaxpar.data.user); default the config's source. With train.eval_every > 0,
    the held-out loss (jaxpar.loop.evaluation) joins the rows of every eval_every-th step and
    of the last, as `eval_loss`; `eval_data`: the held-out batches in the format of `data`
    (needed with `data`; default the config's held-out part, jaxpar.data.heldout). Each row
    goes to every one of `writers` (jaxpar.loop.metrics: JsonLines, TensorBoard, WandB, or
    your own). `progress`: a bar (default: when stderr is a terminal); without one, a plain
    line every train.log_every steps. Ctrl-C or SIGTERM stops at the next step, saved, and
    says so at once; a second Ctrl-C raises jaxpar.loop.stop.Interrupted without waiting for
    the save (jaxpar.loop.stop); a directory that holds the last step already is left alone.
    A row's `step` is the number of steps done (1 for the first), as the plain lines and
    checkpoints count; the row of a step that saved has `save_s`, the time the save held the
    loop, apart from `step_time_s`.

    Everything a user gave is checked before the compile (`_Run.open`); then the step
    compiles and is checked to fit the devices' memory (jaxpar.loop.fits), the starting
    state is made (jaxpar.loop.start), and the steps run with the services called after
    each (`_Run.after`)."""
    cfg = trainer.config
    progress = sys.stderr.isatty() if progress is None else progress
    steps = cfg.train.steps if steps is None else steps
    services = _Run.open(trainer, steps, data, eval_data, Writers(writers), progress)
    if services.start >= steps:
        return []
    t0 = time.perf_counter()
    step_fn = trainer.step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    check_fits(step_fn, trainer.mesh.local_devices[0])
    services.compile()
    dpo = cfg.data.source == "preference" and data is None
    state = starting_state(trainer, services.fresh, services.restored, services.source if dpo else None)
    services.restored = None  # on resume a whole second state: not kept while training
    services.announce(time.perf_counter() - t0)
    return services.steps(step_fn, state)


@dataclasses.dataclass
class _Run:
    """A run's services around the step: its batches, checkpoints, held-out evaluation, metric
    writers and rows, profiler and stop signals; opened (and so checked) before the compile."""

    trainer: Trainer
    last: int  # the step the run is to end after (train.steps, or the steps run() was given)
    source: Any  # step -> batch
    checkpoints: Checkpoints | None
    evaluation: Evaluation | None
    writers: Writers
    profiler: Profiler
    progress: bool
    start: int  # the steps done before this run: 0, or the checkpoint's
    restored: Any  # the checkpoint's state, or None
    fresh: Callable[[], Any] | None  # the state at step 0 (jaxpar.loop.start.start_of); None: nothing to run
    end: int = 0  # the step it ends after: `last`, or the one a stop signal or preemption chose
    stopped: bool = False  # by a stop signal or preemption
    rows: _Rows | None = None
    stop: StopSignals | None = None

    @classmethod
    def open(cls, trainer: Trainer, steps: int, data: UserData | None, eval_data: UserData | None,
             writers: Writers, progress: bool) -> _Run:
        cfg, ckpt = trainer.config, trainer.config.checkpoint
        checkpoints = Checkpoints.open(ckpt.dir, ckpt.keep, ckpt.async_save, remove_partial=True) if ckpt.dir else None
        source = make_source(trainer.batch, cfg) if data is None else UserBatches(trainer.batch, data)
        if data is not None:  # the first batch is checked before the compile
            source.peek((checkpoints.latest_step() if checkpoints is not None else None) or 0)
        if jax.process_index() == 0:  # what the run trains on, in one line, before the compile
            print(source.describe(steps), flush=True)
        evaluation = open_evaluation(trainer, data, eval_data, source if data is None else None)
        writers.prepare()
        profiler = Profiler(cfg.train.profile_steps, cfg.train.profile_dir)
        profiler.prepare()
        resuming = checkpoints is not None and checkpoints.latest_step() is not None
        restored, start = _restored(checkpoints, trainer, steps, ckpt.dir) if resuming else (None, 0)
        # also on resume: LoRA's frozen base and DPO's reference are read from the start
        fresh = start_of(trainer) if start < steps else None
        return cls(trainer, steps, source, checkpoints, evaluation, writers, profiler, progress, start, restored, fresh,
                   end=steps)

    @property
    def leader(self) -> bool:
        return jax.process_index() == 0

    @property
    def lines(self) -> bool:
        """Plain log lines instead of a bar."""
        return not self.progress and self.trainer.config.train.log_every > 0 and self.leader

    def compile(self) -> None:
        if self.evaluation is not None:
            self.evaluation = self.evaluation.compile(self.trainer)

    def announce(self, compile_s: float) -> None:
        ckpt = self.trainer.config.checkpoint
        if self.progress or self.lines:
            tqdm.write(f"compiled the step in {compile_s:.1f}s")
        if self.start and self.leader:
            print(f"resumed from step {self.start} ({ckpt.dir})", flush=True)
        elif ckpt.init_from and not self.start and self.leader:
            print(f"started from the weights of {ckpt.init_from}", flush=True)

    def steps(self, step_fn: Callable, state: Any) -> list[dict]:
        """Run the steps after `start` up to `last`: step i+1 is dispatched before step i's
        row is read, and after each step the services have their turn (`after`)."""
        cfg = self.trainer.config
        history: list[dict] = []
        self.writers.open(self.start, cfg)
        bar = tqdm(total=self.last, initial=self.start, disable=not self.progress, unit="step", dynamic_ncols=True)
        self.rows = _Rows(self.trainer, self.writers, bar, cfg.train.log_every if self.lines else 0, self.last)
        # With several processes JAX's preemption service takes SIGTERM: every process learns
        # of it, and all agree on the step after which to save and stop. One process stops on
        # its own signals (jaxpar.loop.stop).
        preemptible = jax.process_count() > 1
        directory = str(cfg.checkpoint.dir) if self.checkpoints is not None else None
        self.stop = StopSignals(sigterm=not preemptible, first=self.start + 1, last=self.last, directory=directory,
                                say=say if self.leader else None)
        pending = None  # (step, metrics, held-out sums), read while the next step runs
        try:
            self.stop.install()
            for step in range(self.start, self.last):
                with self.profiler.step(step):
                    state, metrics = step_fn(state, self.source(step))
                self.profiler.after(step, state)
                if pending is not None:  # read step-1 while `step` runs
                    history.append(self.rows.row(*pending))
                pending = (step, metrics, self.after(step + 1, state, metrics, preemptible))
                if self.stopped:
                    break
            if pending is not None:
                history.append(self.rows.row(*pending))
            self.finish_save()
        except KeyboardInterrupt:  # a second Ctrl-C: out now, without waiting for a save in flight
            line, abandoned = (self.checkpoints.left_by_interrupt() if self.checkpoints is not None else
                               ("interrupted; no checkpoint.dir, nothing saved", None))
            self.checkpoints = None  # not closed: that would wait for the save
            raise Interrupted(line, abandoned) from None
        finally:
            self.close(bar)
        if self.stopped:
            raise Preempted(self.end, cfg.checkpoint.dir if self.checkpoints is not None else None,
                            self.stop.asked or "SIGTERM")
        return history

    def after(self, done: int, state: Any, metrics: dict, preemptible: bool) -> Sums | None:
        """The services' turn after step `done` was dispatched: stop signals and preemption
        (which end the run here: `stopped`), the checkpoint, the held-out evaluation (its sums,
        or None when not due)."""
        asked = self.stop.passed(done)  # both every step: the preemption sync point is collective
        if (preemptible and multihost_utils.reached_preemption_sync_point(done)) or asked:
            self.end, self.stopped = done, True  # read this step's metrics, save, and stop
            self.stop.ending()
        self.save_if_due(done, state, metrics)
        # Queued before the next step, which then waits for it: it reads this step's weights.
        if self.evaluation is not None and self.evaluation.due(done, self.last):
            return self.evaluation.start(self.trainer.weights(state))
        return None

    def save_if_due(self, done: int, state: Any, metrics: dict) -> None:
        every = self.trainer.config.checkpoint.every
        if self.checkpoints is None or not (done == self.end or (every and done % every == 0)):
            return
        # Every earlier step has been checked; check this one before saving it (the save
        # waits for the step anyway), so no checkpoint holds a step past one that stopped the run.
        if self.trainer.config.train.on_nonfinite == "stop" and float(metrics["nonfinite"]):
            self.rows.check(done, {k: float(v) for k, v in jax.device_get(metrics).items()})
        shown = self.leader and (self.progress or self.lines or self.stopped)
        self.rows.saved(_save(self.checkpoints, self.trainer, state, done, shown and done == self.end))

    def finish_save(self) -> None:
        if self.checkpoints is not None and self.checkpoints.saving == self.end:
            _finish_save(self.checkpoints, self.leader and (self.progress or self.lines or self.stopped),
                         spinner=self.progress)

    def close(self, bar: tqdm) -> None:
        self.stop.restore()
        self.profiler.stop()
        bar.close()
        self.writers.close()
        if self.checkpoints is not None:
            self.checkpoints.close()  # waits for saves in flight


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
        values = {k: int(v) if k in COUNTS else float(v) for k, v in jax.device_get(metrics).items()}
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
    sources = [k.removeprefix("loss_") for k in record if k.startswith("loss_") and f"tokens_{k[5:]}" in record]
    if sources:  # a mixture's (jaxpar.data.mixture): each source's loss
        parts.append(" ".join(f"{name} {record['loss_' + name]:.4f}" for name in sources))
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
