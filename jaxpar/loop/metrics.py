"""Where each step's metrics row goes: a JSON Lines file, TensorBoard scalars, Weights &
Biases, or any of them together.

A row is a dict: "step" (the steps done: 1 for the first, as the plain log lines and the
checkpoints count), "time" (unix seconds), and numbers (loss, grad_norm, learning_rate,
tokens_per_s, step_time_s, mfu, eval_loss, save_s, ...). A run takes a list of writers
(`run(trainer, writers=[JsonLines("m.jsonl"), TensorBoard("runs/tb")])`; `writers_for` makes
the list the command line's options ask for); each one has

  prepare()           before anything compiles: refuses a path that cannot be written, or a
                      missing package, with one line, and creates missing folders;
  open(start, config) once the run knows the step it starts after (0, or the checkpoint it
                      resumed from) and its jaxpar.config.Config;
  write(row), close() each row, and at the run's end.

A writer of your own is any object with these four methods.

  JsonLines   one JSON object per row. A resumed run (from the checkpoint of step `start`)
              first drops the rows the lost run wrote past that step, then appends.
  TensorBoard every number of a row but "step" and "time" as a scalar of the same name at
              global step row["step"], wall time row["time"], through tensorboardX (an
              optional extra: pip install 'jaxpar[tensorboard]'). A resumed run asks
              TensorBoard to discard the lost run's events past step `start` (purge_step).
  WandB       the same numbers as a W&B run's metrics at step row["step"], the config as the
              run's config (wandb, an optional extra: pip install 'jaxpar[wandb]'). W&B's own
              settings apply: WANDB_MODE=offline keeps the run under WANDB_DIR (or ./wandb)
              for `wandb sync`. A resumed run is a new W&B run starting at its step.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any, Protocol

from jaxpar.errors import ConfigError

INSTALL = "pip install 'jaxpar[tensorboard]'"
WANDB_INSTALL = "pip install 'jaxpar[wandb]'"


class Writer(Protocol):
    def prepare(self) -> None: ...

    def open(self, start: int, config: Any) -> None: ...

    def write(self, row: dict) -> None: ...

    def close(self) -> None: ...


def writers_for(metrics_file: str | None = None, tensorboard_dir: str | None = None,
                wandb_project: str | None = None) -> list[Writer]:
    """The writers `jaxpar train`'s --metrics-file, --tensorboard and --wandb ask for."""
    writers: list[Writer] = []
    if wandb_project is not None:
        writers.append(WandB(wandb_project))
    if metrics_file:
        writers.append(JsonLines(metrics_file))
    if tensorboard_dir:
        writers.append(TensorBoard(tensorboard_dir))
    return writers


def prepare_folder(folder: str, what: str, contents: str, example: str) -> None:
    """Before anything compiles: refuse a folder path that is a file, and create the folder.
    `what` names the option; `contents` what goes in it; `example` a folder."""
    path = pathlib.Path(folder)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} is a file; give a directory for {contents}, e.g. {example}")
    _make_folder(path, what)


def prepare_file(file: str, what: str, example: str) -> None:
    """Before anything compiles: refuse a file path that is a directory or lies under a
    file, and create its missing folders. `what` names the option; `example` a file name."""
    path = pathlib.Path(file)
    if path.is_dir():
        raise ConfigError(f"{what} is a directory; give a file path, e.g. {str(path / example)!r}")
    _make_folder(path.parent, what)


def _make_folder(path: pathlib.Path, what: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where a folder should be, no permission
        raise ConfigError(f"{what}: cannot create the folder {str(path)!r} ({e.strerror}); give a path under a "
                          "writable folder") from None


def summary_writer(tensorboard_dir: str) -> Any:
    """tensorboardX's SummaryWriter class, imported only when asked for."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ConfigError(f"tensorboard_dir={tensorboard_dir!r} (--tensorboard) writes event files with tensorboardX, "
                          f"which is not installed; {INSTALL}") from None
    return SummaryWriter


def wandb_module(project: str) -> Any:
    """The wandb package, imported only when asked for."""
    if not project:
        raise ConfigError("--wandb needs a project name, e.g. --wandb my-project")
    try:
        import wandb
    except ImportError:
        raise ConfigError(f"wandb_project={project!r} (--wandb) logs with wandb, which is not installed; "
                          f"{WANDB_INSTALL}") from None
    return wandb


class JsonLines:
    """One JSON object per row, in `path`."""

    def __init__(self, path: str):
        self.path, self.file = path, None

    def prepare(self) -> None:
        prepare_file(self.path, f"metrics_file={self.path!r} (--metrics-file)", "metrics.jsonl")

    def open(self, start: int, config: Any = None) -> None:
        if start:  # a resumed run replaces what the lost one logged past the checkpoint
            truncate_rows(self.path, start)
        self.file = open(self.path, "a" if start else "w")

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoard:
    """Every number of a row as a scalar, in the event files of `logdir`."""

    def __init__(self, logdir: str):
        self.logdir, self.writer = logdir, None

    def prepare(self) -> None:
        summary_writer(self.logdir)
        prepare_folder(self.logdir, f"tensorboard_dir={self.logdir!r} (--tensorboard)", "the event files", "runs/tb")

    def open(self, start: int, config: Any = None) -> None:
        # Named by the step it starts at too: event files are named by the second they open in.
        self.writer = summary_writer(self.logdir)(self.logdir, purge_step=start + 1 if start else None,
                                                  filename_suffix=f".step{start}")

    def write(self, row: dict) -> None:
        for name, value in numbers(row).items():
            self.writer.add_scalar(name, value, global_step=row["step"], walltime=row["time"])

    def close(self) -> None:
        self.writer.close()


class WandB:
    """The rows' numbers as a W&B run's metrics, the config as its config, in `project`."""

    def __init__(self, project: str):
        self.project, self.wandb, self.run = project, None, None

    def prepare(self) -> None:
        wandb_module(self.project)

    def open(self, start: int, config: Any = None) -> None:
        from jaxpar.config import flatten

        self.wandb = wandb_module(self.project)
        self.run = self.wandb.init(project=self.project, config=flatten(config) if config is not None else None,
                                   tags=[f"from step {start}"] if start else None)

    def write(self, row: dict) -> None:
        self.run.log(numbers(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # its service process ends with the run, not at exit


def numbers(row: dict) -> dict:
    """The row's metrics: its numbers but the step and the time, which the writers place them at."""
    return {k: v for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))}


class Writers:
    """A run's writers as one: each row to every one of them."""

    def __init__(self, writers: Sequence[Writer]):
        self.writers, self.opened = list(writers), []

    def prepare(self) -> None:
        for writer in self.writers:
            writer.prepare()

    def open(self, start: int, config: Any) -> None:
        for writer in self.writers:
            writer.open(start, config)
            self.opened.append(writer)

    def write(self, row: dict) -> None:
        for writer in self.opened:
            writer.write(row)

    def close(self) -> None:
        for writer in self.opened:
            writer.close()
        self.opened = []


def truncate_rows(path: str, start: int) -> None:
    """Keep the rows of the steps up to `start` (the checkpoint a run resumes from)."""
    file = pathlib.Path(path)
    if file.exists():
        rows = [line for line in file.read_text().splitlines() if line and json.loads(line)["step"] <= start]
        file.write_text("".join(row + "\n" for row in rows))
