"""Qwen3-MoE: Qwen3's attention (QK-norm, wide heads) over many small experts in every layer,
softmax routing with the top-k gates renormalised when `norm_topk_prob` (Qwen3-30B-A3B and
-235B-A22B: 128 experts, top 8), no shared experts, as Hugging Face's `Qwen3MoeForCausalLM`.

Nothing here but the family's config and format, both made of Qwen3's parts
(models/qwen3.py: `Qwen3Parts`, and the format's translation and refusals, `qwen3_from_hf`,
`qwen3_to_hf`) with models/moe.py's experts. Routing imports dropless, as the checkpoint
computes it.

Dense layers among the MoE ones (config.json's `mlp_only_layers`, and `decoder_sparse_step`
k > 1, which leaves layer i dense unless (i + 1) % k == 0): `model.mlp_only_layers` lists them
by index in the whole model, which holds `num_layers` MoE layers and these (as DeepSeek's
dense layers: num_layers counts the MoE ones); each has Qwen3's dense MLP of width
`dense_mlp` (intermediate_size). models/moe.py runs them as a stack of their own, in order
among the MoE ones. The export writes them as mlp_only_layers with decoder_sparse_step 1
(the same layers in transformers' rule).
"""

from __future__ import annotations

import dataclasses

from jaxpar.errors import ConfigError
from jaxpar.families import Family, register
from jaxpar.hf.config import value
from jaxpar.hf.weights import Weight
from jaxpar.models.llama import refuse_parts
from jaxpar.models.moe import MOE_TRAINING_FIELDS, MoEConfig, experts_hf_weights, stack_layer_ids
from jaxpar.models.qwen3 import QWEN3_FORMAT, Qwen3Parts, qwen3_from_hf, qwen3_to_hf


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Parts, MoEConfig):
    """Qwen3's parts (models.qwen3.Qwen3Parts) over models.moe's experts; `mlp` is each expert's width."""

    # Layers with a dense MLP instead of experts (Hugging Face's mlp_only_layers): their indices
    # in the whole model, comma-separated ("1,3"), which holds num_layers MoE layers and these.
    mlp_only_layers: str = ""
    dense_mlp: int = 256  # the dense layers' MLP width (intermediate_size)

    def check(self, sizes: dict[str, int]) -> None:
        super().check(sizes)
        if self.dense_mlp < 1:
            raise ConfigError(f"model.dense_mlp={self.dense_mlp} must be a positive integer (the dense layers' MLP width)")

    def dense_layer_ids(self) -> tuple[int, ...]:
        """model.mlp_only_layers as indices (models.moe's dense layers), checked."""
        text = self.mlp_only_layers.replace(" ", "")
        try:
            ids = tuple(int(i) for i in text.split(",")) if text else ()
        except ValueError:
            ids = None
        total = self.num_layers + len(ids or ())
        if ids is None or len(set(ids)) != len(ids) or not all(0 <= i < total for i in ids):
            raise ConfigError(f"model.mlp_only_layers={self.mlp_only_layers} must list distinct layer indices "
                              f"below {total} (the model's num_layers={self.num_layers} MoE layers and these), "
                              "comma-separated, e.g. model.mlp_only_layers=1 or 0,2; empty for none")
        return tuple(sorted(ids))


# ---------------------------------------------------------------- Hugging Face format (jaxpar.hf)


def qwen3_moe_from_hf(hf: dict) -> Qwen3MoeConfig:
    """Qwen3's fields (qwen3_from_hf) with the experts, their routing and the dense layers."""
    k, renormalize = value(hf, "num_experts_per_tok"), bool(hf.get("norm_topk_prob", False))
    if k == 1 and renormalize:
        raise ConfigError("config.json has num_experts_per_tok=1 with norm_topk_prob=true: a single renormalised gate "
                          "is 1 (the router gets no gradient), where jaxpar keeps the router's probability")
    dense = qwen3_dense_layers(hf)
    aux = float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0
    return qwen3_from_hf(Qwen3MoeConfig, hf, num_layers=value(hf, "num_hidden_layers") - len(dense),
                         mlp_only_layers=",".join(map(str, dense)), dense_mlp=value(hf, "intermediate_size"),
                         mlp=value(hf, "moe_intermediate_size"), top_k=k,
                         num_experts=hf.get("num_experts") or value(hf, "num_local_experts"),  # transformers 4, 5
                         routing="dropless", renormalize=renormalize, shared_experts=0, aux_loss_weight=aux,
                         z_loss_weight=0.0, bias_update_rate=0.0)


def qwen3_moe_to_hf(cfg: Qwen3MoeConfig) -> dict:
    """Qwen3's keys (qwen3_to_hf) with the experts' and the dense layers'."""
    if cfg.shared_experts:
        raise ConfigError(f"model.shared_experts={cfg.shared_experts}: Qwen3-MoE's format has no shared experts")
    refuse_parts(cfg, "Qwen3MoeForCausalLM", router_scores="softmax", expert_groups=1, top_groups=1,
                 routed_scaling=1.0)
    hf = qwen3_to_hf(cfg, "Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3-MoE")
    dense = cfg.dense_layer_ids()
    return {**hf, "num_hidden_layers": cfg.num_layers + len(dense), "intermediate_size": cfg.dense_mlp,
            "moe_intermediate_size": cfg.mlp, "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
            "norm_topk_prob": cfg.renormalize, "decoder_sparse_step": 1, "mlp_only_layers": list(dense),
            "router_aux_loss_coef": cfg.aux_loss_weight, "output_router_logits": cfg.aux_loss_weight > 0}


def qwen3_moe_hf_weights(cfg: Qwen3MoeConfig) -> dict[str, Weight]:
    """The MoE layers' and the dense layers' (Qwen3's) tensors at their places in the whole model."""
    mlp = "model.layers.{layer}.mlp."
    ids = stack_layer_ids(cfg)
    weights = experts_hf_weights(cfg, "Qwen3-MoE", mlp + "gate.weight", mlp + "experts.{expert}.",
                                 ("gate_proj", "up_proj", "down_proj"))
    weights = {path: _at(w, ids["layers"]) if path.startswith("layers.") else w for path, w in weights.items()}
    if ids["dense"]:
        dense = QWEN3_FORMAT.weights(dataclasses.replace(cfg, mlp=cfg.dense_mlp))
        weights.update({"dense" + path[len("layers"):]: _at(w, ids["dense"])
                        for path, w in dense.items() if path.startswith("layers.")})
    return weights


def _at(weight: Weight, ids: tuple[int, ...]) -> Weight:
    return dataclasses.replace(weight, layer_ids=ids)


def qwen3_dense_layers(hf: dict) -> tuple[int, ...]:
    """The layers config.json leaves dense, as transformers' Qwen3-MoE decides: those in
    mlp_only_layers, and with decoder_sparse_step k every layer i but where (i + 1) % k == 0."""
    total, step = value(hf, "num_hidden_layers"), hf.get("decoder_sparse_step", 1)
    step = 1 if step is None else step
    listed = hf.get("mlp_only_layers") or []
    if not (isinstance(step, int) and step >= 1) or not all(isinstance(i, int) and 0 <= i < total for i in listed):
        raise ConfigError(f"config.json has decoder_sparse_step={step} and mlp_only_layers={listed}; Qwen3-MoE takes "
                          f"a positive step and layer indices below num_hidden_layers={total}")
    dense = tuple(i for i in range(total) if i in listed or (i + 1) % step)
    if len(dense) == total:
        raise ConfigError(f"config.json has decoder_sparse_step={step} and mlp_only_layers={listed} with "
                          f"num_hidden_layers={total}: no layer has experts; read it as a dense Qwen3 instead")
    return dense


# Qwen3's format (its tied head ignored) with experts, and the routing choices free to differ
QWEN3_MOE_FORMAT = dataclasses.replace(QWEN3_FORMAT, architectures=("Qwen3MoeForCausalLM",),
                                       from_hf=qwen3_moe_from_hf, to_hf=qwen3_moe_to_hf, weights=qwen3_moe_hf_weights,
                                       training_fields=MOE_TRAINING_FIELDS)

register(Family("qwen3-moe", Qwen3MoeConfig, hf=QWEN3_MOE_FORMAT, presets={
    # config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B: 128 experts, top 8, every
    # layer MoE (intermediate_size, the dense MLP's width, unused). Capacity routing, as the
    # other MoE presets: its compiled FLOPs are those a GPU runs.
    "qwen3-30b-a3b": Qwen3MoeConfig(vocab_size=151936, embed=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                                    head_dim=128, mlp=768, num_experts=128, top_k=8, renormalize=True,
                                    routing="capacity", dense_mlp=6144),
    "qwen3-235b-a22b": Qwen3MoeConfig(vocab_size=151936, embed=4096, num_layers=94, num_heads=64, num_kv_heads=4,
                                      head_dim=128, mlp=1536, num_experts=128, top_k=8, renormalize=True,
                                      routing="capacity", dense_mlp=12288),
}))
