"""`jaxpar explain`: a compiled step's memory, FLOPs and traffic beside the published
formulas (jaxpar.inspect.formulas), as a table or as JSON.

The document is the rows of each part of jaxpar.inspect.rows.PROVIDERS in turn, all read
from one gathering of the step's facts (jaxpar.inspect.facts); a new strategy adds a
provider there, not a line here. Ratios are measured / formula.
"""

from __future__ import annotations

from typing import Any

from jaxpar.inspect.facts import facts_of
from jaxpar.inspect.model_state import loss_logits
from jaxpar.inspect.report import StepReport
from jaxpar.inspect.rows import PROVIDERS

__all__ = ["explain", "loss_logits", "render"]


def explain(trainer, report: StepReport) -> dict[str, Any]:
    """Measured figures, their formulas and ratios; plain data for --json and the table."""
    facts = facts_of(trainer, report)
    return {key: value for provider in PROVIDERS for key, value in provider.rows(facts).items()}


def render(doc: dict[str, Any]) -> str:
    """The table `jaxpar explain` prints."""
    return "\n".join(line for provider in PROVIDERS for line in provider.lines(doc))
