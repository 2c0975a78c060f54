"""A small Llama with Megatron sequence parallelism.

On data x fsdp x tensor (8 devices).

  jaxpar train llama --set train.steps=30
"""

from jaxpar.config import Config, OptimConfig, ParallelConfig, TensorConfig, TrainConfig
from jaxpar.mesh import MeshConfig
from jaxpar.models.llama import LlamaConfig


def recipe() -> Config:
    return Config(
        model=LlamaConfig(vocab_size=256, embed=128, num_layers=4, num_heads=16, num_kv_heads=8, head_dim=8, mlp=384),
        mesh=MeshConfig(data=-1, fsdp=2, tensor=2),
        parallel=ParallelConfig(tensor=TensorConfig(sequence_parallel=True)),
        train=TrainConfig(steps=60, global_batch=32, seq_len=64, compute_dtype="bfloat16"),
        optim=OptimConfig(lr=3e-3, warmup_steps=10),
    )
