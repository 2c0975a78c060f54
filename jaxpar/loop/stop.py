"""Stopping a run of one process cleanly: SIGINT (Ctrl-C) or SIGTERM asks the loop to stop at
the next step boundary, save (with checkpoint.dir) and end with one line; a second SIGINT
stops at once, without waiting for the save. Runs of several processes leave SIGTERM to
JAX's preemption service, which agrees on the step among them (jaxpar.loop.run), and
`jaxpar launch` turns its own SIGINT into SIGTERM for its processes.

The first signal is answered at once, from the handler, with the step the run will stop
after: the handler fixes that step itself (the loop's next boundary when it arrives), and the
loop stops there, so the line and the stop cannot disagree."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType


def say(line: str) -> None:
    """`line` on stderr, straight to the file descriptor where there is one: a signal handler
    that wrote through sys.stderr while the interrupted code was writing there (tqdm's bar)
    would fail with a reentrant call."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stderr (pytest's capsys)
        sys.stderr.write(line + "\n")
        return
    os.write(fd, (("\n" if os.isatty(fd) else "") + line + "\n").encode())


def stopping_line(signal_name: str, after: int | None, directory: str | None) -> str:
    """What the first stop signal is answered with: the step the run stops after (None: the
    last step is done and only the run's end remains) and where it saves."""
    if after is None:
        where = f", finishing its save to {directory} (Ctrl-C again to stop without waiting)" if directory else ""
        return f"jaxpar: {signal_name}: the last step is done{where}"
    if directory is None:
        return f"jaxpar: {signal_name}: stopping after step {after}; no checkpoint.dir, nothing will be saved"
    return (f"jaxpar: {signal_name}: stopping after step {after}, saving to {directory} (Ctrl-C again to stop "
            "without saving)")


class StopSignals:
    """Between `install` (in the main thread only; elsewhere it does nothing) and `restore`:
    `asked` holds the name of the first stop signal received, else None, and `after` the
    step the run is to stop after. The loop calls `passed(done)` at each step boundary (done:
    the steps completed) and stops where it returns True; `next` is the boundary a signal
    arriving now stops at (None past the last). `say(line)` answers the first signal (None:
    silently, as the processes but the first of several)."""

    def __init__(self, sigterm: bool, first: int, last: int, directory: str | None = None,
                 say: Callable[[str], None] | None = say):
        self.signals = [signal.SIGINT] + ([signal.SIGTERM] if sigterm else [])
        self.asked: str | None = None
        self.after: int | None = None
        self.next: int | None = first if first <= last else None
        self.last, self.directory, self.say = last, directory, say
        self._previous: dict = {}

    def passed(self, done: int) -> bool:
        """At the boundary after `done` steps: whether to stop here. The next boundary is set
        before `after` is read: a signal before that stops here, one after it at the next."""
        self.next = done + 1 if done < self.last else None
        return self.after is not None and self.after <= done

    def ending(self) -> None:
        """The loop stops at this boundary (another signal or process asked): no later one."""
        self.next = None

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.asked is not None:
            if number == signal.SIGINT:
                raise KeyboardInterrupt  # the second Ctrl-C: stop now, without the save
            return  # another SIGTERM: the stop is already fixed
        self.asked, self.after = signal.Signals(number).name, self.next
        if self.say is not None:
            self.say(stopping_line(self.asked, self.after, self.directory))

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.signals}

    def restore(self) -> None:
        """The handlers from before `install`."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


class Interrupted(KeyboardInterrupt):
    """The run stopped at once (a second Ctrl-C) without waiting for a save in flight;
    `str()` says what the checkpoint directory keeps. `abandoned`: the step whose save was
    cut short, else None. In this process the background write of that save may still go on
    (`jaxpar train` exits at once, so it never completes behind the message)."""

    def __init__(self, message: str, abandoned: int | None):
        super().__init__(message)
        self.abandoned = abandoned
