"""The seed material's MLP (784-512-512-10), data parallel, 4 microbatches a step.

Trained data parallel, with gradient accumulation over 4 microbatches inside the step.

  jaxpar train mlp_dp
"""

from jaxpar.config import Config, OptimConfig, TrainConfig
from jaxpar.mesh import MeshConfig
from jaxpar.models.mlp import MLPConfig


def recipe() -> Config:
    return Config(
        model=MLPConfig(),
        mesh=MeshConfig(data=-1),
        train=TrainConfig(steps=100, global_batch=256, microbatches=4, compute_dtype="float32"),
        optim=OptimConfig(name="adamw", lr=3e-3, warmup_steps=5, weight_decay=0.0),
    )
