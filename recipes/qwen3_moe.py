"""A small Qwen3-MoE: 16 experts in every layer, top 4, dropless.

Qwen3's attention (QK-norm, heads wider than embed / heads) over 16 small experts in every
layer, top 4 renormalised (norm_topk_prob), dropless, the experts over mesh.expert=4 x data 2
(8 devices); the published 30B-A3B and 235B-A22B: 128 experts, top 8.

  jaxpar train qwen3_moe --set train.steps=30
  jaxpar explain qwen3_moe                        # the all-to-all's bytes beside its formula
"""

from jaxpar.config import Config, OptimConfig, TrainConfig
from jaxpar.mesh import MeshConfig
from jaxpar.models.qwen3_moe import Qwen3MoeConfig


def recipe() -> Config:
    return Config(
        model=Qwen3MoeConfig(vocab_size=256, embed=64, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=16, mlp=32,
                             num_experts=16, top_k=4, renormalize=True, routing="dropless", aux_loss_weight=0.001),
        mesh=MeshConfig(data=-1, expert=4),
        train=TrainConfig(steps=60, global_batch=16, seq_len=64, compute_dtype="bfloat16"),
        optim=OptimConfig(lr=3e-3, warmup_steps=10),
    )
