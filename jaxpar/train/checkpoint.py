"""Checkpoints with orbax: the whole training state, saved in the background, atomically,
restorable onto any layout.

A checkpoint holds the TrainState (parameters, fp32 master weights, optimizer state, step)
in the model's layer order, and a JSON record of the step, the data position (batches are
a function of the seed and the step: jaxpar.data.sources) and the config. Nothing in it is
pickled: arrays are tensorstore files, the rest JSON.

  * Atomic: orbax writes into a temporary directory and renames it when complete, so a run
    killed mid-save leaves the previous checkpoint whole; leftovers are removed on open.
  * Asynchronous: `save` returns once the arrays are copied off the devices; the writing
    goes on in a background thread while training continues.
  * Resharding: `restore` reads each array straight into the shardings of the trainer it is
    given, so a checkpoint written under one mesh loads under another (another device
    count too).
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxpar.config import flatten
from jaxpar.errors import ConfigError, JaxparWarning


@dataclasses.dataclass
class Checkpoints:
    """The checkpoints of one run directory (`checkpoint.dir`)."""

    manager: ocp.CheckpointManager
    directory: pathlib.Path

    @staticmethod
    def open(directory: str | pathlib.Path, keep: int = 3, async_save: bool = True) -> "Checkpoints":
        directory = pathlib.Path(directory).absolute()
        if directory.exists() and not directory.is_dir():  # orbax would retry, then hang
            raise ConfigError(f"checkpoint.dir={str(directory)!r} is a file, not a folder; give a folder (it is created "
                              "if missing), or checkpoint.dir='' for no checkpoints")
        if jax.process_index() == 0 and directory.exists():  # saves cut short: never checkpoints, removed now
            for leftover in directory.glob("*.orbax-checkpoint-tmp*"):
                shutil.rmtree(leftover, ignore_errors=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        return Checkpoints(ocp.CheckpointManager(directory, options=options), directory)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, trainer, state, step: int) -> None:
        """Checkpoint `state` as the state after `step` steps (in the background if async)."""
        meta = {
            "step": int(step),
            "data_position": int(step),
            "seed": trainer.config.train.seed,
            "compute_dtype": trainer.config.train.compute_dtype,
            "config": {k: _jsonable(v) for k, v in flatten(trainer.config).items()},
        }
        if trainer.pipeline is not None:  # on the devices, in the state's own shardings
            state = jax.jit(trainer.model_order, out_shardings=trainer.state_shardings)(state)
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=args, force=True)

    def restore(self, trainer, step: int | None = None) -> tuple[Any, int]:
        """(state laid out for `trainer`, its step): the latest checkpoint unless `step`. A
        latest step that cannot be read (a stray folder, a truncated save) is passed over,
        with a warning naming it, for the newest earlier one that can; in several processes
        it is refused instead (they must agree on the step)."""
        if step is not None:
            return self._restore(trainer, step)
        steps = self.all_steps()
        if not steps:
            return self._restore(trainer, None)  # the message that there is none
        broken = []
        for candidate in reversed(steps):
            try:
                restored = self._restore(trainer, candidate)
            except ConfigError:
                raise  # a readable checkpoint of another model or precision
            except Exception as e:  # orbax and tensorstore raise many kinds
                broken.append(f"{candidate} ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
                if jax.process_count() > 1 or candidate == steps[0]:
                    raise ConfigError(
                        f"checkpoint.dir={str(self.directory)!r}: step {broken[0]} cannot be read"
                        + (f"; nor can {', '.join(broken[1:])}" if len(broken) > 1 else "")
                        + f"; intact steps: none of {steps} that were tried. Remove the broken step folders, or "
                        "use another checkpoint.dir"
                    ) from e
                continue
            if broken:
                self._set_aside([int(b.split()[0]) for b in broken])
                warnings.warn(f"checkpoint.dir={str(self.directory)!r}: step {', '.join(broken)} cannot be read "
                              f"(kept as <step>.unreadable); resuming from step {candidate}, the newest intact one",
                              UnreadableCheckpoint, stacklevel=2)
            return restored
        raise AssertionError("unreachable")

    def _set_aside(self, steps: list[int]) -> None:
        """Rename unreadable step folders out of the manager's sight (never deleted: they
        are the user's), so the run can save those steps again."""
        for step in steps:
            source, target = self.directory / str(step), self.directory / f"{step}.unreadable"
            n = 1
            while target.exists():
                n, target = n + 1, self.directory / f"{step}.unreadable{n}"
            source.rename(target)
        self.manager.reload()

    def _restore(self, trainer, step: int | None) -> tuple[Any, int]:
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            raise ConfigError(
                f"checkpoint.dir={str(self.directory)!r} has no checkpoint{'' if step is None else f' for step {step}'}; "
                f"it holds steps {self.all_steps() or 'none'}"
            )
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        saved = meta["config"]
        for key, value in flatten(trainer.config).items():  # the model must be the one saved
            if key.startswith("model.") and key != "model.remat" and saved.get(key) != _jsonable(value):
                raise ConfigError(
                    f"checkpoint step {step} in {str(self.directory)!r} was written with {key}={saved.get(key)!r}, but "
                    f"this run has {key}={value!r}; set {key}={saved.get(key)!r}, or use another checkpoint.dir"
                )
        ours = trainer.config.train.compute_dtype
        if meta["compute_dtype"] != ours and "float32" in (meta["compute_dtype"], ours):
            raise ConfigError(
                f"checkpoint step {step} was written with train.compute_dtype={meta['compute_dtype']} (float32 keeps no "
                f"separate master weights), but this run has {ours}; set train.compute_dtype={meta['compute_dtype']}, or use "
                "another checkpoint.dir"
            )
        target = trainer.abstract_state()  # pipeline and model order have the same shapes and shardings
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
        if trainer.pipeline is not None:  # back to the stages' order (a copy only where there is one)
            restored = jax.jit(trainer.pipeline_order, out_shardings=trainer.state_shardings)(restored)
        return restored, int(meta["step"])

    def wait(self) -> None:
        """Block until every save in flight is on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


class UnreadableCheckpoint(JaxparWarning):
    """The newest checkpoint step could not be read; an earlier one was used."""
