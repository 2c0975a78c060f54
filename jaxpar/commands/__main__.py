"""`python -m jaxpar.commands ...`: the `jaxpar` command (what jaxpar launch starts in each process)."""

import sys

from jaxpar.commands import main

sys.exit(main())
