"""A `jax.profiler` trace of chosen steps (train.profile_steps="START:STOP": the steps after
START steps are done, through step STOP, as the log lines and metrics rows number them:
START+1..STOP), written to train.profile_dir in the layout TensorBoard's profile
plugin and Perfetto read: DIR/plugins/profile/<run>/<host>.xplane.pb (and .trace.json.gz).

Each traced step is marked with a StepTraceAnnotation, so the viewer's overview splits the
trace per step. Steps are dispatched ahead of the devices; the trace stops only once the
last traced step has finished, so its device work is in the file. Each process writes its
own host's file.
"""

from __future__ import annotations

import contextlib

import jax

from jaxpar.config import parse_steps
from jaxpar.loop.metrics import prepare_folder


class Profiler:
    """Starts the trace before the step after START, stops it after step STOP (or at the run's
    end); `step` below is the loop's index, the steps done before it."""

    def __init__(self, spec: str, folder: str):
        self.window = parse_steps(spec)
        self.folder = folder
        self.active = False

    def prepare(self) -> None:
        """Before anything compiles: the folder can be made (one line if not)."""
        if self.window is not None:
            prepare_folder(self.folder, f"train.profile_dir={self.folder!r}", "the trace", "runs/profile")

    @contextlib.contextmanager
    def step(self, step: int):
        """Around one step's dispatch."""
        if self.window is None or not self.window[0] <= step < self.window[1]:
            yield
            return
        if not self.active:
            jax.profiler.start_trace(self.folder)
            self.active = True
        with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):  # numbered as the rows are
            yield

    def after(self, step: int, state) -> None:
        """After step `step` was dispatched: at the window's last step, wait for it and stop."""
        if self.active and step == self.window[1] - 1:
            self.stop(state)

    def stop(self, state=None) -> None:
        if not self.active:
            return
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self.active = False
        if jax.process_index() == 0:
            print(f"wrote the trace of steps {self.window[0] + 1}-{self.window[1]} to {self.folder} "
                  f"(tensorboard --logdir {self.folder}, or ui.perfetto.dev)", flush=True)
