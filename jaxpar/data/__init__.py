"""Data: batch layouts and sources that read only this host's rows. The mixture of sources
registers its data.source on import (jaxpar.data.sources.OPENERS)."""

from jaxpar.data import mixture as _mixture  # noqa: F401
