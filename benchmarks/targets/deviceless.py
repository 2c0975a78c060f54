"""Devices to compile for GPUs that are not there: XLA's GPU compiler, from the CUDA plugin
(pip install 'jax[cuda13]'), targets GPUs described by a GpuTargetConfig file (h100.pbtxt)
on a machine without one. Nothing can run on these devices; programs only compile."""

from __future__ import annotations

import os
import pathlib
import sys


def gpu_devices(target: str, topology: str = "1x1x1") -> list:
    """`topology` (slices x hosts x devices) GPUs as `target` describes them. JAX reads the
    environment this sets when it is first imported, so call this before anything imports it."""
    if "jax" in sys.modules:
        raise RuntimeError("gpu_devices: call it before jax is imported (it sets JAX_PLATFORMS for the plugin)")
    # The CUDA plugin registers without a GPU only if it neither starts a CUDA backend nor
    # checks the runtime libraries against a driver that is not there.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    from jax.experimental import topologies

    text = pathlib.Path(target).read_text()
    return topologies.get_topology_desc("jaxpar", "cuda", target_config=text, topology=topology).devices
