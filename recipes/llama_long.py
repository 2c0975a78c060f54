"""Long sequences: a narrow Llama's 4k tokens split over mesh.context (ring attention).

Ring attention in the zigzag layout, so causal work is even over the 8 devices.

  jaxpar train llama_long --set train.steps=10
  jaxpar train llama_long --set parallel.context.impl=ulysses
  jaxpar explain llama_long --set train.seq_len=131072     # compile only: memory at 128k
"""

from jaxpar.config import Config, ContextConfig, OptimConfig, ParallelConfig, TrainConfig
from jaxpar.mesh import MeshConfig
from jaxpar.models.llama import LlamaConfig


def recipe() -> Config:
    return Config(
        model=LlamaConfig(vocab_size=256, embed=128, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=16, mlp=256),
        mesh=MeshConfig(data=-1, context=8),
        parallel=ParallelConfig(context=ContextConfig(impl="ring", layout="zigzag", block=512)),
        train=TrainConfig(steps=40, global_batch=2, seq_len=4096, compute_dtype="bfloat16"),
        optim=OptimConfig(lr=3e-3, warmup_steps=5),
    )
