"""Mixtral-style mixture-of-experts decoder in Flax NNX: the Llama blocks with the MLP
replaced by routed experts (and optional always-on shared experts, as in DeepSeek).

Each token's router picks its top-k experts (softmax over experts, then top-k, gates
optionally renormalised to sum to one when k > 1); the experts run through `jaxpar.sharding.run_experts`,
which dispatches over the expert-parallel mesh axes. No collective appears here.
Sharded shapes under the default rules (storage):
  router       [D@fsdp, E]              router_bias [E] per layer (bias balancing, or model.router_bias; not trained)
  w_gate, w_up [E@expert, D@fsdp, F@tensor]    w_down [E@expert, F@tensor, D@fsdp]
  shared experts: the Llama MLP of width shared_experts x mlp

Dense layers among the MoE ones (DeepSeek-V3's first ones, Qwen3-MoE's mlp_only_layers): a
family whose config lists them (`dense_layer_ids()`, by index in the whole model, which holds
num_layers MoE layers and these) gets a second stack, `dense` (Llama's block with a dense MLP
of the family's `dense_mlp`, its stacked axis "dense_layers" kept whole), and the model runs
the layers in their order as runs of one kind (`layer_runs`), each a scan over its slice of
its stack: no layer holds weights of the other kind. Dense layers before the first MoE one
run with the embedding (a pipeline's first stage, as every stage holds `dense`); a pipeline
splits only `layers`, so dense layers after the first MoE one are refused under stages.

Load balancing (each is averaged over the layers, where Megatron sums them: its weight is
this one / layers):
  aux_loss_weight   Switch loss, E x sum_e f_e P_e per sequence (f_e: share of the sequence's
                    choices routed to e; P_e: its mean router probability), arXiv 2101.03961;
                    per sequence like Megatron's seq_aux_loss, so no batch split changes it
  z_loss_weight     router z-loss, logsumexp(router logits)^2 per token, arXiv 2202.08906
  bias_update_rate  auxiliary-loss-free balancing (DeepSeek-V3, arXiv 2412.19437): a bias per
                    expert added to the scores that choose experts (not to the gates),
                    moved by this rate against each expert's load after every step
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.hf.config import value
from jaxpar.hf.weights import Weight
from jaxpar.models.llama import (ACTIVATIONS, HIDDEN, LLAMA_FORMAT, RESIDUAL, TRAINING_FIELDS, Block, Llama, LlamaConfig,
                                 RMSNorm, attention_weights, llama_from_hf, llama_to_hf, refuse_parts, with_logits)
from jaxpar.choices import RouterScores, Routing
from jaxpar.errors import ConfigError
from jaxpar.families import Family, register
from jaxpar.model import ATTENTION, EXPERTS, MAXIMA, PROJECTIONS, REMAT, SEQUENCE, STAGES
from jaxpar.nn import param, scan_layers, stack_layers
from jaxpar.sharding import compute_value, constrain, expert_matmul, run_experts, top_k_indices


@dataclasses.dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """`mlp` is each expert's hidden width (Mixtral's intermediate size)."""

    num_experts: int = 8  # routed experts in each layer's MoE block
    top_k: int = 2  # experts each token is sent to
    routing: Routing = "capacity"  # capacity (drop past capacity_factor) | dropless
    capacity_factor: float = 1.25  # capacity routing: each expert's slots as a multiple of its balanced share
    renormalize: bool = True  # gates of the k chosen experts sum to one (k > 1; top-1 keeps p)
    router_scores: RouterScores = "softmax"  # the router's probabilities: softmax over experts, or each's sigmoid (DeepSeek-V3)
    # Group-limited routing (DeepSeek-V3's n_group): the experts in this many equal groups, a
    # token choosing only within the model.top_groups groups whose two best scores sum highest; 1: off.
    expert_groups: int = 1
    top_groups: int = 1  # the groups a token chooses its experts within (DeepSeek-V3's topk_group); 1 of 1: off
    # Capacity routing with groups: each group also takes at most capacity_factor x S x
    # top_groups / expert_groups tokens a sequence, a token counted once per group it chose.
    # With the expert axis over hosts that hold whole groups, a token then crosses to a host
    # once per group: top_groups / top_k of the bytes (jaxpar.kernels.experts.two_hop).
    group_capacity: bool = False
    routed_scaling: float = 1.0  # the routed experts' gates multiplied by this (routed_scaling_factor)
    shared_experts: int = 0  # experts every token also goes through (DeepSeekMoE), beside the routed ones
    aux_loss_weight: float = 0.01  # the load-balancing loss's weight (Switch Transformer); 0: off
    z_loss_weight: float = 0.001  # the router z-loss's weight (ST-MoE); 0: off
    # Auxiliary-loss-free balancing (DeepSeek-V3): each expert's routing bias moves by this
    # much a step against its load; 0: off.
    bias_update_rate: float = 0.0
    # A routing bias per expert even with balancing off (0 rate): one a checkpoint brought
    # (DeepSeek-V3's e_score_correction_bias) keeps choosing experts as it did.
    router_bias: bool = False

    capabilities = frozenset({SEQUENCE, ATTENTION, PROJECTIONS, EXPERTS, STAGES, REMAT})
    mesh_divides = {**LlamaConfig.mesh_divides, "expert": ("num_experts",)}
    axis_names = {"dense_layers": None}  # the dense layers' stack rests whole (no pipeline splits it)
    stack_axes = ("layers", "dense_layers", "experts")  # Muon's matrix stacks (jaxpar.step.muon)
    WEIGHTS = ("shared_experts", "aux_loss_weight", "z_loss_weight", "bias_update_rate")

    def check(self, sizes: dict[str, int]) -> None:
        super().check(sizes)
        if self.num_experts < 1:
            raise ConfigError(f"model.num_experts={self.num_experts} must be a positive integer; e.g. model.num_experts=8")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"model.top_k={self.top_k} must be between 1 and model.num_experts={self.num_experts}; "
                              f"e.g. model.top_k={min(2, self.num_experts)}")
        self._check_groups()
        if not self.capacity_factor > 0:
            raise ConfigError(f"model.capacity_factor={self.capacity_factor} must be > 0 (1.0 is each expert's balanced "
                              "share); e.g. 1.25, or model.routing=dropless to drop nothing")
        for field in self.WEIGHTS:
            if getattr(self, field) < 0:
                raise ConfigError(f"model.{field}={getattr(self, field)} must be >= 0; use 0 to turn it off")
        if self.routing == "capacity" and sizes.get("context", 1) > 1:
            raise ConfigError(
                f"model.routing=capacity gives each sequence its expert capacity, but mesh.context={sizes['context']} "
                "splits sequences across devices; use model.routing=dropless, or mesh.context=1")
        self._check_dense_layers(sizes)

    def _check_dense_layers(self, sizes: dict[str, int]) -> None:
        dense = self.dense_layer_ids()
        if dense and self.dense_mlp % sizes.get("tensor", 1):
            raise ConfigError(f"mesh.tensor={sizes['tensor']} does not divide model.dense_mlp={self.dense_mlp} (the "
                              "dense layers' MLP width, split over tensor as model.mlp is); use a multiple of it")
        first = stack_layer_ids(self)["layers"][0]
        after = [i for i in dense if i > first]
        if after and sizes.get("stage", 1) > 1:
            raise ConfigError(f"mesh.stage={sizes['stage']} with dense layers after MoE ones (layer"
                              f"{'s' * (len(after) > 1)} {', '.join(map(str, after))} of the model, after MoE layer "
                              f"{first}): pipeline stages "
                              "split the MoE layers alone, and only dense layers before every MoE one run (on the first "
                              "stage); set mesh.stage=1")

    def leading_layers(self) -> int:
        """The dense layers before the first MoE one: the embedding runs them on a pipeline's
        first stage (jaxpar.model's `leading_layers`)."""
        first = stack_layer_ids(self)["layers"][0] if self.num_layers else 0
        return len([i for i in self.dense_layer_ids() if i < first])

    def dense_layer_ids(self) -> tuple[int, ...]:
        """The layers, by index in the whole model (num_layers MoE layers and these), whose MLP
        is dense, of the family's `dense_mlp` width: none here (the module docstring)."""
        return ()

    @property
    def has_router_bias(self) -> bool:
        return self.router_bias or self.bias_update_rate > 0

    def _check_groups(self) -> None:
        e, groups = self.num_experts, self.expert_groups
        if groups < 1 or e % groups or (groups > 1 and e // groups < 2):
            fits = [g for g in range(1, e + 1) if e % g == 0 and (g == 1 or e // g >= 2)]
            raise ConfigError(f"model.expert_groups={groups} must split model.num_experts={e} into groups of two "
                              f"experts or more; use one of {fits}")
        if not 1 <= self.top_groups <= groups:
            raise ConfigError(f"model.top_groups={self.top_groups} must be between 1 and model.expert_groups={groups}")
        if self.top_k > self.top_groups * (e // groups):
            raise ConfigError(f"model.top_k={self.top_k} is more experts than model.top_groups={self.top_groups} groups "
                              f"of {e // groups} hold; raise model.top_groups or lower model.top_k")
        if self.group_capacity and (self.routing != "capacity" or groups == 1):
            raise ConfigError(f"model.group_capacity=true caps each group's tokens under capacity routing with groups, "
                              f"but model.routing={self.routing} and model.expert_groups={groups}; use "
                              "model.routing=capacity with model.expert_groups > 1, or model.group_capacity=false")
        if not 0 < self.routed_scaling < float("inf"):
            raise ConfigError(f"model.routed_scaling={self.routed_scaling} must be positive, e.g. 1 or 2.5")

    def build(self, rngs: nnx.Rngs) -> "MoETransformer":
        return MoETransformer(self, rngs=rngs)

    def block(self, rngs: nnx.Rngs) -> nnx.Module:
        return MoEBlock(self, rngs=rngs)

    def param_count(self, include_embedding: bool = True, active: bool = False) -> int:
        """All parameters, or those one token uses (`active`: k experts of E); the dense layers' too."""
        embedding = self.vocab_size * self.embed * (1 if self.tie_embeddings else 2)
        return (self.num_layers * self.moe_layer_param_count(active) + self.dense_param_count() + self.embed
                + (embedding if include_embedding else 0))

    def dense_param_count(self) -> int:
        """The dense layers (dense_layer_ids): attention, a dense MLP and two norms each."""
        n = len(self.dense_layer_ids())
        return n * (self.attention_param_count() + 3 * self.embed * self.dense_mlp + 2 * self.embed) if n else 0

    def layer_param_count(self) -> int:
        """One layer of the stack: an MoE layer (the dense ones and the prediction module rest
        outside it)."""
        return self.moe_layer_param_count()

    def moe_layer_param_count(self, active: bool = False) -> int:
        """One MoE layer: attention, the router, the experts (k of them when `active`) and
        the shared ones, two norms."""
        d, experts = self.embed, self.top_k if active else self.num_experts
        return (self.attention_param_count() + d * self.num_experts + 3 * d * self.mlp * (experts + self.shared_experts)
                + 2 * d)

    def flops_per_token(self, seq_len: int) -> float:
        """6 x the parameters one token uses (k experts) plus attention, as for Llama."""
        matmul_params = self.param_count(include_embedding=False, active=True) + self.vocab_size * self.embed
        return 6 * matmul_params + (self.num_layers + len(self.dense_layer_ids())) * self.attention_flops(seq_len)

    def summarise(self, counts: dict) -> dict:
        """Per-step metrics from the step's summed counts: the share of (token, choice)
        pairs dropped, and expert load max / mean (averaged over layers; 1.0 is balanced)."""
        load = counts["expert_load"].astype(jnp.float32)  # [L, E] pairs routed to each expert
        return {
            "moe_dropped": jnp.sum(counts["dropped"]) / jnp.maximum(jnp.sum(load), 1),
            "moe_load": jnp.mean(jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9)),
        }

    def scale_qk(self, params: dict, logit_max: jax.Array, threshold: float) -> dict:
        """QK-clip on each stack (the MoE layers', the dense ones'), its rows of the model's
        largest logits [all layers, H] picked by their place in the model."""
        out, stacks = dict(params), {s: ids for s, ids in stack_layer_ids(self).items() if ids}
        for stack, ids in stacks.items():  # one stack: every row as it rests (under stages, padding rows too)
            rows = logit_max if len(stacks) == 1 else logit_max[jnp.asarray(ids)]
            out[stack] = {**params[stack], "attn": self.scale_attention(params[stack]["attn"], rows, threshold)}
        return out

    def update(self, params: dict, counts: dict) -> dict:
        """Bias balancing after the optimizer step: b_e += rate x sign(mean load - load_e)."""
        if not self.bias_update_rate:
            return params
        load = counts["expert_load"].astype(jnp.float32)
        moe = params["layers"]["moe"]
        bias = moe["router_bias"] + self.bias_update_rate * jnp.sign(jnp.mean(load, -1, keepdims=True) - load)
        return {**params, "layers": {**params["layers"], "moe": {**moe, "router_bias": bias.astype(moe["router_bias"].dtype)}}}


class RouterBias(nnx.Variable):
    """Set by the balancing rule (MoEConfig.update), never by gradients: not an nnx.Param."""


def expert_ffn(weights, x, group_sizes=None, activation=jax.nn.silu):
    """The gated MLP (SwiGLU) of every expert: x [E, C, D] (one buffer per expert), or x [M, D]
    grouped by expert with `group_sizes` [E] (a ragged matmul; rows past the groups give zeros)."""
    w_gate, w_up, w_down = weights
    gate = checkpoint_name(expert_matmul(x, w_gate, group_sizes), "mlp_hidden")
    up = checkpoint_name(expert_matmul(x, w_up, group_sizes), "mlp_hidden")
    h = checkpoint_name(activation(gate) * up, "mlp_hidden")
    return expert_matmul(h, w_down, group_sizes)


class MoE(nnx.Module):
    """Router + routed experts; returns (y, what the layer reports for losses and metrics)."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        d, e, f = cfg.embed, cfg.num_experts, cfg.mlp
        self.router = param(rngs, (d, e), ("embed", None), d)
        self.w_gate = param(rngs, (e, d, f), ("experts", "embed", "expert_mlp"), d)
        self.w_up = param(rngs, (e, d, f), ("experts", "embed", "expert_mlp"), d)
        self.w_down = param(rngs, (e, f, d), ("experts", "expert_mlp", "embed"), f)
        if cfg.has_router_bias:
            # Zeros drawn from no key, so turning balancing on leaves every other initial weight as it was.
            self.router_bias = RouterBias(nnx.with_partitioning(nnx.initializers.zeros, (None,))(None, (e,)))
        self.cfg = cfg

    def __call__(self, x_BSD: jax.Array) -> tuple[jax.Array, dict]:
        cfg = self.cfg
        x_BSD = constrain(x_BSD, HIDDEN)
        logits = jnp.einsum("bsd,de->bse", x_BSD.astype(jnp.float32), compute_value(self.router).astype(jnp.float32))
        probs = jax.nn.softmax(logits, axis=-1) if cfg.router_scores == "softmax" else jax.nn.sigmoid(logits)
        scores = probs
        if cfg.has_router_bias:  # chooses experts; the gates stay the router's probabilities
            scores = probs + jax.lax.stop_gradient(compute_value(self.router_bias).astype(jnp.float32))
        ids = top_k_indices(scores, cfg.top_k, cfg.expert_groups, cfg.top_groups)
        chosen_probs = jnp.take_along_axis(probs, ids, axis=-1)
        gates = chosen_probs
        if cfg.renormalize and cfg.top_k > 1:  # at k = 1 it would make every gate 1: no gradient to the router
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        gates = gates * cfg.routed_scaling
        y, kept = run_experts(
            x_BSD, ids, gates, chosen_probs, (self.w_gate, self.w_up, self.w_down),
            functools.partial(expert_ffn, activation=ACTIVATIONS[cfg.activation]), cfg.routing, cfg.capacity_factor,
            group_capacity=(cfg.expert_groups, cfg.top_groups) if cfg.group_capacity else None,
        )
        chosen = jax.nn.one_hot(ids, cfg.num_experts, dtype=jnp.int32).sum(axis=2)  # [B, S, E]
        share = jnp.mean(chosen, axis=1, dtype=jnp.float32) / cfg.top_k  # f per sequence [B, E]
        # Sigmoid scores are normalised over the experts first (DeepSeek-V3's sequence-wise balance loss)
        balance = probs if cfg.router_scores == "softmax" else probs / jnp.sum(probs, axis=-1, keepdims=True)
        switch = cfg.num_experts * jnp.sum(share * jnp.mean(balance, axis=1), axis=-1)  # [B]
        report = {
            "switch": switch,
            "z": jnp.square(jax.nn.logsumexp(logits, axis=-1)),  # [B, S]
            "expert_load": jnp.sum(chosen, axis=(0, 1)),  # [E], int32: exact at any batch
            "dropped": jnp.sum(~kept, dtype=jnp.int32),
        }
        return constrain(y, RESIDUAL), report


class MoEBlock(nnx.Module):
    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.embed, cfg.norm_eps, rngs=rngs)
        self.attn = cfg.attention_module(rngs)
        self.mlp_norm = RMSNorm(cfg.embed, cfg.norm_eps, rngs=rngs)
        self.moe = MoE(cfg, rngs=rngs)
        if cfg.shared_experts:
            self.shared = dataclasses.replace(cfg, mlp=cfg.shared_experts * cfg.mlp).mlp_module(rngs)

    def __call__(self, x_BSD: jax.Array, positions: jax.Array, segment_ids: jax.Array | None) -> tuple[jax.Array, dict]:
        attended, logits = with_logits(self.attn(self.attn_norm(x_BSD), positions, segment_ids))
        x_BSD = checkpoint_name(x_BSD + attended, "residual")
        h = self.mlp_norm(x_BSD)
        y, report = self.moe(h)
        if hasattr(self, "shared"):
            y = y + self.shared(h)
        return constrain(x_BSD + y, RESIDUAL), report if logits is None else {**report, "logit_max": logits}


class MoETransformer(Llama):
    """The Llama decoder with MoE blocks, and dense ones where the config lists them (the
    module docstring). Returns (logits, aux) where aux is what jaxpar.step.loss.model_loss
    adds to the objective and reports:
      penalty        [B, S] per-token addition to the loss (weighted like the cross-entropy)
      token_metrics  per-token values reported as their weighted mean over the step
      counts         arrays summed over the step (MoEConfig.summarise / update read them)
    """

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        dense = cfg.dense_layer_ids()
        if dense:
            block = dataclasses.replace(cfg, mlp=cfg.dense_mlp)
            self.dense = stack_layers(lambda r: Block(block, rngs=r), len(dense), rngs, axis_name="dense_layers")

    def runs(self) -> tuple[Run | None, tuple[Run, ...]]:
        """(the dense layers before the first MoE one, run with the embedding: a pipeline's
        first stage; None without), (the runs after them)."""
        runs = layer_runs(self.cfg.dense_layer_ids(), self.cfg.num_layers)
        return (runs[0], runs[1:]) if runs[0].dense else (None, runs)

    def trunk(self, table, tokens_BS, positions, segment_ids):
        x, leading = self.leading(self.lookup(table, tokens_BS), positions, segment_ids)
        x, reports = self.run_layers(x, positions, segment_ids)
        if leading:  # QK-clip: the leading dense layers' largest logits first, in the model's order
            reports = {**reports, "logit_max": jnp.concatenate([leading["logit_max"], reports["logit_max"]])}
        return x, reports

    def embed(self, batch: dict) -> jax.Array:
        """The pipeline's first piece: the embedding and the dense layers before the first MoE one."""
        return self.run_leading(super().embed(batch), batch.get("positions"), batch.get("segment_ids"))

    def run_leading(self, x: jax.Array, positions: jax.Array | None, segment_ids: jax.Array | None) -> jax.Array:
        return self.leading(x, positions, segment_ids)[0]

    def leading(self, x: jax.Array, positions: jax.Array | None, segment_ids: jax.Array | None
                ) -> tuple[jax.Array, dict | None]:
        """x through the dense layers before the first MoE one, and what they reported (QK-clip's logits)."""
        leading, _ = self.runs()
        if leading is None:
            return x, None
        positions = jnp.arange(x.shape[1]) if positions is None else positions
        return self.run(leading, x, positions, segment_ids)

    def run_layers(self, x: jax.Array, positions: jax.Array | None, segment_ids: jax.Array | None, first_layer=0):
        """The layers after the leading dense ones, in their order: the MoE stack alone (a
        pipeline stage's chunk of it), or runs of each kind, the MoE layers' reports joined."""
        _, runs = self.runs()
        if len(runs) == 1:
            return super().run_layers(x, positions, segment_ids, first_layer)
        positions = jnp.arange(x.shape[1]) if positions is None else positions
        reports, logits = [], []
        for run in runs:
            x, report = self.run(run, x, positions, segment_ids)
            logits += [report.pop("logit_max")] if report is not None and "logit_max" in report else []
            reports += [report] if report else []
        joined = jax.tree.map(lambda *r: jnp.concatenate(r), *reports)
        return x, {**joined, "logit_max": jnp.concatenate(logits)} if logits else joined

    def run(self, run: "Run", x, positions, segment_ids) -> tuple[jax.Array, dict | None]:
        """x through one run of layers: a scan over its slice of its stack."""
        stack = self.dense if run.dense else self.layers
        size = jax.tree.leaves(nnx.state(stack))[0].shape[0]
        if (run.start, run.stop) != (0, size):
            graphdef, state = nnx.split(stack)
            stack = nnx.merge(graphdef, jax.tree.map(lambda a: a[run.start:run.stop], state))
        out = scan_layers(stack, x, positions, segment_ids, remat=self.cfg.remat, unroll=self.cfg.unroll_layers)
        return out if isinstance(out, tuple) else (out, None)

    def __call__(self, tokens_BS, positions=None, segment_ids=None):
        table = compute_value(self.embedding)
        x, reports = self.trunk(table, tokens_BS, positions, segment_ids)
        return self.logits(x, table), self.balance(reports)

    def balance(self, reports: dict) -> dict:
        """The aux of the layers' reports: their balancing penalties, metrics and counts
        (and, for QK-clip, every layer's largest attention logits)."""
        cfg = self.cfg
        switch = jnp.mean(reports["switch"], axis=0)  # [B], averaged over layers
        z = jnp.mean(reports["z"], axis=0)  # [B, S]
        switch_BS = jnp.broadcast_to(switch[:, None], z.shape)
        aux = {
            "penalty": cfg.aux_loss_weight * switch_BS + cfg.z_loss_weight * z,
            "token_metrics": {"moe_aux_loss": switch_BS, "moe_z_loss": z},
            "counts": {"expert_load": reports["expert_load"], "dropped": reports["dropped"]},
        }
        if "logit_max" in reports:
            aux[MAXIMA] = {"attn_logit_max": reports["logit_max"]}
        return aux

    def apply_layers(self, x: jax.Array, batch: dict) -> tuple[jax.Array, dict]:
        """A pipeline chunk's layers (jaxpar.model.PipelineStages), with their report: the
        chunk's share of the penalty summed under the batch's weights ("loss": the layers'
        mean is a sum over chunks of each chunk's sum / num_layers), the same shares of the
        token metrics ("sums"), and each layer's counts ("per_layer")."""
        cfg = self.cfg
        x, reports = self.run_layers(x, batch.get("positions"), batch.get("segment_ids"))
        weights = batch["weights"].astype(jnp.float32)
        z = jnp.sum(reports["z"], axis=0) / cfg.num_layers  # [B, S]
        switch_BS = jnp.broadcast_to((jnp.sum(reports["switch"], axis=0) / cfg.num_layers)[:, None], z.shape)
        penalty = cfg.aux_loss_weight * switch_BS + cfg.z_loss_weight * z
        metrics = {"moe_aux_loss": jnp.sum(switch_BS * weights), "moe_z_loss": jnp.sum(z * weights)}
        return x, {
            "loss": jnp.sum(penalty * weights),
            "sums": {"token_metrics": jax.lax.stop_gradient(metrics)},
            "per_layer": {"counts": {"expert_load": reports["expert_load"], "dropped": reports["dropped"]},
                          **({MAXIMA: {"attn_logit_max": reports["logit_max"]}} if "logit_max" in reports else {})},
        }


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive layers of one kind: [start, stop) of the dense stack or of the MoE one."""

    dense: bool
    start: int
    stop: int


def stack_layer_ids(cfg: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Each stack's layers by their index in the whole model (Hugging Face's), in the stack's
    order: {"layers": the MoE ones, "dense": the dense ones}."""
    dense = cfg.dense_layer_ids()
    return {"layers": tuple(i for i in range(cfg.num_layers + len(dense)) if i not in dense), "dense": dense}


def layer_runs(dense_ids: tuple[int, ...], moe_layers: int) -> tuple[Run, ...]:
    """The model's layers in order as runs of one kind: `dense_ids` (indices in the whole
    model) dense, the other `moe_layers` MoE; each run's slice of its own stack."""
    runs: list[Run] = []
    taken = [0, 0]  # MoE, dense layers so far
    for i in range(moe_layers + len(dense_ids)):
        dense = i in dense_ids
        if runs and runs[-1].dense == dense:
            runs[-1] = dataclasses.replace(runs[-1], stop=runs[-1].stop + 1)
        else:
            runs.append(Run(dense, taken[dense], taken[dense] + 1))
        taken[dense] += 1
    return tuple(runs)


# ---------------------------------------------------------------- Hugging Face format (jaxpar.hf)


def mixtral_from_hf(cls, hf: dict) -> MoEConfig:
    """Mixtral's config: dropless top-k routing, gates renormalised over the k chosen. Its
    auxiliary loss (router_aux_loss_coef, on when output_router_logits) becomes ours, which is
    defined per sequence where Mixtral's is over the batch (docs/checkpoints_and_data.md)."""
    k = value(hf, "num_experts_per_tok")
    if k == 1:
        raise ConfigError("config.json has num_experts_per_tok=1: Mixtral renormalises a single gate to 1, where "
                          "jaxpar keeps the router's probability (which gives the router a gradient); jaxpar imports "
                          "Mixtral models of top-k >= 2")
    aux = float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0
    return llama_from_hf(cls, hf, num_experts=value(hf, "num_local_experts"), top_k=k, routing="dropless",
                         renormalize=True, shared_experts=0, aux_loss_weight=aux, z_loss_weight=0.0, bias_update_rate=0.0)


def mixtral_to_hf(cfg: MoEConfig) -> dict:
    if cfg.shared_experts or not cfg.renormalize or cfg.top_k == 1:
        raise ConfigError("Mixtral's format has no shared experts and renormalises its top-k >= 2 gates; this model has "
                          f"model.shared_experts={cfg.shared_experts}, model.renormalize={cfg.renormalize}, "
                          f"model.top_k={cfg.top_k}, which it cannot hold")
    refuse_parts(cfg, "MixtralForCausalLM", qk_norm=False, qkv_bias=False, router_scores="softmax", expert_groups=1,
                 top_groups=1, routed_scaling=1.0)
    hf = llama_to_hf(cfg, "MixtralForCausalLM", "mixtral")
    for key in ("attention_bias", "mlp_bias"):
        hf.pop(key)
    if cfg.head_dim == cfg.embed // cfg.num_heads:  # Mixtral's default; written only where it differs
        hf.pop("head_dim")
    return {**hf, "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k, "sliding_window": cfg.sliding_window or None,
            "router_aux_loss_coef": cfg.aux_loss_weight, "output_router_logits": cfg.aux_loss_weight > 0}


def mixtral_hf_weights(cfg: MoEConfig) -> dict[str, Weight]:
    """Mixtral's block_sparse_moe: a router [E, D] and each expert's w1 (gate), w3 (up), w2 (down)."""
    moe = "model.layers.{layer}.block_sparse_moe."
    return experts_hf_weights(cfg, "Mixtral", moe + "gate.weight", moe + "experts.{expert}.", ("w1", "w3", "w2"))


def experts_hf_weights(cfg: MoEConfig, model: str, router: str, expert: str, names: tuple[str, str, str]
                       ) -> dict[str, Weight]:
    """A format of routed experts without shared ones: the attention's tensors, the router
    [E, D] at `router`, and under `expert` (with {layer} and {expert}) each expert's gate,
    up and down projections, named `names`."""
    if cfg.shared_experts:
        raise ConfigError(f"model.shared_experts={cfg.shared_experts}: {model}'s format has no shared experts")
    gate, up, down = (Weight(expert + name + ".weight", order=(1, 0)) for name in names)
    weights = {**attention_weights(cfg), "layers.moe.router": Weight(router, order=(1, 0)),
               "layers.moe.w_gate": gate, "layers.moe.w_up": up, "layers.moe.w_down": down}
    if cfg.has_router_bias:
        weights["layers.moe.router_bias"] = Weight(None)
    return weights


# routing and balancing are training choices, free to differ from the checkpoint's config
MOE_TRAINING_FIELDS = TRAINING_FIELDS + ("routing", "capacity_factor", "aux_loss_weight", "z_loss_weight",
                                         "bias_update_rate")
# Llama's format (the tied head it ignores) with Mixtral's names, experts and routing fields
MIXTRAL_FORMAT = dataclasses.replace(LLAMA_FORMAT, architectures=("MixtralForCausalLM",),
                                     from_hf=functools.partial(mixtral_from_hf, MoEConfig),
                                     to_hf=mixtral_to_hf, weights=mixtral_hf_weights,
                                     training_fields=MOE_TRAINING_FIELDS)

register(Family("mixtral", MoEConfig, hf=MIXTRAL_FORMAT, presets={
    # Mixtral 8x7B (Jiang et al. 2024): 8 experts of the Mistral 7B MLP, 2 per token. Capacity
    # routing: its compiled FLOPs are those a GPU runs (the dropless grouped matmul compiles
    # densely on CPU, every expert for every token).
    "mixtral-8x7b": MoEConfig(vocab_size=32000, embed=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                              head_dim=128, mlp=14336, num_experts=8, top_k=2, routing="capacity"),
}))
