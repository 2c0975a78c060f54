"""The checkpoint section: saving, keeping, and starting from a Hugging Face checkpoint."""

from __future__ import annotations

import os
import pathlib

from jaxpar.checks.rule import Rule, collector
from jaxpar.errors import ConfigError

RULES: list[Rule] = []
rule = collector(RULES)


@rule(
    "checkpoint-every",
    fields=["checkpoint.every"],
    summary="Checkpoints are saved every so many steps, or (0) only at the end.",
    example=["checkpoint.every=-1"],
)
def checkpoint_every(config, sizes) -> None:
    if config.checkpoint.every < 0:
        raise ConfigError(f"checkpoint.every={config.checkpoint.every}; use a number of steps, or 0 to save only at the end")


@rule(
    "checkpoint-keep",
    fields=["checkpoint.keep"],
    summary="At least the newest checkpoint is kept.",
    example=["checkpoint.keep=0"],
)
def checkpoint_keep(config, sizes) -> None:
    if config.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep={config.checkpoint.keep}; keep at least 1 checkpoint, e.g. checkpoint.keep=3")


@rule(
    "checkpoint-dir-can-be-a-folder",
    fields=["checkpoint.dir"],
    summary="checkpoint.dir is a folder, or one that can be created: the nearest part of its path that exists is a "
    "folder.",
    example=["checkpoint.dir=/dev/null/ck"],
)
def checkpoint_dir_can_be_a_folder(config, sizes) -> None:
    # whether this user can write there is asked by the run that saves (Checkpoints.open):
    # `jaxpar export` and `sample` build the config a run recorded, perhaps on another machine
    problem = folder_problem(config.checkpoint.dir, writing=False) if config.checkpoint.dir else None
    if problem:
        raise ConfigError(problem)


def folder_problem(directory: str | os.PathLike, writing: bool) -> str | None:
    """Why checkpoint.dir=`directory` cannot hold checkpoints, as an error says it: it, or
    the nearest part of its path that exists, is not a folder, or (`writing`) not one this
    user can write; None where it can. Nothing is created."""
    path = pathlib.Path(directory).absolute()
    existing = next(p for p in (path, *path.parents) if os.path.exists(p))  # the root exists
    shown, instead = f"checkpoint.dir={str(path)!r}", "or checkpoint.dir='' for no checkpoints"
    if existing == path and not path.is_dir():  # orbax would retry, then hang
        return f"{shown} is a file, not a folder; give a folder (it is created if missing), {instead}"
    if not existing.is_dir():  # orbax's makedirs would end in a traceback
        return f"{shown} cannot be created ({existing} is not a folder); give a folder this user can write, {instead}"
    if writing and not os.access(existing, os.W_OK | os.X_OK):
        why = ("is a folder this user cannot write" if existing == path else
               f"cannot be created ({existing} is not writable by this user)")
        return f"{shown} {why}; give a folder this user can write, {instead}"
    return None


@rule(
    "init-from-needs-hf-format",
    fields=["checkpoint.init_from", "model"],
    summary="Starting from a Hugging Face checkpoint needs a model that declares Hugging Face's format (jaxpar.hf).",
    example=["checkpoint.init_from=checkpoints/llama"],
    base="mlp",
)
def init_from_needs_hf_format(config, sizes) -> None:
    if config.checkpoint.init_from:
        from jaxpar.hf.format import format_of

        try:
            format_of(config.model)
        except ConfigError as e:
            raise ConfigError(f"checkpoint.init_from={config.checkpoint.init_from!r}: {e}, or drop "
                              "checkpoint.init_from to train it from its own initialisation") from None
