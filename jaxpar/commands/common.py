"""What the commands share: the arguments every run-like command takes (a recipe's --set
overrides, --cpu-devices), one-line errors and warnings, and running a command as one process of several (jaxpar.distributed). Paths a
run records for `sample` and `export` to read back are checked here too."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import warnings

from jaxpar.errors import ConfigError, JaxparWarning, TrainingStopped

PREEMPTED_EXIT = 143  # as if SIGTERM had ended the process: schedulers requeue on it
INTERRUPTED_EXIT = 130  # as if SIGINT had: a shell's Ctrl-C
RECIPE_HELP = ("a shipped recipe (see `jaxpar recipes`), a path to a .py file defining recipe() -> Config "
               "(path.py:function names another), package.module[:function] importable from here, or "
               "hf:FOLDER (a Hugging Face checkpoint folder: its model, to fine-tune)")


def add_overrides(parser, example: str) -> None:
    """--set KEY=VALUE (repeatable) and --config FILE.toml, into args.overrides: the file's
    keys first, wherever --config stands, so --set wins."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a config field, e.g. --set {example} (repeatable)")
    parser.add_argument("--config", action=_TomlOverrides, metavar="FILE.toml",
                        help="overrides from a TOML file, a table per section ([train] steps = 50); "
                        "jaxpar train RECIPE --print-config --as-toml writes one")


class _TomlOverrides(argparse.Action):
    def __call__(self, parser, namespace, path, option_string=None):
        from jaxpar.config_text import read_toml

        namespace.overrides = read_toml(path) + list(namespace.overrides or [])


def add_cpu_devices(parser) -> None:
    """--cpu-devices N, into args.cpu_devices (checked by check_cpu_devices)."""
    parser.add_argument("--cpu-devices", type=int, default=8, metavar="N",
                        help="virtual CPU devices when no accelerator is present (default 8)")


def check_cpu_devices(args) -> None:
    if args.cpu_devices < 1:
        raise ConfigError(f"--cpu-devices={args.cpu_devices} must be at least 1")


def one_line_warning(message, category, filename, lineno, line=None, _python=warnings.formatwarning) -> str:
    """jaxpar's own warnings as one line; everyone else's as Python formats them."""
    if issubclass(category, JaxparWarning):
        return f"jaxpar: warning: {message}\n"
    return _python(message, category, filename, lineno, line)


def report_error(e: Exception) -> int:
    """Print the one-line message of an error jaxpar expects, and return the exit status."""
    if isinstance(e, ConfigError):
        print(f"jaxpar: error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, TrainingStopped):
        print(f"jaxpar: training stopped: {e}", file=sys.stderr)
        return 1
    import traceback

    traceback.print_exception(e)
    return 1


def in_cluster(body, settings) -> int:
    """body() alone, or, when the environment names a cluster (jaxpar.distributed), as one of
    its processes: joined first with `settings()` (a DistributedConfig, checked before it is
    used), watched by the heartbeat, and ended without JAX's shutdown barrier on an error
    (the other processes are not coming to it)."""
    from jaxpar import distributed

    cluster = distributed.from_environment()
    if cluster is None:
        return body()
    from jaxpar.launch import follow_launcher

    follow_launcher()  # started by `jaxpar launch`: stop when it dies
    config = settings()
    distributed.join(cluster, config.heartbeat_timeout_s, config.join_timeout_s)
    watchdog = distributed.Watchdog(config.heartbeat_timeout_s).start()
    try:
        code = body()
    except BaseException as e:
        watchdog.stop(f"{type(e).__name__}: {e}")
        code = report_error(e) if isinstance(e, Exception) else 130
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # not through JAX's shutdown barrier: the other processes are not coming to it
    watchdog.stop()
    return code


def distributed_settings(config, overrides: list[str]):
    """`config`'s distributed.* settings with the overrides that name them, checked."""
    from jaxpar.checks import by_id
    from jaxpar.config import apply_overrides

    config = apply_overrides(config, [o for o in overrides if o.startswith("distributed.")])
    by_id("distributed-timeouts-positive").check(config, None)
    return config.distributed


def hf_checkpoint(path: str) -> str | None:
    """The folder `path` names where it is a Hugging Face checkpoint (hf:FOLDER, or a folder
    holding config.json and safetensors files) rather than a run's checkpoint.dir, else None."""
    folder = pathlib.Path(path.removeprefix("hf:"))
    if path.startswith("hf:") or ((folder / "config.json").is_file() and any(folder.glob("*.safetensors"))):
        return str(folder)
    return None


def recorded_file(value: str, field: str, recorded_in: str | None, instead: str) -> None:
    """Refuse, in one line, a path the run recorded in `recorded_in` (None: given with --set)
    that is not a file here. A relative one (as jaxpar recorded them before it made them
    absolute) is resolved against the current folder, which the message names."""
    path = pathlib.Path(value)
    if path.is_file():
        return
    if recorded_in is None:
        raise ConfigError(f"{field}={value!r} (given with --set) is not a file; give {instead}")
    where = f"{field}={value!r} (as the run recorded it in {recorded_in!r})"
    if not path.is_absolute():
        raise ConfigError(f"{where} is a relative path, not found from this folder, {os.getcwd()!r}; run from the "
                          f"folder the run was trained in, or give {instead}")
    raise ConfigError(f"{where} is not a file; give {instead}")


def recorded_in(args, field: str) -> str | None:
    """The checkpoint a saved config field's value comes from, or None where --set gives it."""
    return None if any(o.startswith(field + "=") for o in args.overrides) else args.checkpoint


def restore(trainer, checkpoint: str, step: int | None):
    """(state, step): a run's checkpoint at `step` (None: the newest) restored onto `trainer`,
    read synchronously and closed after, as `sample` and `export` read one."""
    from jaxpar.loop.checkpoint import Checkpoints
    from jaxpar.loop.start import start_of, with_base

    checkpoints = Checkpoints.open(checkpoint, async_save=False)
    try:
        state, step = checkpoints.restore(trainer, step)
    finally:
        checkpoints.close()
    return with_base(trainer, state, start_of(trainer)), step
