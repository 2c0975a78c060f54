"""The unit tier (pytest -m unit): nothing here compiles a training step (docs/testing.md)."""
