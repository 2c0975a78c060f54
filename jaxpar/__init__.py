"""jaxpar: every classic form of parallelism, composable on one named-axis mesh."""

from jaxpar.config import (
    CheckpointConfig,
    CompilerConfig,
    CompressionConfig,
    Config,
    ContextConfig,
    DataConfig,
    DistributedConfig,
    OptimConfig,
    ParallelConfig,
    PipelineConfig,
    RulesConfig,
    TensorConfig,
    TrainConfig,
    ZeroConfig,
    apply_overrides,
)
from jaxpar.checks import validate
from jaxpar.errors import ConfigError, Preempted, TrainingStopped
from jaxpar.loop.run import run
from jaxpar.mesh import AXES, HostSplit, MeshConfig, force_cpu_devices, make_mesh
from jaxpar.model import ModelConfig, PipelineStages
from jaxpar.sharding import Layout, Rules, compute_value, constrain, default_rules, use_layout
from jaxpar.step.trainer import Trainer, TrainState, build

__all__ = [
    "AXES",
    "CheckpointConfig",
    "CompilerConfig",
    "CompressionConfig",
    "Config",
    "ContextConfig",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "HostSplit",
    "Layout",
    "MeshConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PipelineConfig",
    "PipelineStages",
    "Preempted",
    "Rules",
    "RulesConfig",
    "TensorConfig",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "TrainingStopped",
    "ZeroConfig",
    "apply_overrides",
    "build",
    "run",
    "compute_value",
    "constrain",
    "default_rules",
    "force_cpu_devices",
    "make_mesh",
    "use_layout",
    "validate",
]
