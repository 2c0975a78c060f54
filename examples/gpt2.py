"""A GPT-2-style decoder written as a user would: learned positions, LayerNorm, GELU, a head
tied to the token embedding, and its own logical axis names (tok, dm, ff, nh, hd).

It gets every strategy jaxpar's own Llama gets by keeping the model contract (jaxpar.model):
  - `axis_names` says what its names mean in jaxpar's vocabulary, so the default rules shard
    them (FSDP the `dm` dimension of every weight, tensor parallelism the heads, the MLP
    width and the vocabulary);
  - the matmuls go through `column_project` / `row_project` (tensor + sequence parallel,
    collective matmul), attention through `attend` (flash, cuDNN, ring / Ulysses context
    parallel), the layers through `stack_layers` / `scan_layers` (remat, FSDP one layer at a
    time);
  - `embed` / `apply_layers` / `output` let a pipeline cut it into stages.
No collective appears here. Train it:

  jaxpar train examples/gpt2.py --set mesh.fsdp=2 --set mesh.tensor=4
  jaxpar train examples/gpt2.py --set mesh.stage=2 --set mesh.fsdp=2 --set mesh.tensor=2 --set train.microbatches=4
  jaxpar train examples/gpt2.py --set mesh.context=2 --set parallel.context.impl=ring

or from Python: `jaxpar.train.run(jaxpar.train.build(recipe()))` (docs/your_model.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import Config, OptimConfig, ParallelConfig, TensorConfig, TrainConfig
from jaxpar.mesh import MeshConfig
from jaxpar.model import ATTENTION, PROJECTIONS, REMAT, SEQUENCE, STAGES
from jaxpar.nn import scan_layers, stack_layers
from jaxpar.sharding import attend, column_project, compute_value, constrain, lookup, row_project

# Activations: the batch and sequence axes are jaxpar's (`norm_seq` is the sequence where
# Megatron sequence parallelism shards it: around the norms and residual adds).
RESIDUAL = ("batch", "norm_seq", "dm")
HIDDEN = ("batch", "seq", "dm")
HEADS = ("batch", "seq", "nh", "hd")
FF = ("batch", "seq", "ff")


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 256
    n_positions: int = 128
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_inner: int = 256
    eps: float = 1e-5
    remat: str = "none"  # a jaxpar.nn policy: none | full | dots | ...
    unroll_layers: bool = False  # the layers in line rather than a loop (jaxpar.nn.scan_layers)

    task = "lm"
    capabilities = frozenset({SEQUENCE, ATTENTION, PROJECTIONS, STAGES, REMAT})
    axis_names = {"tok": "vocab", "dm": "embed", "ff": "mlp", "nh": "heads", "hd": "head_dim", "pos": None}
    mesh_divides = {"tensor": ("n_head", "n_inner", "vocab_size"), "fsdp": ("n_embd",)}

    # What the attention and pipeline capabilities read, in jaxpar's words.
    num_heads = property(lambda self: self.n_head)
    num_kv_heads = property(lambda self: self.n_head)
    head_dim = property(lambda self: self.n_embd // self.n_head)
    num_layers = property(lambda self: self.n_layer)
    # The learned position table's rows: a longer train.seq_len is refused before compile.
    max_seq_len = property(lambda self: self.n_positions)

    def check(self, sizes: dict[str, int]) -> None:
        from jaxpar.errors import ConfigError

        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_head={self.n_head} does not divide model.n_embd={self.n_embd}")

    def build(self, rngs: nnx.Rngs) -> "GPT2":
        return GPT2(self, rngs=rngs)

    def param_count(self) -> int:
        d, f, v, p = self.n_embd, self.n_inner, self.vocab_size, self.n_positions
        per_layer = 4 * d * d + 3 * d + 2 * d * f + f + d + 4 * d  # attention, MLP, two norms
        return v * d + p * d + self.n_layer * per_layer + 2 * d

    def head_param_count(self) -> int:
        """The tied head's weights (`jaxpar explain` splits a pipeline's recompute by them)."""
        return self.vocab_size * self.n_embd

    def flops_per_token(self, seq_len: int) -> float:
        """6 x (the layers' weights + the tied head) plus attention (PaLM appendix B)."""
        d, f, v = self.n_embd, self.n_inner, self.vocab_size
        return 6 * (self.n_layer * (4 * d * d + 2 * d * f) + v * d) + 12 * self.n_layer * d * seq_len


def param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float = 0.02) -> nnx.Param:
    return nnx.Param(nnx.with_partitioning(nnx.initializers.normal(std), names)(rngs.params(), shape))


def zeros(shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(nnx.with_partitioning(nnx.initializers.zeros, names)(jax.random.key(0), shape))


class LayerNorm(nnx.Module):
    def __init__(self, cfg: GPT2Config):
        self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, ("dm",))(jax.random.key(0), (cfg.n_embd,)))
        self.bias = zeros((cfg.n_embd,), ("dm",))
        self.eps = cfg.eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(((x32 - mean) ** 2).mean(-1, keepdims=True) + self.eps)
        return (y * compute_value(self.scale) + compute_value(self.bias)).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        d, h, k = cfg.n_embd, cfg.n_head, cfg.head_dim
        self.wq, self.wk, self.wv = (param(rngs, (d, h, k), ("dm", "nh", "hd")) for _ in range(3))
        # No key bias (GPT-2 has one): it shifts all of a query's scores by one constant,
        # which softmax ignores, so its gradient is rounding noise that Adam would amplify.
        self.bq, self.bv = zeros((h, k), ("nh", "hd")), zeros((h, k), ("nh", "hd"))
        self.wo = param(rngs, (h, k, d), ("nh", "hd", "dm"), 0.02 / (2 * cfg.n_layer) ** 0.5)
        self.bo = zeros((d,), ("dm",))

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        q, k, v = column_project(x, [self.wq, self.wk, self.wv], [HEADS] * 3)  # the parameters: gathered there
        q, v = q + compute_value(self.bq), v + compute_value(self.bv)
        o = constrain(attend(q, k, v, segment_ids), HEADS)
        return row_project(o, self.wo, HEADS) + compute_value(self.bo)


class MLP(nnx.Module):
    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.w_fc = param(rngs, (cfg.n_embd, cfg.n_inner), ("dm", "ff"))
        self.b_fc = zeros((cfg.n_inner,), ("ff",))
        self.w_proj = param(rngs, (cfg.n_inner, cfg.n_embd), ("ff", "dm"), 0.02 / (2 * cfg.n_layer) ** 0.5)
        self.b_proj = zeros((cfg.n_embd,), ("dm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        (h,) = column_project(x, [self.w_fc], [FF])
        h = constrain(jax.nn.gelu(h + compute_value(self.b_fc), approximate=True), FF)
        return row_project(h, self.w_proj, FF) + compute_value(self.b_proj)


class Block(nnx.Module):
    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.ln_1, self.attn = LayerNorm(cfg), Attention(cfg, rngs=rngs)
        self.ln_2, self.mlp = LayerNorm(cfg), MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        x = x + self.attn(self.ln_1(x), segment_ids)
        return constrain(x + self.mlp(self.ln_2(x)), RESIDUAL)


class GPT2(nnx.Module):
    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = param(rngs, (cfg.vocab_size, cfg.n_embd), ("tok", "dm"))
        self.wpe = param(rngs, (cfg.n_positions, cfg.n_embd), ("pos", "dm"), 0.01)
        self.layers = stack_layers(lambda r: Block(cfg, rngs=r), cfg.n_layer, rngs)
        self.ln_f = LayerNorm(cfg)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Logits [B, S, vocab] for token ids [B, S]. The trainer passes `positions` when
        it reorders the sequence (context parallel) or packs documents."""
        batch = {"inputs": tokens, "positions": positions, "segment_ids": segment_ids}
        return self.output(self.apply_layers(self.embed(batch), batch))

    # The pipeline's pieces (jaxpar.model.PipelineStages).

    def embed(self, batch: dict) -> jax.Array:
        tokens = batch["inputs"]
        positions = batch.get("positions")
        positions = jnp.arange(tokens.shape[1]) if positions is None else positions
        x = lookup(compute_value(self.wte), tokens, ("tok", "dm")) + jnp.take(compute_value(self.wpe), positions, axis=0)
        return constrain(constrain(x, HIDDEN), RESIDUAL)

    def apply_layers(self, x: jax.Array, batch: dict) -> jax.Array:
        return scan_layers(self.layers, x, batch.get("segment_ids"), remat=self.cfg.remat,
                           unroll=self.cfg.unroll_layers)

    def output(self, x: jax.Array) -> jax.Array:
        table = compute_value(self.wte)
        return column_project(self.ln_f(x), [table.T], [("batch", "seq", "tok")], low_precision=False)[0]


def recipe() -> Config:
    """A small GPT-2 on data x fsdp x tensor with sequence parallelism (8 devices)."""
    return Config(
        model=GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4, n_inner=256),
        mesh=MeshConfig(data=-1, fsdp=2, tensor=2),
        parallel=ParallelConfig(tensor=TensorConfig(sequence_parallel=True)),
        train=TrainConfig(steps=40, global_batch=16, seq_len=64, compute_dtype="bfloat16"),
        optim=OptimConfig(lr=3e-3, warmup_steps=5),
    )
