"""Devices to compile for GPUs that are not there: XLA's GPU compiler, from the CUDA plugin
(pip install 'jax[cuda13]'), targets GPUs described by a GpuTargetConfig file
(benchmarks/targets/h100.pbtxt) on a machine without one. Nothing can run on these devices;
programs only compile, and what XLA compiled for the GPU can be read (jaxpar explain
--target, jaxpar.inspect.cost)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re

from jaxpar.errors import ConfigError


def gpu_devices(target: str, topology: str = "1x1x1") -> list:
    """`topology` (slices x hosts x devices) GPUs as the GpuTargetConfig file `target`
    describes them. Call it before JAX starts a backend (importing JAX is fine): the
    plugin must register without starting CUDA."""
    path = pathlib.Path(target)
    if not path.is_file():
        raise ConfigError(f"--target={target!r} is not a file; give a GpuTargetConfig file such as "
                          "benchmarks/targets/h100.pbtxt")
    text = path.read_text()
    if not any(_installed(f"jax_plugins.xla_cuda{v}") for v in (12, 13)):
        raise ConfigError(f"--target={target!r} compiles with XLA's GPU compiler, from JAX's CUDA plugin, which is "
                          "not installed here: pip install 'jax[cuda13]' (no GPU needed)")
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("gpu_devices: call it before JAX starts a backend (jax.devices() and the like)")
    # The CUDA plugin registers without a GPU only if it neither starts a CUDA backend nor
    # checks the runtime libraries against a driver that is not there.
    jax.config.update("jax_platforms", "cpu")
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    from jax.experimental import topologies

    try:
        devices = topologies.get_topology_desc("jaxpar", "cuda", target_config=text, topology=topology).devices
    except Exception as e:  # no plugin, or a file it cannot parse: one line, before any compile
        raise ConfigError(f"--target={target!r}: XLA's GPU compiler could not describe it ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}); it needs the CUDA plugin (pip install 'jax[cuda13]', "
                          "no GPU needed) and a GpuTargetConfig text file") from e
    _attention_checks_see(devices[0].compute_capability)
    memory = re.search(r"device_memory_size:\s*(\d+)", text)
    _TARGET_MEMORY[0] = int(memory.group(1)) if memory else None
    return devices


def target_capability() -> str | None:
    """The compute capability of the GPUs this process compiles for without them, or None
    (no deviceless target: a process on real GPUs, or none)."""
    return _TARGET[0]


_TARGET: list[str | None] = [None]
_TARGET_MEMORY: list[int | None] = [None]


def target_memory() -> int | None:
    """Bytes of memory each GPU this process compiles for without them has (the target
    file's device_memory_size), or None (no deviceless target, or a file without it)."""
    return _TARGET_MEMORY[0]


def _attention_checks_see(capability: str) -> None:
    """JAX decides which cuDNN attention it allows (head dims up to 256 on Hopper, 128
    before) by asking the default backend's GPU, which a deviceless compile runs without
    (its backend is the CPU): point that question at the target's GPU instead, so the
    program is the one JAX builds on that GPU."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    _TARGET[0] = capability
    have = tuple(int(x) for x in capability.split("."))
    cudnn.check_compute_capability = lambda c: have >= tuple(int(x) for x in c.split("."))
    cudnn.is_cuda_compute_capability_equal = lambda c: have == tuple(int(x) for x in c.split("."))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package is not there either
        return False
