"""Flax NNX models with logical axis names; no collectives inside."""

from models.llama import Llama, LlamaConfig
from models.mlp import MLP, MLPConfig

__all__ = ["MLP", "Llama", "LlamaConfig", "MLPConfig"]
