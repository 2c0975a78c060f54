"""Flax NNX models with logical axis names; no collectives inside.

Each module is a model family and registers itself (jaxpar.families.register) at its end;
the registry imports every module here the first time one of its tables is read, so a new
family is one new module.
"""

from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.models.mlp import MLP, MLPConfig

__all__ = ["MLP", "Llama", "LlamaConfig", "MLPConfig"]
