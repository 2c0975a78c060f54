"""Errors jaxpar raises: bad configuration (before anything is compiled), and a training run
that cannot go on."""

import difflib
from typing import Iterable


class ConfigError(ValueError):
    """A configuration value that cannot work: the message names the field, the value and what would."""

    rule: str | None = None  # the id of the jaxpar.checks rule that raised it, if one did


QUOTED = "'{}'"  # did_you_mean's form for a name an error quotes


def did_you_mean(name: str, choices: Iterable[str], form: str = "{}") -> str:
    """' (did you mean CHOICE?)', the choice nearest a misspelt `name` (difflib's measure)
    written as `form` says ("'{}'", "train.{}"), for a ConfigError; '' where none is near, or
    the nearest is `name` itself."""
    near = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {form.format(near[0])}?)" if near and near[0] != name else ""


class JaxparWarning(UserWarning):
    """Something a run goes on despite, said in one line (the CLI prints it as
    `jaxpar: warning: ...`, without Python's file and source line)."""


class TrainingStopped(RuntimeError):
    """Training cannot go on (a non-finite loss or gradient under train.on_nonfinite=stop):
    the message names the step and what went wrong."""


class Preempted(RuntimeError):
    """The run was told to stop (SIGTERM, or SIGINT to a run of one process:
    jaxpar.loop.stop) and stopped after `step`, saved to `directory` when checkpoints are on."""

    def __init__(self, step: int, directory: str | None, signal: str = "SIGTERM"):
        self.step, self.directory, self.signal = step, directory, signal
        saved = f"saved step {step} to {directory}; run the same command to resume" if directory else (
            "nothing saved (no checkpoint.dir)")
        told = "preempted" if signal == "SIGTERM" else f"stopped by {signal}"
        super().__init__(f"{told} after step {step}: {saved}")
