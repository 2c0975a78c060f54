"""Checkpoints with orbax: the whole training state, saved in the background, atomically,
restorable onto any layout.

A checkpoint holds the TrainState (parameters, fp32 master weights, optimizer state, step)
in the model's layer order, gradient compression's state (residuals, PowerSGD factors) as an
item of its own, and a JSON record of the step, the data position (batches are
a function of the seed and the step: jaxpar.data.sources) and the config. Nothing in it is
pickled: arrays are tensorstore files, the rest JSON. A LoRA run's checkpoints hold its
adapters, not the frozen base (jaxpar.step.lora): the record names the base (`base`), and a
resumed run reads it again from there (jaxpar.loop.start.with_base).

  * Atomic: orbax writes into a temporary directory and renames it when complete, so a run
    killed mid-save leaves the previous checkpoint whole. The run that writes next removes
    such leftovers, each named in a warning (`PartialSaveRemoved`).
  * Asynchronous: `save` returns once the arrays are copied off the devices; the writing
    goes on in a background thread while training continues.
  * No compile per shard: in one process each shard is written whole. orbax's default
    splits a shard held by several devices ("replica-parallel") with a `jit(slice)` per
    shard shape and device, hundreds of compiles in a run's first save, and in one process
    the split gains nothing (the same process writes every part).
  * Resharding: `restore` reads each array straight into the shardings of the trainer it is
    given, so a checkpoint written under one mesh loads under another (another device
    count too).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import shutil
import time
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxpar.checks.checkpoint import folder_problem
from jaxpar.config import Config
from jaxpar.config_record import class_record, class_shown, first_change, rebuild, record
from jaxpar.errors import ConfigError, JaxparWarning
from jaxpar.pipeline.split import StageSplit
from jaxpar.pipeline.stages import layers_mover


@dataclasses.dataclass
class Checkpoints:
    """The checkpoints of one run directory (`checkpoint.dir`)."""

    manager: ocp.CheckpointManager
    directory: pathlib.Path
    saving: int | None = None  # the step of the latest save begun
    began: float = 0.0  # when it began (time.perf_counter)

    @staticmethod
    def open(directory: str | pathlib.Path, keep: int = 3, async_save: bool = True,
             remove_partial: bool = False) -> "Checkpoints":
        """The checkpoints in `directory` (created if missing). `remove_partial`: for the run
        that writes here: refuse a folder this user cannot write, and remove saves cut short
        (never checkpoints), each named in a warning; a reader (sample, export) leaves them,
        they may be another run's save in flight."""
        directory = pathlib.Path(directory).absolute()
        # before orbax: a file there it would retry on, then hang; a path it cannot make, a traceback
        problem = folder_problem(directory, writing=remove_partial)
        if problem:
            raise ConfigError(problem)
        if remove_partial and jax.process_index() == 0 and directory.exists():
            _remove_partial(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        return Checkpoints(ocp.CheckpointManager(directory, options=options, handler_registry=_handlers()), directory)

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
            **record(trainer.config),
        }
        if state.frozen is not None:  # LoRA: adapters only; the base is where the run started (`base`)
            meta["base"] = base_of(trainer.config)
            state = dataclasses.replace(state, frozen=None)
        to_model_order = reorder_layers(trainer, "model")
        if to_model_order is not None:
            state = to_model_order(state)
        items = {}
        if state.compression is not None:  # its own item: a run that compresses differently starts it afresh
            items["compression"] = ocp.args.PyTreeSave(state.compression)
            meta["compression"] = compression_signature(trainer)
            state = dataclasses.replace(state, compression=None)
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta), **items)
        self.saving, self.began = int(step), time.perf_counter()
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
        meta = self.meta(step)
        saved = meta["config"]
        _check_written_alike(trainer, meta, step, self.directory)
        target = trainer.model_order_state()
        items = {"state": _restore_args(dataclasses.replace(target, compression=None, frozen=None))}
        resume_compression = target.compression is not None and meta.get("compression") == compression_signature(trainer)
        if resume_compression:
            items["compression"] = _restore_args(target.compression)
        try:
            got = self.manager.restore(step, args=ocp.args.Composite(**items))
        except ValueError as e:
            if "tree structures do not match" not in str(e):
                raise
            # readable, but its state holds other pieces: another optimizer (optim.name, a
            # custom tx) wrote it
            raise ConfigError(
                f"checkpoint step {step} in {str(self.directory)!r} holds a state of another shape than this run's "
                f"(its optimizer state most likely: it was written with optim.name={saved.get('optim.name')!r} and "
                f"optim.clip_norm={saved.get('optim.clip_norm')!r}, or by a custom tx); resume with the optimizer that "
                "wrote it, or use another checkpoint.dir"
            ) from e
        restored = got["state"]
        if target.compression is not None:
            if not resume_compression:
                warnings.warn(f"checkpoint step {step} in {str(self.directory)!r} holds no gradient compression state for "
                              f"this run's parallel.compression.method={trainer.layout.compression.method} and "
                              "layout (saved: " + str(meta.get("compression", "none")) + "); its residuals and factors start "
                              "afresh", CompressionRestarted, stacklevel=3)
            restored = dataclasses.replace(
                restored, compression=got["compression"] if resume_compression else trainer.init_compression())
        to_pipeline_order = reorder_layers(trainer, "pipeline")
        if to_pipeline_order is not None:
            restored = to_pipeline_order(restored)
        return restored, int(meta["step"])

    def meta(self, step: int) -> dict:
        """The JSON record saved beside step `step`'s arrays (step, data position, config)."""
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def wait(self) -> None:
        """Block until every save in flight is on disk."""
        self.manager.wait_until_finished()

    def writing(self) -> bool:
        """Whether a save is still being written (in the background)."""
        return self.manager.is_saving_in_progress()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def left_by_interrupt(self) -> tuple[str, int | None]:
        """(one line on what a run stopped now, without waiting for its save, leaves: the
        newest complete checkpoint and the unfinished folder of the save it abandons; that
        step, else None)."""
        complete, partial = _complete_steps(self.directory), _partial_saves(self.directory)  # as they are now
        abandoned = self.saving if self.saving is not None and self.saving not in complete else None
        where = str(self.directory)
        kept = (f"{where} keeps step {complete[-1]}, its last complete checkpoint" if complete else
                f"{where} holds no complete checkpoint: the run starts again from step 0")
        if abandoned is None:
            return f"interrupted; nothing saved since the last checkpoint: {kept}", None
        unfinished = f"; the unfinished {', '.join(p.name for p in partial)} stays until the next run removes it, naming it"
        return f"interrupted during the save of step {abandoned}; {kept}{unfinished if partial else ''}", abandoned


def base_of(config: Config) -> str:
    """Where a LoRA run's frozen weights come from, which its checkpoints point to rather
    than hold: the Hugging Face folder it started from, or its seed's initialisation."""
    return config.checkpoint.init_from or f"the model's initialisation at train.seed={config.train.seed}"


def _handlers() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """The state's and gradient compression's items written by a PyTree handler whose
    jax.Array handler, in one process, writes each shard whole (`use_replica_parallel`
    off): split among the devices that hold it, every part is cut with a `jit(slice)`
    compiled per shard shape and device (528 compiles, 19 s, in the deepseek recipe's first
    save), and the one process writes every part anyway. Several processes keep orbax's
    default, which shares a replicated shard's writing among them. The files are those
    orbax's standard handler writes, so checkpoints of either read with the other."""
    # the store orbax's default handler keeps (it has no public name)
    from orbax.checkpoint._src.metadata.array_metadata_store import Store

    arrays = ocp.type_handlers.ArrayHandler(array_metadata_store=Store(),
                                            use_replica_parallel=False if jax.process_count() == 1 else None)
    types_ = [(t, ocp.type_handlers.get_type_handler(t)) for t in ocp.type_handlers.supported_types() if t is not jax.Array]
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item in ("state", "compression"):
        handler = ocp.PyTreeCheckpointHandler(
            type_handler_registry=ocp.type_handlers.create_type_handler_registry(*types_, (jax.Array, arrays)))
        registry.add(item, ocp.args.PyTreeSave, handler)
        registry.add(item, ocp.args.PyTreeRestore, handler)
    return registry


def _restore_args(target) -> ocp.args.PyTreeRestore:
    """Read into `target`'s shapes, dtypes and shardings (jax.ShapeDtypeStruct leaves)."""
    return ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))


def _complete_steps(directory: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()) if directory.is_dir() else []


def _partial_saves(directory: pathlib.Path) -> list[pathlib.Path]:
    """orbax's temporary folders (`<step>.orbax-checkpoint-tmp...`): a save renamed only when complete."""
    return sorted(directory.glob("*.orbax-checkpoint-tmp*")) if directory.is_dir() else []


def _remove_partial(directory: pathlib.Path) -> None:
    """Remove the folders of saves cut short (a kill, a second Ctrl-C), named in one warning
    with the newest complete step, the one a run resumes from."""
    partial = _partial_saves(directory)
    if not partial:
        return
    complete = _complete_steps(directory)
    for leftover in partial:
        shutil.rmtree(leftover, ignore_errors=True)
    names = ", ".join(p.name for p in partial)
    resumes = f"its newest complete checkpoint is step {complete[-1]}" if complete else "it holds no complete checkpoint"
    warnings.warn(f"checkpoint.dir={str(directory)!r}: removed {names}, a save cut short (never a checkpoint); "
                  f"{resumes}", PartialSaveRemoved, stacklevel=3)


def _check_written_alike(trainer, meta: dict, step: int, directory: pathlib.Path) -> None:
    """A checkpoint resumes only onto the model it was written with (its remat aside), in a
    compute dtype that keeps master weights as it did, and a LoRA one onto the base it was
    trained on, with the same adapters."""
    where, config = f"checkpoint step {step} in {str(directory)!r}", trainer.config
    _check_model_class(meta, config, step, directory)  # first: another class's fields would all read as changes
    changed = first_change(meta["config"], config, ("model.", "lora."), ignore=("model.remat",))
    if changed is not None:
        key, was, value = changed
        raise ConfigError(f"{where} was written with {key}={was!r}, but this run has {key}={value!r}; set "
                          f"{key}={was!r}, or use another checkpoint.dir")
    ours = config.train.compute_dtype
    if meta["compute_dtype"] != ours and "float32" in (meta["compute_dtype"], ours):
        raise ConfigError(
            f"{where} was written with train.compute_dtype={meta['compute_dtype']} (float32 keeps no separate master "
            f"weights), but this run has {ours}; set train.compute_dtype={meta['compute_dtype']}, or use another "
            "checkpoint.dir")
    if trainer.frozen_shardings is not None and meta.get("base", base_of(config)) != base_of(config):
        raise ConfigError(f"{where} holds adapters trained on {meta['base']}, but this run's frozen weights are "
                          f"{base_of(config)}; set checkpoint.init_from (and train.seed) as that run had them, or use "
                          "another checkpoint.dir")


def _check_model_class(meta: dict, config: Config, step: int, directory: pathlib.Path) -> None:
    """A checkpoint of another model config class is refused by name. Only the class's name
    is compared: its module differs for the same class imported from a recipe file (a name
    of jaxpar.recipes' making) or run as a script's __main__."""
    saved, ours = meta.get("model_class"), class_record(type(config.model))
    if saved is not None and saved["qualname"] != ours["qualname"]:  # None: written before checkpoints recorded it
        raise ConfigError(f"checkpoint.dir={str(directory)!r}: step {step} was written by model {class_shown(saved)}, "
                          f"but this run's is {class_shown(ours)}; use another checkpoint.dir for this model, or "
                          "resume with the model that wrote it")


def reorder_layers(trainer, to: str):
    """The jitted move of a TrainState's stacked layers to model order (`to="model"`, before
    a save) or back to the stages' pipeline order (`to="pipeline"`, after a restore), in the
    state's own shardings (a checkpoint's state: LoRA's frozen weights None); None where the
    orders coincide (equal stages of one chunk each). No stage's layers are gathered onto
    another (jaxpar.pipeline.stages.layers_mover)."""
    split = trainer.stage_split
    if split is None:
        return None
    # a checkpoint's state: LoRA's frozen weights are not in it (jaxpar.loop.start.with_base)
    leaves, treedef = jax.tree.flatten(dataclasses.replace(trainer.state_shardings, frozen=None))
    return _reorder_layers(tuple(leaves), treedef, split, to)


@functools.lru_cache(maxsize=16)  # one jitted function per layout: a save does not trace afresh
def _reorder_layers(shardings: tuple, treedef, split: StageSplit, to: str):
    # a restored state is ours to reuse (donated); a saved one is still training
    return layers_mover(jax.tree.unflatten(treedef, shardings), split, to)


def saved_config(directory: str | pathlib.Path, step: int | None = None) -> Config:
    """The Config checkpoint `step` (default: the newest) in `directory` was written with:
    the recorded model config class with its saved fields, and every other section. A field
    the record lacks (added to jaxpar since) keeps its default; a saved key jaxpar no longer
    has is passed over. The model's module is imported (a recipe file from its saved path),
    so read only checkpoints whose code you would run."""
    directory = pathlib.Path(directory).absolute()
    if not directory.is_dir():
        raise ConfigError(f"checkpoint directory {str(directory)!r} does not exist; give the checkpoint.dir of a run "
                          "that saved checkpoints")
    checkpoints = Checkpoints.open(directory, async_save=False)
    try:
        steps = checkpoints.all_steps()
        chosen = steps[-1] if step is None and steps else step
        if chosen is None or chosen not in steps:
            if not steps:
                raise ConfigError(f"checkpoint.dir={str(directory)!r} holds no checkpoint; give the checkpoint.dir of "
                                  "a run that saved some (checkpoint.every=N saves every N steps, and the run's end)")
            which = "" if step is None else f" for step {step}"
            raise ConfigError(f"checkpoint.dir={str(directory)!r} has no checkpoint{which}; it holds steps {steps}")
        meta = checkpoints.meta(chosen)
    finally:
        checkpoints.close()
    return rebuild(meta, f"checkpoint step {chosen} in {str(directory)!r}", chosen)


class UnreadableCheckpoint(JaxparWarning):
    """The newest checkpoint step could not be read; an earlier one was used."""


class PartialSaveRemoved(JaxparWarning):
    """The folder of a save cut short (orbax's temporary one) was removed when the run
    that writes the directory next opened it."""


class CompressionRestarted(JaxparWarning):
    """A checkpoint was resumed without its gradient compression state (none saved, or saved
    for another method or layout): the residuals and factors start afresh."""


def compression_signature(trainer) -> str:
    """What a compression state's shapes depend on: the method, its rank or fraction, the
    replicas and how each parameter is cut into blocks."""
    c = trainer.compressor
    blocks = "; ".join(f"{k} {b.shards}" for k, b in c.blocks.items())
    return f"{c.method} {c.knob} over {c.replicas} replicas; blocks {blocks}"
