"""A Vision Transformer classifier written as a user would: images [B, H, W, C] cut into
patches, a learned position table, pre-norm blocks of bidirectional attention and a GELU
MLP, mean pooling and a linear head. Unlike examples/gpt2.py it uses jaxpar's logical names
directly (embed, heads, head_dim, mlp), plus three of its own that no rule shards.

The model contract (jaxpar.model) it keeps:
  - task "classify" with `input_shape` (H, W, C): the batches hold images, one class each;
  - `sequence_length`: its activations' sequence is the patch count, so sequence
    parallelism shards the patches (the checks divide that, not train.seq_len);
  - the matmuls go through `column_project` / `row_project`, attention through `attend`
    (not causal), the layers through `stack_layers` / `scan_layers`;
  - `embed` / `apply_layers` / `output`: a pipeline can cut it.

  jaxpar train examples/vit.py --set mesh.fsdp=2 --set mesh.tensor=4
  jaxpar train examples/vit.py --set mesh.stage=2 --set train.microbatches=4
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import Config, OptimConfig, ParallelConfig, TensorConfig, TrainConfig
from jaxpar.errors import ConfigError
from jaxpar.mesh import MeshConfig
from jaxpar.model import PROJECTIONS, REMAT, SEQUENCE, STAGES
from jaxpar.nn import scan_layers, stack_layers
from jaxpar.sharding import attend, column_project, compute_value, constrain, row_project

RESIDUAL = ("batch", "norm_seq", "embed")
HIDDEN = ("batch", "seq", "embed")
HEADS = ("batch", "seq", "heads", "head_dim")
MLP_NAMES = ("batch", "seq", "mlp")


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    image_size: int = 16
    channels: int = 3
    patch: int = 4
    embed: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp: int = 128
    num_classes: int = 10
    remat: str = "none"

    task = "classify"
    capabilities = frozenset({SEQUENCE, PROJECTIONS, STAGES, REMAT})
    axis_names = {"patch_pixels": None, "patches": None, "classes": None}  # small, kept whole on purpose
    mesh_divides = {"tensor": ("num_heads", "mlp"), "fsdp": ("embed",)}

    input_shape = property(lambda self: (self.image_size, self.image_size, self.channels))
    sequence_length = property(lambda self: (self.image_size // self.patch) ** 2)
    head_dim = property(lambda self: self.embed // self.num_heads)

    def check(self, sizes: dict[str, int]) -> None:
        if self.image_size % self.patch:
            raise ConfigError(f"model.patch={self.patch} does not divide model.image_size={self.image_size}")
        if self.embed % self.num_heads:
            raise ConfigError(f"model.num_heads={self.num_heads} does not divide model.embed={self.embed}")

    def build(self, rngs: nnx.Rngs) -> "ViT":
        return ViT(self, rngs=rngs)

    def param_count(self) -> int:
        d, f, p = self.embed, self.mlp, self.patch**2 * self.channels
        per_layer = 4 * d * d + 3 * d + 2 * d * f + f + d + 4 * d
        return p * d + d + self.sequence_length * d + self.num_layers * per_layer + 2 * d + d * self.num_classes + self.num_classes

    def head_param_count(self) -> int:
        return self.embed * self.num_classes

    def flops_per_token(self, seq_len: int = 0) -> float:
        """Training FLOPs per image: 6 x matmul weights x patches, plus attention."""
        d, f, n = self.embed, self.mlp, self.sequence_length
        per_patch = self.patch**2 * self.channels * d + self.num_layers * (4 * d * d + 2 * d * f)
        return 6 * per_patch * n + 12 * self.num_layers * d * n * n + 6 * d * self.num_classes


def dense(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], fan_in: int) -> nnx.Param:
    return nnx.Param(nnx.with_partitioning(nnx.initializers.normal(fan_in**-0.5), names)(rngs.params(), shape))


def vector(value: float, size: int, name: str) -> nnx.Param:
    init = nnx.initializers.ones if value else nnx.initializers.zeros
    return nnx.Param(nnx.with_partitioning(init, (name,))(jax.random.key(0), (size,)))


class LayerNorm(nnx.Module):
    def __init__(self, dim: int):
        self.scale, self.bias = vector(1.0, dim, "embed"), vector(0.0, dim, "embed")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(((x32 - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
        return (y * compute_value(self.scale) + compute_value(self.bias)).astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs):
        d, h, k, f = cfg.embed, cfg.num_heads, cfg.head_dim, cfg.mlp
        self.norm_1, self.norm_2 = LayerNorm(d), LayerNorm(d)
        self.wq, self.wk, self.wv = (dense(rngs, (d, h, k), ("embed", "heads", "head_dim"), d) for _ in range(3))
        self.wo = dense(rngs, (h, k, d), ("heads", "head_dim", "embed"), d)
        self.w_in = dense(rngs, (d, f), ("embed", "mlp"), d)
        self.b_in = vector(0.0, f, "mlp")
        self.w_out = dense(rngs, (f, d), ("mlp", "embed"), f)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = column_project(self.norm_1(x), [self.wq, self.wk, self.wv], [HEADS] * 3)
        o = constrain(attend(q, k, v, causal=False), HEADS)
        x = x + row_project(o, self.wo, HEADS)
        (h,) = column_project(self.norm_2(x), [self.w_in], [MLP_NAMES])
        h = constrain(jax.nn.gelu(h + compute_value(self.b_in)), MLP_NAMES)
        return constrain(x + row_project(h, self.w_out, MLP_NAMES), RESIDUAL)


class ViT(nnx.Module):
    def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pixels = cfg.patch**2 * cfg.channels
        self.patch_proj = dense(rngs, (pixels, cfg.embed), ("patch_pixels", "embed"), pixels)
        self.position = dense(rngs, (cfg.sequence_length, cfg.embed), ("patches", "embed"), cfg.embed)
        self.layers = stack_layers(lambda r: Block(cfg, rngs=r), cfg.num_layers, rngs)
        self.norm = LayerNorm(cfg.embed)
        self.head = dense(rngs, (cfg.embed, cfg.num_classes), ("embed", "classes"), cfg.embed)

    def __call__(self, images: jax.Array) -> jax.Array:
        """Logits [B, classes] for images [B, H, W, C]."""
        batch = {"inputs": images}
        return self.output(self.apply_layers(self.embed(batch), batch))

    def embed(self, batch: dict) -> jax.Array:
        images, p = batch["inputs"], self.cfg.patch
        b, h, w, c = images.shape
        patches = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
        x = jnp.einsum("bnp,pd->bnd", patches.astype(compute_value(self.patch_proj).dtype), compute_value(self.patch_proj))
        return constrain(constrain(x + compute_value(self.position), HIDDEN), RESIDUAL)

    def apply_layers(self, x: jax.Array, batch: dict) -> jax.Array:
        return scan_layers(self.layers, x, remat=self.cfg.remat)

    def output(self, x: jax.Array) -> jax.Array:
        pooled = constrain(self.norm(x), HIDDEN).mean(axis=1)
        return constrain(pooled @ compute_value(self.head), ("batch", "classes")).astype(jnp.float32)


def recipe() -> Config:
    """A small ViT on 16x16 images, data x fsdp x tensor with sequence parallelism (8 devices)."""
    return Config(
        model=ViTConfig(image_size=16, patch=4, embed=64, num_layers=4, num_heads=4, mlp=128, num_classes=10),
        mesh=MeshConfig(data=-1, fsdp=2, tensor=2),
        parallel=ParallelConfig(tensor=TensorConfig(sequence_parallel=True)),
        train=TrainConfig(steps=40, global_batch=32, compute_dtype="bfloat16"),
        optim=OptimConfig(lr=1e-3, warmup_steps=5),
    )
