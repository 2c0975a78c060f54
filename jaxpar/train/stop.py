"""Stopping a run of one process cleanly: SIGINT (Ctrl-C) or SIGTERM asks the loop to stop at
the next step boundary, save (with checkpoint.dir) and end with one line; a second SIGINT
stops at once. Runs of several processes leave SIGTERM to JAX's preemption service, which
agrees on the step among them (jaxpar.train.loop), and `jaxpar launch` turns its own SIGINT
into SIGTERM for its processes."""

from __future__ import annotations

import signal
import threading
from types import FrameType


class StopSignals:
    """Between `install` (in the main thread only; elsewhere it does nothing) and `restore`,
    `asked` holds the name of the first stop signal received, else None."""

    def __init__(self, sigterm: bool):
        self.signals = [signal.SIGINT] + ([signal.SIGTERM] if sigterm else [])
        self.asked: str | None = None
        self._previous: dict = {}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.asked is not None and number == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without the save
        self.asked = signal.Signals(number).name

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.signals}

    def restore(self) -> None:
        """The handlers from before `install`."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
