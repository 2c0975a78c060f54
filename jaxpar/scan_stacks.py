"""A scan's stacked outputs allocated without a fill (compiler.uninitialised_stacks).

jax.lax.scan writes each step's outputs into stacks it first fills with zeros: a layer loop's
saved activations (the residuals its backward pass reads) and, in the backward loop, each
layer's weight gradient. Each slot is written by its own step before anything reads it, so
the fill is a pass over every byte of every stack that buys nothing: 18.3 GB, 6.5 ms of the
0.9B Llama's 190 ms step on an H100 (benchmarks/step_kernels.py, the deviceless compile).

jax has the allocation without one: `lax.empty`, XLA's AllocateBuffer, which launches no
kernel on a GPU. Its scan does not use it yet (a TODO in jax/_src/lax/control_flow/loops.py
waits on XLA), so `set_uninitialised(True)` puts a private function of jax's scan, the one
that makes a stack, in the place of jax's: process-wide, for every scan lowered after it. On
the CPU lax.empty lowers to the same zeros, so only a GPU's (or TPU's) program changes.

One device only (jaxpar.checks refuses more): XLA's SPMD partitioner does not split an
AllocateBuffer, so on a mesh each device would allocate every stack whole and copy its
share out of it (the 8-device recipes' temporaries grow up to 4.3x). Being process-wide, a
process that also builds trainers on a mesh should leave it off: a mesh trainer built
before it was turned on recompiles (the caches are emptied) with it on.

What it costs on one device: two stacks of the same value (residuals XLA would merge while
both were zero-filled) stay two; the 0.9B step under remat none keeps the attention's output
twice, 1 GiB and a 0.8 ms stack write more (docs/performance.md).
"""

from __future__ import annotations

import inspect

import jax

from jaxpar.errors import ConfigError

_original = None  # jax's own stack maker, once replaced


def _scan_internals():
    """jax's scan module, if it makes its stacks the way this module replaces, else None."""
    try:
        from jax._src.lax.control_flow import loops
    except ImportError:
        return None
    made = getattr(loops, "_empty_array", None)
    if made is None or list(inspect.signature(made).parameters) != ["prefix", "length_spec", "aval"]:
        return None
    return loops


def _uninitialised_stack(prefix: tuple, length_spec: tuple, aval):
    """What jax's _empty_array makes (the stack of `aval` with `prefix` leading dimensions,
    sharded as aval is along the rest), allocated by lax.empty instead of filled with zeros.
    Host-resident stacks (remat=offload) keep jax's: lax.empty has no memory space."""
    from jax._src import core
    from jax._src.mesh import get_abstract_mesh, use_abstract_mesh

    if getattr(aval, "memory_space", core.MemorySpace.Device) != core.MemorySpace.Device:
        return _original(prefix, length_spec, aval)
    mesh = get_abstract_mesh() if aval.sharding.mesh.empty else aval.sharding.mesh
    sharding = aval.sharding.update(mesh=mesh, spec=aval.sharding.spec.update(
        partitions=(*length_spec, *aval.sharding.spec.partitions)))
    with use_abstract_mesh(sharding.mesh):
        stack = jax.lax.empty((*prefix, *aval.shape), aval.dtype, out_sharding=sharding)
    return core.pvary(stack, tuple(aval.mat.varying))


def set_uninitialised(on: bool) -> None:
    """Every scan lowered from now on allocates its stacks uninitialised (on) or zero-filled
    as jax does (off); a change empties jax's caches, whose lowerings hold the stacks as they
    were. A jax whose scan this module does not know is refused when `on`."""
    global _original
    if on == uninitialised():
        return
    if on:
        loops = _scan_internals()
        if loops is None:
            raise ConfigError(f"compiler.uninitialised_stacks=true: jax {jax.__version__} makes a scan's stacks "
                              "in a way jaxpar does not know how to replace; set it false")
        _original, loops._empty_array = loops._empty_array, _uninitialised_stack
    else:
        from jax._src.lax.control_flow import loops

        loops._empty_array, _original = _original, None
    jax.clear_caches()  # a function lowered before would keep its stacks as they were


def uninitialised() -> bool:
    """Whether scans lowered now get uninitialised stacks."""
    return _original is not None
