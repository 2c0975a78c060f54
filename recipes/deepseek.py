"""DeepSeek-V3 in small: latent attention, fine-grained experts, multi-token prediction.

A dense layer, then two MoE layers of 8 fine-grained experts (top 2 within 2 of 4 groups,
gates x 2.5, one shared expert, sigmoid scores with bias balancing), multi-head latent
attention (query and key/value latents), and multi-token prediction; experts over
mesh.expert=4 x mesh.data=2 (8 devices).

  jaxpar train deepseek --set train.steps=50
  jaxpar train deepseek --set mesh.stage=2 --set mesh.expert=2 --set train.microbatches=2
                                                     # DeepSeek's PP x EP x data, MTP on the last stage
  jaxpar explain deepseek                            # the all-to-alls beside their formula
  jaxpar plan --model deepseek-v3 --devices 2048     # the published shape (docs/models/deepseek.md)
"""

from jaxpar.config import Config, OptimConfig, TrainConfig
from jaxpar.mesh import MeshConfig
from jaxpar.models.deepseek import DeepSeekConfig


def recipe() -> Config:
    return Config(
        model=DeepSeekConfig(
            vocab_size=256, embed=64, num_layers=2, dense_layers=1, dense_mlp=128, num_heads=4, num_kv_heads=4,
            head_dim=24, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            mlp=32, num_experts=8, top_k=2, expert_groups=4, top_groups=2, routed_scaling=2.5, shared_experts=1,
            routing="dropless", bias_update_rate=0.001, aux_loss_weight=0.0001, z_loss_weight=0.0,
            mtp_layers=1, mtp_weight=0.3,
        ),
        mesh=MeshConfig(data=-1, expert=4),
        train=TrainConfig(steps=100, global_batch=16, seq_len=64, compute_dtype="bfloat16"),
        optim=OptimConfig(lr=3e-3, warmup_steps=10),
    )
