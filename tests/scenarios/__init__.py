"""The scenario tier (pytest -m scenario): processes started and killed, runs resumed, jaxpar train end to end (docs/testing.md)."""
