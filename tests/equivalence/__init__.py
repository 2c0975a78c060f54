"""The equivalence tier (pytest -m equivalence): trainers built and their steps compiled, layouts against one device (docs/testing.md)."""
