"""Where each step's metrics row goes: a JSON Lines file, TensorBoard scalars, Weights &
Biases, or any of them together.

A row is a dict: "step" (the steps done: 1 for the first, as the plain log lines and the
checkpoints count), "time" (unix seconds), and numbers (loss, grad_norm, learning_rate,
tokens_per_s, step_time_s, mfu, eval_loss, save_s, ...). Every writer has
`write(row)` and `close()`; `open_writers` gives one that writes to all that were asked for.

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
from typing import Any, Protocol

from jaxpar.errors import ConfigError

INSTALL = "pip install 'jaxpar[tensorboard]'"
WANDB_INSTALL = "pip install 'jaxpar[wandb]'"


class Writer(Protocol):
    def write(self, row: dict) -> None: ...

    def close(self) -> None: ...


def prepare_outputs(metrics_file: str | None, tensorboard_dir: str | None, wandb_project: str | None = None) -> None:
    """Before anything compiles: refuse paths that cannot be written (one ConfigError line),
    a TensorBoard directory without tensorboardX and a W&B project without wandb; create
    missing parent folders."""
    if wandb_project is not None:
        wandb_module(wandb_project)
    if metrics_file:
        prepare_file(metrics_file, f"metrics_file={metrics_file!r} (--metrics-file)", "metrics.jsonl")
    if tensorboard_dir:
        summary_writer(tensorboard_dir)
        prepare_folder(tensorboard_dir, f"tensorboard_dir={tensorboard_dir!r} (--tensorboard)", "the event files",
                       "runs/tb")


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
    def __init__(self, path: str, start: int = 0):
        if start:  # a resumed run replaces what the lost one logged past the checkpoint
            truncate_rows(path, start)
        self.file = open(path, "a" if start else "w")

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoard:
    def __init__(self, logdir: str, start: int = 0):
        # Named by the step it starts at too: event files are named by the second they open in.
        self.writer = summary_writer(logdir)(logdir, purge_step=start + 1 if start else None,
                                             filename_suffix=f".step{start}")

    def write(self, row: dict) -> None:
        for name, value in numbers(row).items():
            self.writer.add_scalar(name, value, global_step=row["step"], walltime=row["time"])

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, project: str, config: Any, start: int = 0):
        from jaxpar.config import flatten

        self.wandb = wandb_module(project)
        self.run = self.wandb.init(project=project, config=flatten(config) if config is not None else None,
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
    """Every writer asked for, as one."""

    def __init__(self, writers: list[Writer]):
        self.writers = writers

    def write(self, row: dict) -> None:
        for writer in self.writers:
            writer.write(row)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def open_writers(metrics_file: str | None, tensorboard_dir: str | None, start: int = 0,
                 wandb_project: str | None = None, config: Any = None) -> Writers:
    """The writers for a run that starts after step `start` (0, or the checkpoint it resumed from);
    `config`: the run's jaxpar.config.Config, which W&B records."""
    writers: list[Writer] = []
    if wandb_project:
        writers.append(WandB(wandb_project, config, start))
    if metrics_file:
        writers.append(JsonLines(metrics_file, start))
    if tensorboard_dir:
        writers.append(TensorBoard(tensorboard_dir, start))
    return Writers(writers)


def truncate_rows(path: str, start: int) -> None:
    """Keep the rows of the steps up to `start` (the checkpoint a run resumes from)."""
    file = pathlib.Path(path)
    if file.exists():
        rows = [line for line in file.read_text().splitlines() if line and json.loads(line)["step"] <= start]
        file.write_text("".join(row + "\n" for row in rows))
