"""Run by tests/test_checkpoint.py in place of `python -m jaxpar.commands`, with the same
arguments: `jaxpar train`, except that the process SIGKILLs itself inside the save of step
$JAXPAR_TEST_KILL_AT_SAVE, after orbax has written every array into the save's temporary
directory and before the rename that would commit it. A kill during a save, every time,
where waiting for one from outside is a race."""

import os
import signal
import sys

from orbax.checkpoint._src.path import atomicity

from jaxpar.commands import main

KILL_AT = os.environ["JAXPAR_TEST_KILL_AT_SAVE"]
commit = atomicity.AtomicRenameTemporaryPath.finalize  # fails here, loudly, if orbax moves it


async def finalize_or_die(self, *args, **kwargs):
    if self.get_final().name == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    return await commit(self, *args, **kwargs)


atomicity.AtomicRenameTemporaryPath.finalize = finalize_or_die
sys.exit(main(sys.argv[1:]))
