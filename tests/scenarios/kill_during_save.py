"""Run by tests/scenarios/test_checkpoint.py in place of `python -m jaxpar.commands`, with the same
arguments: `jaxpar train`, with a save that never completes, at a point where waiting for it
from outside would be a race:

  JAXPAR_TEST_KILL_AT_SAVE=N       the process SIGKILLs itself inside the save of step N,
                                   after orbax has written every array into the save's
                                   temporary directory and before the rename that commits it.
  JAXPAR_TEST_HOLD_STOP_SAVE=FILE  the save of the step a first SIGINT stops the run after
                                   (the step its immediate line names) stops at that same
                                   point: its thread writes the step into FILE and waits, so
                                   that a second SIGINT lands inside the save every time.
"""

import asyncio
import os
import pathlib
import signal
import sys

from orbax.checkpoint._src.path import atomicity

from jaxpar.commands import main
from jaxpar.loop import stop

KILL_AT = os.environ.get("JAXPAR_TEST_KILL_AT_SAVE")
HOLD_FILE = os.environ.get("JAXPAR_TEST_HOLD_STOP_SAVE")
held: dict = {}  # "step": the step the first stop signal stops after, as text
commit = atomicity.AtomicRenameTemporaryPath.finalize  # fails here, loudly, if orbax moves it
handle = stop.StopSignals._handle


def handle_and_note(self, number, frame):
    handle(self, number, frame)  # the second SIGINT raises here
    held.setdefault("step", str(self.after))


async def finalize_or_stop(self, *args, **kwargs):
    name = self.get_final().name
    if name == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    if HOLD_FILE and name == held.get("step"):
        written = pathlib.Path(HOLD_FILE + ".writing")  # renamed whole: the test never reads it half-written
        written.write_text(name)
        written.rename(HOLD_FILE)
        await asyncio.sleep(3600)  # this save never commits; the process ends first
    return await commit(self, *args, **kwargs)


atomicity.AtomicRenameTemporaryPath.finalize = finalize_or_stop
stop.StopSignals._handle = handle_and_note
sys.exit(main(sys.argv[1:]))
