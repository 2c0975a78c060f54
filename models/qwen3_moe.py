"""Qwen3-MoE: Qwen3's attention (QK-norm, wide heads) over many small experts in every layer,
softmax routing with the top-k gates renormalised when `norm_topk_prob` (Qwen3-30B-A3B and
-235B-A22B: 128 experts, top 8), no shared experts, as Hugging Face's `Qwen3MoeForCausalLM`.

Nothing here but the family's config and format: the experts are models/moe.py's, the q/k
norms Llama's part. Routing imports dropless, as the checkpoint computes it; a checkpoint
with dense layers among the MoE ones (`decoder_sparse_step` > 1, `mlp_only_layers`) is
refused in one line (no published Qwen3-MoE has them).
"""

from __future__ import annotations

import dataclasses

from jaxpar.errors import ConfigError
from jaxpar.families import Family, register
from jaxpar.hf.config import value
from jaxpar.models.llama import llama_from_hf, llama_to_hf, refuse_parts, refuse_scaled_tied_head
from jaxpar.models.moe import MoEConfig, experts_hf_weights
from jaxpar.models.qwen3 import qwen3_window, qwen3_window_keys


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(MoEConfig):
    qk_norm: bool = True
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6

    hf_architectures = ("Qwen3MoeForCausalLM",)

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3MoeConfig":
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise ConfigError(f"config.json has decoder_sparse_step={hf.get('decoder_sparse_step', 1)} and "
                              f"mlp_only_layers={hf.get('mlp_only_layers')}: dense layers among the MoE ones, which "
                              "jaxpar's Qwen3-MoE does not have (every layer MoE: decoder_sparse_step=1, no mlp_only_layers)")
        k, renormalize = value(hf, "num_experts_per_tok"), bool(hf.get("norm_topk_prob", False))
        if k == 1 and renormalize:
            raise ConfigError("config.json has num_experts_per_tok=1 with norm_topk_prob=true: a single renormalised gate "
                              "is 1 (the router gets no gradient), where jaxpar keeps the router's probability")
        aux = float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0
        return llama_from_hf(cls, {**hf, "sliding_window": qwen3_window(hf)}, qk_norm=True,
                             mlp=value(hf, "moe_intermediate_size"), top_k=k,
                             num_experts=hf.get("num_experts") or value(hf, "num_local_experts"),  # transformers 4, 5
                             routing="dropless", renormalize=renormalize, shared_experts=0, aux_loss_weight=aux,
                             z_loss_weight=0.0, bias_update_rate=0.0)

    def to_hf(self) -> dict:
        if self.shared_experts:
            raise ConfigError(f"model.shared_experts={self.shared_experts}: Qwen3-MoE's format has no shared experts")
        refuse_parts(self, "Qwen3MoeForCausalLM", qk_norm=True, qkv_bias=False, router_scores="softmax",
                     expert_groups=1, top_groups=1, routed_scaling=1.0)
        refuse_scaled_tied_head(self, "Qwen3-MoE")
        hf = llama_to_hf(self, "Qwen3MoeForCausalLM", "qwen3_moe")
        hf.pop("mlp_bias")
        # intermediate_size is the dense MLP's, which no layer has here: written as the experts'
        return {**hf, "moe_intermediate_size": self.mlp, "num_experts": self.num_experts,
                "num_experts_per_tok": self.top_k, "norm_topk_prob": self.renormalize, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "router_aux_loss_coef": self.aux_loss_weight,
                "output_router_logits": self.aux_loss_weight > 0, **qwen3_window_keys(self)}

    def hf_weights(self) -> dict:
        mlp = "model.layers.{layer}.mlp."
        return experts_hf_weights(self, "Qwen3-MoE", mlp + "gate.weight", mlp + "experts.{expert}.",
                                  ("gate_proj", "up_proj", "down_proj"))


register(Family("qwen3-moe", Qwen3MoeConfig, presets={
    # config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B: 128 experts, top 8. Capacity
    # routing, as the other MoE presets: its compiled FLOPs are those a GPU runs.
    "qwen3-30b-a3b": Qwen3MoeConfig(vocab_size=151936, embed=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                                    head_dim=128, mlp=768, num_experts=128, top_k=8, renormalize=True,
                                    routing="capacity"),
    "qwen3-235b-a22b": Qwen3MoeConfig(vocab_size=151936, embed=4096, num_layers=94, num_heads=64, num_kv_heads=4,
                                      head_dim=128, mlp=1536, num_experts=128, top_k=8, renormalize=True,
                                      routing="capacity"),
}))
