"""8 CPU devices for every test, forced before JAX starts; tiny models only."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.mesh import force_cpu_devices  # noqa: E402

force_cpu_devices(8)

import pytest  # noqa: E402

from jaxpar.config import Config, TrainConfig  # noqa: E402
from jaxpar.testing import reference_run  # noqa: E402
from models.llama import LlamaConfig  # noqa: E402


@pytest.fixture
def tiny_llama() -> Config:
    """fp32 so sharded runs can be compared with the single-device run to 1e-5."""
    return Config(
        model=LlamaConfig(vocab_size=128, embed=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, mlp=64),
        train=TrainConfig(steps=3, global_batch=16, seq_len=16, compute_dtype="float32"),
    )


@pytest.fixture(scope="session")
def reference():
    """reference(config) -> the single-device Run, computed once per config per session."""
    runs: dict = {}

    def get(config):
        key = repr(config)
        if key not in runs:
            runs[key] = reference_run(config)
        return runs[key]

    return get
