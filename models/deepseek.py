"""DeepSeek-V3's decoder (arXiv 2412.19437), in progress (issue 36): multi-head latent
attention (MLA) over models.moe's experts with DeepSeekMoE routing (sigmoid scores,
group-limited choice, scaled gates, a shared expert, bias balancing).

MLA, per layer (H heads; each head's query and key: a "nope" part and a RoPE part):

  q        x [D] -> (q_lora_rank > 0: wq_a [D, Cq] -> RMSNorm ->) wq(_b) [., H, nope + rope]
  latent   x [D] -> wkv_a [D, C + rope]: the latent c [C] -> RMSNorm, and one key RoPE part
           [rope] that every head shares
  k, v     c -> wkv_b [C, H, nope + v]: each head's key "nope" part and its value [v]
  out      attention over keys [nope + rope] and values [v] -> wo [H, v, D]

Sharding: the heads split over mesh.tensor (wq / wq_b and wkv_b column-parallel, wo
row-parallel); the latents' projections (wq_a, wkv_a) are replicated over tensor, so each
tensor rank computes the whole latent (D x (Cq + C + rope) multiply-adds a token, repeated
on every rank; no collective), and the shared RoPE key is broadcast to its heads after the
latent. Under FSDP the latent dimensions shard as `embed` does (axis_names).

RoPE on the RoPE parts: plain, or YaRN (Peng et al. 2023, arXiv 2309.00071) as Hugging Face
computes it for DeepSeek-V3's rope_scaling (`yarn`): frequencies interpolated by the factor
where their wavelength is long, kept where short, blended between; cos and sin scaled by
mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim); the softmax scale
multiplied by mscale(factor, yarn_mscale_all_dim)^2 (applied to the queries).

The first `dense_layers` layers (first_k_dense_replace) have a dense MLP of width
`dense_mlp` instead of experts; `num_layers` counts the MoE layers after them. They are
models.moe's second stack (`dense_layer_ids`), run by `embed`, so a pipeline runs them on its
first stage, and every stage holds them (the pipeline contract: everything outside
`layers`); their stacked axis is kept whole ("dense_layers").

Hugging Face's DeepseekV3ForCausalLM in and out (DEEPSEEK_FORMAT: deepseek_from_hf,
deepseek_to_hf, deepseek_hf_weights): its dense layers are model.layers.0 .. dense_layers - 1, its
interleaved RoPE pairs (rope_interleave) are laid out as halves in the attention, and its
routing bias (e_score_correction_bias) is ours (model.router_bias), exported in float32 whatever
the export's dtype (as published: rounded, it would choose other experts).

Multi-token prediction (model.mtp_layers=1, weight model.mtp_weight): MultiTokenPrediction
predicts token t + 2 from the main model's normalised output and the embedding of token
t + 1, through one more MoE layer and the model's head; its cross-entropy joins each token's
loss (the trainer weighs it as the main loss at t). Hugging Face's checkpoints hold it as
model.layers.{dense + MoE layers} (enorm, hnorm, eh_proj, shared_head.norm and a decoder
layer; transformers neither reads nor writes it); a checkpoint without it leaves it at its
initialisation. The published checkpoint also holds the layer's copies of the embedding and
head (embed_tokens, shared_head.head), which vLLM's loader reads: the export writes them
(Weight.copies), an import accepts them unread (the module shares the model's). Under a pipeline it runs on the last stage (output_report), which holds the
embedding and head as every stage does.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.choices import RouterScores
from jaxpar.errors import ConfigError
from jaxpar.families import Family, register
from jaxpar.hf.config import refuse_unless, rope_settings, value
from jaxpar.hf.format import HFFormat
from jaxpar.hf.weights import Weight
from jaxpar.kernels.attention.logits import clip_factors
from jaxpar.models.llama import RESIDUAL, RMSNorm, refuse_parts, refuse_scaled_tied_head, rope_frequencies, rotate
from jaxpar.models.moe import MOE_TRAINING_FIELDS, MoEBlock, MoEConfig, MoETransformer, stack_layer_ids
from jaxpar.nn import param
from jaxpar.sharding import (ahead, attend, column_project, compute_value, constrain, largest_logits, reports_logits,
                             row_project)

Q_NAMES = ("batch", "seq", "heads", "head_dim")
LATENT_NAMES = ("batch", "seq", "kv_latent")
Q_LATENT_NAMES = ("batch", "seq", "q_latent")


@dataclasses.dataclass(frozen=True)
class DeepSeekConfig(MoEConfig):
    """models.moe's MoE decoder with multi-head latent attention; `num_kv_heads` is
    `num_heads` (every head has its own key and value, made from the shared latent);
    `head_dim`, which the model does not read, is qk_nope_head_dim + qk_rope_head_dim in the
    preset and in imports (the query and key head size kernels' checks read)."""

    q_lora_rank: int = 0  # 0: queries straight from the residual; else through a latent this wide
    kv_lora_rank: int = 32  # the keys' and values' shared latent width
    qk_nope_head_dim: int = 16  # each head's query and key part without RoPE
    qk_rope_head_dim: int = 8  # the RoPE part: each head's query's own, the key's shared by all heads
    v_head_dim: int = 16  # each head's value width
    num_kv_heads: int = 4  # must equal num_heads under MLA
    router_scores: RouterScores = "sigmoid"  # the router's probabilities: each expert's sigmoid
    shared_experts: int = 1  # experts every token also goes through, beside the routed ones
    dense_layers: int = 0  # dense layers before the MoE ones (first_k_dense_replace); num_layers counts the MoE ones
    dense_mlp: int = 64  # the dense layers' MLP width (intermediate_size; mlp is each expert's)
    # YaRN RoPE scaling (Hugging Face's rope_scaling of type "yarn"): the long wavelengths
    # slowed by this factor (its `factor`); 1: plain RoPE.
    yarn_factor: float = 1.0
    yarn_original_max_positions: int = 4096  # YaRN: the context the model was trained on (original_max_position_embeddings)
    yarn_beta_fast: float = 32.0  # YaRN: pairs turning this often or more over that context keep their frequency (beta_fast)
    yarn_beta_slow: float = 1.0  # YaRN: pairs turning this often or less are slowed by the factor (beta_slow)
    yarn_mscale: float = 1.0  # YaRN: cos and sin scaled by mscale(factor, this) / mscale(factor, yarn_mscale_all_dim)
    yarn_mscale_all_dim: float = 0.0  # YaRN: the softmax scale times mscale(factor, this)^2 (mscale_all_dim)
    # The RoPE parts' dimensions in interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek's own
    # checkpoints lay them out (Hugging Face's rope_interleave); false: halves, as Llama's.
    rope_interleave: bool = False
    router_bias: bool = True  # DeepSeek-V3's routing bias (e_score_correction_bias), moved only by bias balancing
    mtp_layers: int = 0  # multi-token prediction depth (num_nextn_predict_layers): 0, or 1 as DeepSeek-V3
    mtp_weight: float = 0.3  # the prediction of token t + 2's loss weight (DeepSeek-V3: 0.3, later 0.1)

    # latents shard (FSDP) as the width does; the dense layers' stack stays whole (no pipeline splits it)
    axis_names = {**MoEConfig.axis_names, "kv_latent": "embed", "q_latent": "embed", "mtp_in": None}
    WEIGHTS = MoEConfig.WEIGHTS + ("mtp_weight",)
    mesh_divides = {**MoEConfig.mesh_divides, "fsdp": ("embed", "kv_lora_rank", "q_lora_rank")}  # latents shard as embed
    def check(self, sizes: dict[str, int]) -> None:
        super().check(sizes)
        for field in ("qk_norm", "qkv_bias"):  # Llama's, which latent attention has no place for
            if getattr(self, field):
                raise ConfigError(f"model.{field}=True: latent attention has no q/k norms or q/k/v biases (its "
                                  f"latents have norms of their own); set model.{field}=false")
        if self.num_kv_heads != self.num_heads:
            raise ConfigError(f"model.num_kv_heads={self.num_kv_heads}: under latent attention every head has its own "
                              f"key and value; set model.num_kv_heads={self.num_heads} (model.num_heads)")
        for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, field) < 1:
                raise ConfigError(f"model.{field}={getattr(self, field)} must be a positive integer")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE; use "
                              f"{self.qk_rope_head_dim + 1}")
        if not (1 <= self.yarn_factor < float("inf") and self.yarn_original_max_positions > 0
                and self.yarn_beta_fast >= self.yarn_beta_slow > 0):
            raise ConfigError(f"model.yarn_factor={self.yarn_factor} (at least 1; 1: no YaRN), "
                              f"model.yarn_original_max_positions={self.yarn_original_max_positions} (positive) and "
                              f"model.yarn_beta_fast={self.yarn_beta_fast} >= model.yarn_beta_slow={self.yarn_beta_slow} > 0 "
                              "are YaRN's; DeepSeek-V3 uses 40, 4096, 32 and 1")
        if self.rope_scaling_factor != 1:  # rope_frequencies would apply it under YaRN's ramp
            raise ConfigError(f"model.rope_scaling_factor={self.rope_scaling_factor} is Llama 3.1's RoPE scaling; "
                              "DeepSeek scales RoPE with YaRN: set model.yarn_factor and keep model.rope_scaling_factor=1")
        if self.dense_layers < 0 or self.dense_mlp < 1:
            raise ConfigError(f"model.dense_layers={self.dense_layers} must be 0 or more and model.dense_mlp="
                              f"{self.dense_mlp} positive")
        if self.q_lora_rank < 0:
            raise ConfigError(f"model.q_lora_rank={self.q_lora_rank} must be 0 (no query latent) or positive")
        if self.mtp_layers not in (0, 1):
            raise ConfigError(f"model.mtp_layers={self.mtp_layers}: jaxpar's DeepSeek predicts one token ahead at most "
                              "(DeepSeek-V3's depth); use model.mtp_layers=1, or 0 for none")

    def build(self, rngs: nnx.Rngs) -> "DeepSeek":
        return DeepSeek(self, rngs=rngs)

    def attention_module(self, rngs: nnx.Rngs) -> nnx.Module:
        return LatentAttention(self, rngs=rngs)

    def dense_layer_ids(self) -> tuple[int, ...]:
        """The first dense_layers layers (models.moe runs them with the embedding)."""
        return tuple(range(self.dense_layers))

    def mtp_param_count(self, active: bool = False) -> int:
        """The prediction module: an MoE layer, the projection [2D, D] and three norms (the
        embedding and head are the model's)."""
        d = self.embed
        return self.mtp_layers * (self.moe_layer_param_count(active) + 2 * d * d + 3 * d)

    def param_count(self, include_embedding: bool = True, active: bool = False) -> int:
        return super().param_count(include_embedding, active) + self.mtp_param_count(active)

    def attention_param_count(self) -> int:
        d, h, c, cq = self.embed, self.num_heads, self.kv_lora_rank, self.q_lora_rank
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        queries = (d * cq + cq + cq * h * qk) if cq else d * h * qk
        latent = d * (c + self.qk_rope_head_dim) + c + c * h * (self.qk_nope_head_dim + self.v_head_dim)
        return queries + latent + h * self.v_head_dim * d

    def scale_attention(self, attn: dict, logit_max: jax.Array, threshold: float) -> dict:
        """QK-clip on latent attention (Kimi K2's MuonClip): for head h, gamma = min(1,
        threshold / its largest logit); its query and key "nope" parts each by sqrt(gamma),
        its query RoPE part by gamma, the key RoPE part every head shares untouched, so that
        the head's logits scale by gamma."""
        root = clip_factors(logit_max, threshold, logit_max.shape[-1])[0][..., None]  # sqrt(gamma) [L, H, 1]
        gamma = root * root
        nope, rope_dim, v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q_cols = jnp.concatenate([jnp.broadcast_to(root, (*gamma.shape[:2], nope)),
                                  jnp.broadcast_to(gamma, (*gamma.shape[:2], rope_dim))], axis=-1)
        kv_cols = jnp.concatenate([jnp.broadcast_to(root, (*gamma.shape[:2], nope)),
                                   jnp.ones((*gamma.shape[:2], v), gamma.dtype)], axis=-1)
        q = "wq_b" if self.q_lora_rank else "wq"
        return {**attn, q: attn[q] * q_cols[:, None], "wkv_b": attn["wkv_b"] * kv_cols[:, None]}

    def flops_per_token(self, seq_len: int) -> float:
        """models.moe's count (its matmuls include the prediction module's, by param_count,
        and its attention the dense layers') with the module's attention and head added."""
        extra_head = self.mtp_layers * self.vocab_size * self.embed  # the prediction module's pass through the head
        return super().flops_per_token(seq_len) + 6 * extra_head + self.mtp_layers * self.attention_flops(seq_len)

    def attention_flops(self, seq_len: int) -> float:
        """Scores over query/key heads of nope + rope, values of v (Llama's, with its two head sizes)."""
        return 6 * self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim) * seq_len


class DeepSeek(MoETransformer):
    """models.moe's decoder with `dense_layers` dense layers first (the module docstring)."""

    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)  # the dense first layers: models.moe's second stack
        if cfg.mtp_layers:
            self.mtp = MultiTokenPrediction(cfg, rngs=rngs)

    def __call__(self, tokens_BS, positions=None, segment_ids=None):
        table = compute_value(self.embedding)
        x, reports = self.trunk(table, tokens_BS, positions, segment_ids)
        aux = self.balance(reports)
        if self.cfg.mtp_layers:  # beside the next token's loss, the one after's, weighted
            loss = self.next_but_one_loss(x, table, tokens_BS, positions, segment_ids)
            aux["penalty"] = aux["penalty"] + self.cfg.mtp_weight * loss
            aux["token_metrics"]["mtp_loss"] = loss
        return self.logits(x, table), aux

    def apply_layers(self, x: jax.Array, batch: dict) -> tuple[jax.Array, dict]:
        x, report = super().apply_layers(x, batch)
        if self.cfg.mtp_layers:  # the last stage's output_report adds it; every stage reports the name
            report["sums"]["token_metrics"]["mtp_loss"] = jnp.zeros((), jnp.float32)
        return x, report

    def output_report(self, x_BSD: jax.Array, batch: dict) -> dict | None:
        """The pipeline's last stage: the prediction module's loss under the batch's weights
        (jaxpar.model.PipelineStages), as __call__ adds it to each token's."""
        if not self.cfg.mtp_layers:
            return None
        loss = self.next_but_one_loss(x_BSD, compute_value(self.embedding), batch["inputs"], batch.get("positions"),
                                      batch.get("segment_ids"))
        weighted = jnp.sum(loss * batch["weights"].astype(jnp.float32))
        return {"loss": self.cfg.mtp_weight * weighted,
                "sums": {"token_metrics": {"mtp_loss": jax.lax.stop_gradient(weighted)}}}

    def next_but_one_loss(self, x_BSD, table, tokens_BS, positions, segment_ids) -> jax.Array:
        """[B, S]: the prediction module's cross-entropy for token t + 2 at each position t,
        0 where t + 2 is past the sequence or in another packed document."""
        following, _ = ahead(tokens_BS, 1)  # t + 1 (in the sequence's own order, whatever the layout's)
        targets, inside = ahead(tokens_BS, 2)
        valid = jnp.broadcast_to(inside, tokens_BS.shape)
        if segment_ids is not None:  # documents are contiguous: t and t + 2 in one holds t + 1 too
            valid = valid & (ahead(segment_ids, 2)[0] == segment_ids)
        positions = jnp.arange(tokens_BS.shape[1]) if positions is None else positions
        h = self.mtp(self.final_norm(x_BSD), self.lookup(table, following), positions, segment_ids)
        logits = self.project(h, table).astype(jnp.float32)
        target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32), axis=-1)
        return jnp.where(valid, jax.nn.logsumexp(logits, axis=-1) - target_logit, 0.0)


class MultiTokenPrediction(nnx.Module):
    """DeepSeek-V3's prediction module (one depth): the main model's output h_t (after the
    final norm) and the embedding of token t + 1, each normalised, concatenated [embedding,
    h] and projected back to the width, then one MoE layer and a norm of its own; the
    model's head makes the logits for token t + 2."""

    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        d = cfg.embed
        self.enorm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.hnorm = RMSNorm(d, cfg.norm_eps, rngs=rngs)
        self.eh_proj = param(rngs, (2 * d, d), ("mtp_in", "embed"), 2 * d)
        self.block = MoEBlock(cfg, rngs=rngs)
        self.norm = RMSNorm(d, cfg.norm_eps, rngs=rngs)

    def __call__(self, h_BSD, following_BSD, positions, segment_ids) -> jax.Array:
        both = jnp.concatenate([self.enorm(following_BSD), self.hnorm(h_BSD)], axis=-1)
        weight = compute_value(self.eh_proj)
        x = constrain(jnp.einsum("bsk,kd->bsd", both.astype(weight.dtype), weight), RESIDUAL)
        x, _ = self.block(x, positions, segment_ids)  # its experts' balancing terms are not added
        return self.norm(x)


class LatentAttention(nnx.Module):
    """Multi-head latent attention (the module docstring), causal."""

    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        d, h, c, cq = cfg.embed, cfg.num_heads, cfg.kv_lora_rank, cfg.q_lora_rank
        nope, rope_dim, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cq:
            self.wq_a = param(rngs, (d, cq), ("embed", "q_latent"), d)
            self.q_norm = RMSNorm(cq, cfg.norm_eps, rngs=rngs, name="q_latent")
            self.wq_b = param(rngs, (cq, h, nope + rope_dim), ("q_latent", "heads", "head_dim"), cq)
        else:
            self.wq = param(rngs, (d, h, nope + rope_dim), ("embed", "heads", "head_dim"), d)
        self.wkv_a = param(rngs, (d, c + rope_dim), ("embed", "kv_latent"), d)
        self.kv_norm = RMSNorm(c, cfg.norm_eps, rngs=rngs, name="kv_latent")
        self.wkv_b = param(rngs, (c, h, nope + v), ("kv_latent", "heads", "head_dim"), c)
        self.wo = param(rngs, (h, v, d), ("heads", "head_dim", "embed"), h * v)
        self.cfg = cfg

    def __call__(self, x_BSD: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        cfg = self.cfg
        nope, rope_dim, c = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            (q_latent,) = column_project(x_BSD, [self.wq_a], [Q_LATENT_NAMES])
            q = _heads(self.q_norm(q_latent), self.wq_b)
        else:
            (q,) = column_project(x_BSD, [self.wq], [Q_NAMES])
        (kv_a,) = column_project(x_BSD, [self.wkv_a], [LATENT_NAMES])
        latent, k_rope = kv_a[..., :c], kv_a[..., c:]
        k_nope, v = jnp.split(_heads(self.kv_norm(latent), self.wkv_b), [nope], axis=-1)
        freq, scale = yarn_frequencies(rope_dim, cfg)
        q_rope = _pairs_to_halves(q[..., nope:]) if cfg.rope_interleave else q[..., nope:]
        k_rope = _pairs_to_halves(k_rope) if cfg.rope_interleave else k_rope
        q = jnp.concatenate([q[..., :nope], rotate(q_rope, positions, freq, scale)], axis=-1)
        q = q * yarn_softmax_factor(cfg)  # the softmax scale, through the queries (1 without YaRN)
        k_rope = jnp.broadcast_to(rotate(k_rope[:, :, None, :], positions, freq, scale), (*k_nope.shape[:-1], rope_dim))
        k = constrain(jnp.concatenate([k_nope, k_rope], axis=-1), Q_NAMES)
        q, k, v = (checkpoint_name(constrain(t, Q_NAMES), "qkv") for t in (q, k, v))
        o = checkpoint_name(attend(q, k, v, segment_ids, window=cfg.sliding_window), "attention_out")
        out = row_project(constrain(o, Q_NAMES), self.wo, Q_NAMES)
        if not reports_logits():
            return out
        return out, largest_logits(q, k, positions, segment_ids, window=cfg.sliding_window)  # QK-clip


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature term, 0.1 mscale ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(dim: int, cfg: DeepSeekConfig) -> tuple[jax.Array, float]:
    """(RoPE's angular frequencies [dim / 2], the cos/sin scale) for the RoPE parts: theta^(-2i/dim),
    with YaRN when cfg.yarn_factor > 1 (the module docstring). Dimension pairs that turn
    beta_fast times or more over the original context keep their frequency, those turning
    beta_slow times or fewer are slowed by the factor, and a linear ramp blends between."""
    freq = rope_frequencies(dim, cfg)
    factor = cfg.yarn_factor
    if factor == 1:
        return freq, 1.0

    def dim_turning(turns: float) -> float:  # the dimension whose pair turns `turns` times over the context
        return dim * math.log(cfg.yarn_original_max_positions / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low = max(math.floor(dim_turning(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(dim_turning(cfg.yarn_beta_slow)), dim - 1)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / ((high - low) or 0.001), 0, 1)
    freq = freq / factor * ramp + freq * (1 - ramp)
    scale = yarn_mscale(factor, cfg.yarn_mscale) / yarn_mscale(factor, cfg.yarn_mscale_all_dim) if (
        cfg.yarn_mscale and cfg.yarn_mscale_all_dim) else yarn_mscale(factor, 1.0)
    return freq, scale


def yarn_softmax_factor(cfg: DeepSeekConfig) -> float:
    """The softmax scale's YaRN factor, mscale(factor, mscale_all_dim)^2 (1 without it)."""
    m = yarn_mscale(cfg.yarn_factor, cfg.yarn_mscale_all_dim) if cfg.yarn_mscale_all_dim else 1.0
    return m * m


def _pairs_to_halves(x: jax.Array) -> jax.Array:
    """Interleaved RoPE pairs (x0, x1), (x2, x3), ... laid out as halves (x0, x2, ..., x1, x3, ...),
    the layout `rotate` turns: the same rotation, the features permuted (alike in queries and
    keys, so their dot products do not change)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _heads(latent_BSC: jax.Array, w: nnx.Variable) -> jax.Array:
    """A latent [B, S, C] (whole on every tensor rank) through w [C, H, K] into heads laid
    out as Q_NAMES: each tensor rank multiplies by its own heads' columns."""
    weight = compute_value(w)
    return constrain(jnp.einsum("bsc,chk->bshk", latent_BSC.astype(weight.dtype), weight), Q_NAMES)


# ---------------------------------------------------------------- Hugging Face format (jaxpar.hf)


def deepseek_from_hf(cls, hf: dict) -> DeepSeekConfig:
    """DeepseekV3ForCausalLM's config.json (transformers 4's remote-code spelling or 5's):
    dropless routing over sigmoid scores with the checkpoint's correction bias; the dense
    first layers; YaRN from rope_scaling / rope_parameters. Its multi-token prediction layers
    are left unread (deepseek_ignored)."""
    if hf.get("quantization_config"):
        raise ConfigError(f"config.json has quantization_config={hf['quantization_config']}: the checkpoint's weights "
                          "are quantized (DeepSeek-V3's release is FP8 in 128 x 128 blocks); jaxpar reads float weights: "
                          "convert them to bf16 first (DeepSeek-V3's inference/fp8_cast_bf16.py) and drop "
                          "quantization_config from config.json")
    refuse_unless(hf, attention_bias=False, scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
                  hidden_act="silu")
    heads, total, dense = value(hf, "num_attention_heads"), value(hf, "num_hidden_layers"), value(hf, "first_k_dense_replace")
    if hf.get("num_key_value_heads", heads) != heads:
        raise ConfigError(f"config.json has num_key_value_heads={hf['num_key_value_heads']} with "
                          f"num_attention_heads={heads}; latent attention gives every head its own key and value")
    k, renormalize = value(hf, "num_experts_per_tok"), bool(hf.get("norm_topk_prob", True))
    if k == 1 and renormalize:
        raise ConfigError("config.json has num_experts_per_tok=1 with norm_topk_prob=true (every gate 1); jaxpar keeps "
                          "a single gate's probability, so it imports DeepSeek-V3 models of top-k >= 2 or unnormalised gates")
    nope, rope_dim = value(hf, "qk_nope_head_dim"), value(hf, "qk_rope_head_dim")
    tied = bool(hf.get("tie_word_embeddings", False))
    return cls(
        vocab_size=value(hf, "vocab_size"), embed=value(hf, "hidden_size"), num_layers=total - dense, dense_layers=dense,
        dense_mlp=value(hf, "intermediate_size"), mlp=value(hf, "moe_intermediate_size"), num_heads=heads,
        num_kv_heads=heads, head_dim=nope + rope_dim, q_lora_rank=hf.get("q_lora_rank") or 0,
        kv_lora_rank=value(hf, "kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
        v_head_dim=value(hf, "v_head_dim"), num_experts=hf.get("n_routed_experts") or value(hf, "num_local_experts"),
        top_k=k, shared_experts=hf.get("n_shared_experts") or 0, expert_groups=hf.get("n_group") or 1,
        top_groups=hf.get("topk_group") or 1, routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
        mtp_layers=hf.get("num_nextn_predict_layers") or 0,
        renormalize=renormalize, router_scores="sigmoid", router_bias=True, routing="dropless", aux_loss_weight=0.0,
        z_loss_weight=0.0, bias_update_rate=0.0, norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=tied,
        scale_tied_logits=not tied, rope_interleave=bool(hf.get("rope_interleave", True)), **_yarn_from_hf(hf))


def _yarn_from_hf(hf: dict) -> dict:
    rope = rope_settings(hf)
    fields = {"rope_theta": float(rope["rope_theta"])}
    if rope["rope_type"] == "default":
        return fields
    if rope["rope_type"] != "yarn" or rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        raise ConfigError(f"config.json has RoPE scaling {rope}; jaxpar's DeepSeek computes none or YaRN (truncated "
                          "correction range, attention factor from mscale and mscale_all_dim)")
    return {**fields, "yarn_factor": float(value(rope, "factor")),
            "yarn_original_max_positions": int(value(rope, "original_max_position_embeddings")),
            "yarn_beta_fast": float(rope.get("beta_fast") or 32), "yarn_beta_slow": float(rope.get("beta_slow") or 1),
            # absent is falsy in transformers' formula (the attention factor then ignores mscale_all_dim)
            "yarn_mscale": float(rope.get("mscale") or 0.0), "yarn_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0)}


def deepseek_to_hf(cfg: DeepSeekConfig) -> dict:
    refuse_parts(cfg, "DeepseekV3ForCausalLM", qk_norm=False, qkv_bias=False, router_scores="sigmoid", activation="silu",
                 sliding_window=0)
    refuse_scaled_tied_head(cfg, "DeepSeek-V3")
    hf = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed, "intermediate_size": cfg.dense_mlp, "moe_intermediate_size": cfg.mlp,
        "num_hidden_layers": cfg.dense_layers + cfg.num_layers, "first_k_dense_replace": cfg.dense_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads,
        "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k, "n_shared_experts": cfg.shared_experts,
        "n_group": cfg.expert_groups, "topk_group": cfg.top_groups, "routed_scaling_factor": cfg.routed_scaling,
        "norm_topk_prob": cfg.renormalize, "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "hidden_act": cfg.activation, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_interleave": cfg.rope_interleave, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "num_nextn_predict_layers": cfg.mtp_layers,
    }
    if cfg.yarn_factor != 1:
        hf["max_position_embeddings"] = int(cfg.yarn_original_max_positions * cfg.yarn_factor)
        hf["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", "factor": cfg.yarn_factor,
                              "original_max_position_embeddings": cfg.yarn_original_max_positions,
                              "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
                              "mscale": cfg.yarn_mscale, "mscale_all_dim": cfg.yarn_mscale_all_dim}
    return hf


def deepseek_hf_weights(cfg: DeepSeekConfig) -> dict[str, Weight]:
    """The dense layers are Hugging Face's model.layers.0 .. dense_layers - 1, ours `dense`; the
    MoE layers follow (`layers`, whose {layer} 0 is Hugging Face's dense_layers). Linear
    weights are [out, in]; fused head dimensions split."""
    if not cfg.has_router_bias:
        raise ConfigError("model.router_bias=false: DeepSeek-V3's format holds each layer's routing bias "
                          "(e_score_correction_bias); set model.router_bias=true")
    # the prediction layer's copies of the embedding and head (written, accepted unread: it shares them)
    mtp = f"model.layers.{cfg.dense_layers + cfg.num_layers}."
    embedding, head = ((mtp + "embed_tokens.weight",), (mtp + "shared_head.head.weight",)) if cfg.mtp_layers else ((), ())
    weights = {"embedding": Weight("model.embed_tokens.weight", copies=embedding + (head if cfg.tie_embeddings else ())),
               "final_norm.scale": Weight("model.norm.weight")}
    if not cfg.tie_embeddings:
        weights["head"] = Weight("lm_head.weight", order=(1, 0), copies=head)
    for stack, ids in stack_layer_ids(cfg).items():
        weights.update({f"{stack}.{ours}": dataclasses.replace(w, layer_ids=ids)
                        for ours, w in _layer_weights(cfg, stack == "dense").items()} if ids else {})
    if cfg.mtp_layers:  # model.layers.{dense + MoE layers}; transformers neither reads nor writes it
        weights.update(_mtp_weights(cfg, cfg.dense_layers + cfg.num_layers))
    return weights


def deepseek_ignored(cfg: DeepSeekConfig) -> tuple[str, ...]:
    """The prediction layer after the main stack, without model.mtp_layers (with it, its
    copies of the embedding and head are the Weights' `copies`)."""
    return () if cfg.mtp_layers else (f"model.layers.{cfg.dense_layers + cfg.num_layers}.",)


def _mtp_weights(cfg: DeepSeekConfig, index: int) -> dict[str, Weight]:
    """The prediction layer's own tensors (its embedding and head are the model's), each
    left to its initialisation where a checkpoint lacks the layer (`fresh`)."""
    at = f"model.layers.{index}."
    own = {"mtp.enorm.scale": Weight(at + "enorm.weight"), "mtp.hnorm.scale": Weight(at + "hnorm.weight"),
           "mtp.eh_proj": Weight(at + "eh_proj.weight", order=(1, 0)),
           "mtp.norm.scale": Weight(at + "shared_head.norm.weight")}
    own.update({f"mtp.block.{ours}": dataclasses.replace(w, name=w.name.replace("{layer}", str(index)))
                for ours, w in _layer_weights(cfg, dense=False).items()})
    return {path: dataclasses.replace(w, fresh=True) for path, w in own.items()}


def _layer_weights(cfg: DeepSeekConfig, dense: bool) -> dict[str, Weight]:
    d, h, c, cq = cfg.embed, cfg.num_heads, cfg.kv_lora_rank, cfg.q_lora_rank
    qk, kv, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
    at, mlp = "model.layers.{layer}.self_attn.", "model.layers.{layer}.mlp."
    weights = {
        "attn_norm.scale": Weight("model.layers.{layer}.input_layernorm.weight"),
        "mlp_norm.scale": Weight("model.layers.{layer}.post_attention_layernorm.weight"),
        "attn.wkv_a": Weight(at + "kv_a_proj_with_mqa.weight", order=(1, 0)),
        "attn.kv_norm.scale": Weight(at + "kv_a_layernorm.weight"),
        "attn.wkv_b": Weight(at + "kv_b_proj.weight", (h, kv, c), (2, 0, 1), (h * kv, c)),
        "attn.wo": Weight(at + "o_proj.weight", (d, h, v), (1, 2, 0), (d, h * v)),
    }
    if cq:
        weights.update({"attn.wq_a": Weight(at + "q_a_proj.weight", order=(1, 0)),
                        "attn.q_norm.scale": Weight(at + "q_a_layernorm.weight"),
                        "attn.wq_b": Weight(at + "q_b_proj.weight", (h, qk, cq), (2, 0, 1), (h * qk, cq))})
    else:
        weights["attn.wq"] = Weight(at + "q_proj.weight", (h, qk, d), (2, 0, 1), (h * qk, d))
    projections = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
    if dense:
        return {**weights, **{f"mlp.{ours}": Weight(mlp + f"{theirs}.weight", order=(1, 0))
                              for ours, theirs in projections.items()}}
    weights.update({"moe.router": Weight(mlp + "gate.weight", order=(1, 0)),
                    # float32 in any export, as published: rounded, it would choose other experts
                    "moe.router_bias": Weight(mlp + "gate.e_score_correction_bias", export_dtype="float32")})
    weights.update({f"moe.{ours}": Weight(mlp + "experts.{expert}." + f"{theirs}.weight", order=(1, 0))
                    for ours, theirs in projections.items()})
    if cfg.shared_experts:
        weights.update({f"shared.{ours}": Weight(mlp + f"shared_experts.{theirs}.weight", order=(1, 0))
                        for ours, theirs in projections.items()})
    return weights



DEEPSEEK_FORMAT = HFFormat(("DeepseekV3ForCausalLM",), from_hf=functools.partial(deepseek_from_hf, DeepSeekConfig),
                           to_hf=deepseek_to_hf, weights=deepseek_hf_weights, ignored=deepseek_ignored,
                           training_fields=MOE_TRAINING_FIELDS + ("mtp_layers", "mtp_weight"))

register(Family("deepseek", DeepSeekConfig, hf=DEEPSEEK_FORMAT, presets={
    # DeepSeek-V3 (arXiv 2412.19437, its config.json): 61 layers, the first 3 dense; 256 routed
    # experts of 2048 and one shared, 8 per token within 4 of 8 groups, gates x 2.5; MLA with
    # latents of 1536 (queries) and 512 (keys and values); YaRN x 40 over 4096 positions; bias
    # balancing at 0.001 and a sequence-wise balance loss at 1e-4. 671B parameters, 36.6B a token
    # as DeepSeek counts it (not the input embedding; docs/models/deepseek.md). Its multi-token
    # prediction module is off (model.mtp_layers=1: 11.6B more). Capacity routing, as Mixtral's
    # preset: DeepSeek drops nothing, but the dropless grouped matmul compiles densely on CPU
    # (every expert for every token: 4.6 TB a device and 218 s a step in `jaxpar plan`).
    "deepseek-v3": DeepSeekConfig(
        vocab_size=129280, embed=7168, num_layers=58, dense_layers=3, dense_mlp=18432, num_heads=128, num_kv_heads=128,
        head_dim=192,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=256, top_k=8, mlp=2048, shared_experts=1, expert_groups=8, top_groups=4, routed_scaling=2.5,
        routing="capacity", bias_update_rate=0.001, aux_loss_weight=0.0001, z_loss_weight=0.0, norm_eps=1e-6,
        yarn_factor=40.0, yarn_original_max_positions=4096, yarn_mscale=1.0, yarn_mscale_all_dim=1.0,
        rope_interleave=True),
    # Kimi K2 (Moonshot AI, 2025; its config.json): DeepSeek-V3's architecture with 384 routed
    # experts (8 per token, no group limit, gates x 2.827), 64 heads, one dense layer, a
    # 163,840-token vocabulary, RoPE theta 50,000 with YaRN x 32 (beta 1 and 1). 1.03T
    # parameters, 31.7B a token without the input embedding (Moonshot: 1T and 32B).
    "kimi-k2": DeepSeekConfig(
        vocab_size=163840, embed=7168, num_layers=60, dense_layers=1, dense_mlp=18432, num_heads=64, num_kv_heads=64,
        head_dim=192, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=384, top_k=8, mlp=2048, shared_experts=1, routed_scaling=2.827, routing="capacity",
        bias_update_rate=0.001, aux_loss_weight=0.0, z_loss_weight=0.0, norm_eps=1e-6, rope_theta=50000.0,
        yarn_factor=32.0, yarn_original_max_positions=4096, yarn_beta_fast=1.0, yarn_beta_slow=1.0, yarn_mscale=1.0,
        yarn_mscale_all_dim=1.0, rope_interleave=True),
}))
