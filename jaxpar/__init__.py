"""jaxpar: every classic form of parallelism, composable on one named-axis mesh."""

from jaxpar.config import (
    CheckpointConfig,
    CompilerConfig,
    Config,
    DataConfig,
    DistributedConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
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
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "HostSplit",
    "Layout",
    "MeshConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PipelineStages",
    "Preempted",
    "Rules",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "TrainingStopped",
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
