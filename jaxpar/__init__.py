"""jaxpar: every classic form of parallelism, composable on one named-axis mesh."""

from jaxpar.config import Config, DataConfig, OptimConfig, ParallelConfig, TrainConfig, apply_overrides, validate
from jaxpar.errors import ConfigError
from jaxpar.mesh import AXES, HostSplit, MeshConfig, force_cpu_devices, make_mesh
from jaxpar.sharding import Layout, Rules, compute_value, constrain, default_rules, use_layout
from jaxpar.train import Trainer, TrainState, build

__all__ = [
    "AXES",
    "Config",
    "ConfigError",
    "DataConfig",
    "HostSplit",
    "Layout",
    "MeshConfig",
    "OptimConfig",
    "ParallelConfig",
    "Rules",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "apply_overrides",
    "build",
    "compute_value",
    "constrain",
    "default_rules",
    "force_cpu_devices",
    "make_mesh",
    "use_layout",
    "validate",
]
