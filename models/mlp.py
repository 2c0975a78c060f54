"""The seed material's MLP (784-512-512-10, ReLU), for the data-parallel example.

Parameters are named like a transformer MLP so the same rules can also shard it:
  w1 [embed, mlp]  w2 [mlp, embed2]  w3 [embed2, classes]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.families import Family, register
from jaxpar.sharding import compute_value, constrain


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    in_features: int = 784  # the input vector's length
    hidden: int = 512  # both hidden layers' width
    num_classes: int = 10  # outputs (logits)

    task = "classify"  # no sequence and no attention: data, fsdp and tensor layouts only
    axis_names = {"embed2": "embed"}  # the second hidden layer's width shards like the first's

    def check(self, sizes: dict[str, int]) -> None:
        for field in ("in_features", "hidden", "num_classes"):
            if getattr(self, field) < 1:
                raise ConfigError(f"model.{field}={getattr(self, field)} must be a positive integer")

    def build(self, rngs: nnx.Rngs) -> "MLP":
        return MLP(self, rngs=rngs)

    def param_count(self) -> int:
        i, h, c = self.in_features, self.hidden, self.num_classes
        return i * h + h + h * h + h + h * c + c

    def flops_per_token(self, seq_len: int = 1) -> float:
        """Training FLOPs per example (6 per multiply-accumulate weight)."""
        return 6 * (self.in_features * self.hidden + self.hidden * self.hidden + self.hidden * self.num_classes)


def _dense(rngs: nnx.Rngs, fan_in: int, fan_out: int, names: tuple[str, str]) -> tuple[nnx.Param, nnx.Param]:
    init = nnx.with_partitioning(nnx.initializers.he_normal(), names)
    bias = nnx.with_partitioning(nnx.initializers.zeros, names[1:])
    return nnx.Param(init(rngs.params(), (fan_in, fan_out))), nnx.Param(bias(rngs.params(), (fan_out,)))


class MLP(nnx.Module):
    def __init__(self, cfg: MLPConfig, *, rngs: nnx.Rngs):
        self.w1, self.b1 = _dense(rngs, cfg.in_features, cfg.hidden, ("embed", "mlp"))
        self.w2, self.b2 = _dense(rngs, cfg.hidden, cfg.hidden, ("mlp", "embed2"))
        self.w3, self.b3 = _dense(rngs, cfg.hidden, cfg.num_classes, ("embed2", "classes"))

    def __call__(self, x_BI: jax.Array) -> jax.Array:
        x = constrain(x_BI, ("batch", "embed"))
        h = jax.nn.relu(x @ compute_value(self.w1) + compute_value(self.b1))
        h = constrain(h, ("batch", "mlp"))
        h = jax.nn.relu(h @ compute_value(self.w2) + compute_value(self.b2))
        h = constrain(h, ("batch", "embed2"))
        return constrain(h @ compute_value(self.w3) + compute_value(self.b3), ("batch", "classes")).astype(jnp.float32)


register(Family("mlp", MLPConfig))
