"""A small Qwen3 (QK-norm, wide heads) with Megatron sequence parallelism.

The llama recipe's shape (8 devices, Megatron sequence parallelism) with QK-norm and heads
wider than width / heads (untied: jaxpar draws the embedding at unit scale, and a tied head
would then start far from uniform; the tied Qwen3 format is tested by
tests/golden/qwen3_tied).

  jaxpar train qwen3 --set train.steps=30
"""

from jaxpar.config import Config, OptimConfig, ParallelConfig, TensorConfig, TrainConfig
from jaxpar.mesh import MeshConfig
from jaxpar.models.qwen3 import Qwen3Config


def recipe() -> Config:
    return Config(
        model=Qwen3Config(vocab_size=256, embed=128, num_layers=4, num_heads=16, num_kv_heads=8, head_dim=16, mlp=384),
        mesh=MeshConfig(data=-1, fsdp=2, tensor=2),
        parallel=ParallelConfig(tensor=TensorConfig(sequence_parallel=True)),
        train=TrainConfig(steps=60, global_batch=32, seq_len=64, compute_dtype="bfloat16"),
        optim=OptimConfig(lr=3e-3, warmup_steps=10),
    )
