"""The compiled step against a device's memory (jaxpar.loop.fits) and the GPU memory share
jaxpar's commands give JAX's allocator (jaxpar.device_memory.share_gpu_memory)."""

import os
import types

import jax
import jax.numpy as jnp
import pytest

from jaxpar.errors import ConfigError
from jaxpar.device_memory import DEVICE_MEMORY_SHARE, MEMORY_FRACTION_VARIABLE, share_gpu_memory, step_bytes
from jaxpar.loop.fits import check_fits, fit_problem
from jaxpar.plan import RUNTIME_SHARE

GIB = 2**30


def stats(arguments=40, outputs=40, temps=20, aliased=40):
    """A memory_analysis in GiB: by default 40 GiB of donated state and 20 of temporaries."""
    return types.SimpleNamespace(argument_size_in_bytes=arguments * GIB, output_size_in_bytes=outputs * GIB,
                                 temp_size_in_bytes=temps * GIB, alias_size_in_bytes=aliased * GIB)


class Device:
    """A device as jax.Device reports its allocator: `limit` bytes, or no stats (CPUs)."""

    def __init__(self, limit=None):
        self.limit = limit
        self.platform = "cpu" if limit is None else "gpu"

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit, "bytes_in_use": 0}

    def __str__(self):
        return "cuda:0"


def test_a_step_within_the_allocator_fits():
    assert step_bytes(stats()) == 60 * GIB
    assert fit_problem(stats(), 60 * GIB, "cuda:0") is None


def test_a_step_beyond_it_is_refused_with_its_figures_and_what_works(monkeypatch):
    monkeypatch.delenv(MEMORY_FRACTION_VARIABLE, raising=False)
    problem = fit_problem(stats(temps=22), int(59.7 * GIB), "cuda:0")
    assert "needs 62.00 GiB on each device" in problem
    assert "22.00 GiB of temporaries" in problem and "40.00 GiB of arguments" in problem
    assert "holds 59.70 GiB (JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION=0.75)" in problem
    assert "model.remat=dots or full" in problem and "mesh.fsdp" in problem and "jaxpar explain" in problem
    monkeypatch.setenv(MEMORY_FRACTION_VARIABLE, "0.5")
    assert "(XLA_PYTHON_CLIENT_MEM_FRACTION=0.5)" in fit_problem(stats(temps=22), 40 * GIB, "cuda:0")


def test_check_fits_reads_the_compiled_program_and_the_device():
    compiled = jax.jit(lambda x: jnp.outer(x, x).sum(0)).lower(jnp.ones(1024, jnp.float32)).compile()
    need = step_bytes(compiled.memory_analysis())
    assert need >= 4 * 1024  # at least its argument
    check_fits(compiled, Device())  # no allocator limit reported (a CPU): nothing to check
    check_fits(compiled, Device(need))
    with pytest.raises(ConfigError, match=r"the compiled step needs .* but JAX's allocator on cuda:0 holds"):
        check_fits(compiled, Device(need - 1))


def test_the_commands_give_the_allocator_what_the_planner_budgets(monkeypatch):
    assert RUNTIME_SHARE == DEVICE_MEMORY_SHARE == 0.9
    monkeypatch.delenv(MEMORY_FRACTION_VARIABLE, raising=False)
    share_gpu_memory()
    assert float(os.environ[MEMORY_FRACTION_VARIABLE]) == DEVICE_MEMORY_SHARE
    monkeypatch.setenv(MEMORY_FRACTION_VARIABLE, "0.6")  # the user's own setting wins
    share_gpu_memory()
    assert os.environ[MEMORY_FRACTION_VARIABLE] == "0.6"


class Deviceless:
    """A GPU compiled for without one (jaxpar.deviceless): no allocator to ask."""

    platform = "gpu"

    def memory_stats(self):
        raise RuntimeError("a topology device holds no memory")


def test_the_allocator_a_device_reports_or_a_deviceless_target_share(monkeypatch):
    from jaxpar import deviceless
    from jaxpar.device_memory import allocator_bytes

    assert allocator_bytes(Device()) is None  # a CPU: nothing to check against
    assert allocator_bytes(Device(5 * GIB)) == 5 * GIB  # what the GPU says
    monkeypatch.setattr(deviceless, "_TARGET_MEMORY", [None])
    assert allocator_bytes(Deviceless()) is None
    monkeypatch.setattr(deviceless, "_TARGET_MEMORY", [80 * GIB])  # benchmarks/targets/h100.pbtxt's size
    monkeypatch.delenv(MEMORY_FRACTION_VARIABLE, raising=False)
    assert allocator_bytes(Deviceless()) == int(80 * GIB * DEVICE_MEMORY_SHARE)
    monkeypatch.setenv(MEMORY_FRACTION_VARIABLE, "0.75")
    assert allocator_bytes(Deviceless()) == 60 * GIB


def test_explain_says_when_the_total_does_not_fit():
    from jaxpar.inspect.model_state import memory_lines

    doc = {"memory": [], "memory_formula": "f", "fits": False}
    assert any(line.startswith("  does not fit: the total is above what JAX's allocator holds")
               for line in memory_lines(doc))
    for fits in (True, None):  # fits, or no allocator to check (CPUs)
        assert not any("does not fit" in line for line in memory_lines({**doc, "fits": fits}))
