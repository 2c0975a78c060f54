"""shard_map kernels: explicit collectives over named mesh axes, each with a plain reference."""
