"""A small Gemma 3: local and global attention layers, context parallel (a ring).

Four layers, local, local, global, local (model.global_every=3; the published models: 5
local then 1 global), the local ones over a window of 16 of the 64 tokens with RoPE base
10^4, the global one over all of them at 10^6 slowed 8x, all split over a ring of context=4
in the contiguous order (which stops early in the local layers) x data 2 (8 devices).

  jaxpar train gemma3 --set train.steps=30
  jaxpar train gemma3 --set mesh.stage=2 --set mesh.context=2 --set train.microbatches=4   # a stage holds both kinds
"""

from jaxpar.config import Config, ContextConfig, OptimConfig, ParallelConfig, TrainConfig
from jaxpar.mesh import MeshConfig
from jaxpar.models.gemma3 import Gemma3Config


def recipe() -> Config:
    return Config(
        model=Gemma3Config(vocab_size=256, embed=128, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=16,
                           mlp=384, sliding_window=16, global_every=3, query_pre_attn_scalar=16,
                           rope_linear_factor=8.0),
        mesh=MeshConfig(data=-1, context=4),
        parallel=ParallelConfig(context=ContextConfig(impl="ring", layout="contiguous")),
        train=TrainConfig(steps=60, global_batch=16, seq_len=64, compute_dtype="bfloat16"),
        optim=OptimConfig(lr=3e-3, warmup_steps=10),
    )
