"""Mixture of experts: a small Mixtral-style decoder, 8 experts, top-2.

8 experts with top-2 routing, spread over mesh.expert=4 (all-to-all dispatch) x mesh.data=2
(8 devices).

  jaxpar train moe --set train.steps=50
  jaxpar train moe --set model.routing=dropless
  jaxpar train moe --set mesh.expert=2 --set mesh.tensor=2     # tensor parallel inside experts
  jaxpar train moe --set model.aux_loss_weight=0 --set model.bias_update_rate=0.001
  jaxpar explain moe                                           # all-to-all bytes vs the formula
"""

from jaxpar.config import Config, OptimConfig, TrainConfig
from jaxpar.mesh import MeshConfig
from jaxpar.models.moe import MoEConfig


def recipe() -> Config:
    return Config(
        model=MoEConfig(
            vocab_size=256, embed=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp=64,
            num_experts=8, top_k=2, routing="capacity", capacity_factor=1.25,
            aux_loss_weight=0.01, z_loss_weight=0.001,
        ),
        mesh=MeshConfig(data=-1, expert=4),
        train=TrainConfig(steps=100, global_batch=16, seq_len=64, compute_dtype="bfloat16"),
        optim=OptimConfig(lr=3e-3, warmup_steps=10),
    )
