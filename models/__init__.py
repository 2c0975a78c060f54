"""Flax NNX models with logical axis names; no collectives inside."""

from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.models.mlp import MLP, MLPConfig

__all__ = ["MLP", "Llama", "LlamaConfig", "MLPConfig"]
