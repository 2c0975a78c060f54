"""A small Mistral: a sliding window of 16 keys over a context ring.

The llama recipe's shape with a sliding window of 16 keys over its 64-token sequences, split
over a ring of context=4 in the contiguous order (where the ring stops after the two blocks
each window reaches) x data 2 (8 devices).

  jaxpar train mistral --set train.steps=30
  jaxpar explain mistral                          # the shortened ring's traffic beside its formula
"""

from jaxpar.config import Config, ContextConfig, OptimConfig, ParallelConfig, TrainConfig
from jaxpar.mesh import MeshConfig
from jaxpar.models.mistral import MistralConfig


def recipe() -> Config:
    return Config(
        model=MistralConfig(vocab_size=256, embed=128, num_layers=4, num_heads=16, num_kv_heads=8, head_dim=8,
                            mlp=384, sliding_window=16),
        mesh=MeshConfig(data=-1, context=4),
        parallel=ParallelConfig(context=ContextConfig(impl="ring", layout="contiguous")),
        train=TrainConfig(steps=60, global_batch=16, seq_len=64, compute_dtype="bfloat16"),
        optim=OptimConfig(lr=3e-3, warmup_steps=10),
    )
