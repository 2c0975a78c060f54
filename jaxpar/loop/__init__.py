"""The host run around the step: the loop (run.py), its starting state (start.py), the
compiled step checked against the devices' memory (fits.py), checkpoints, metric writers,
the profiler, stop signals and held-out evaluation."""
