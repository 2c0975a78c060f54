"""Testing tools for jaxpar users too.

  * pytest plugin (`-p jaxpar.testing`, or `pytest_plugins = ["jaxpar.testing"]` in a
    conftest): forces N CPU devices before JAX starts (ini option `jaxpar_cpu_devices`,
    default 8), so layouts for a GPU host run on a laptop.
  * `compare_layouts` / `assert_equivalent`: train one config under two layouts from the
    same initial parameters and data and compare losses, first-step gradients and
    parameters after N steps.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from jaxpar.config import Config, apply_overrides
from jaxpar.data.sources import make_source
from jaxpar.mesh import MeshConfig


def force_cpu_devices(n: int) -> None:
    """Give the CPU backend `n` devices. Must run before JAX initialises its backends."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # backends already up: say so plainly rather than run on fewer
        if len(jax.devices("cpu")) != n:
            raise RuntimeError(f"force_cpu_devices({n}) came after JAX started with {len(jax.devices('cpu'))} CPU devices") from e


def pytest_addoption(parser) -> None:
    parser.addini("jaxpar_cpu_devices", "CPU devices jaxpar.testing forces before JAX starts", default="8")


def pytest_configure(config) -> None:
    force_cpu_devices(int(config.getini("jaxpar_cpu_devices")))


@dataclasses.dataclass
class Comparison:
    losses: tuple[list[float], list[float]]
    loss_error: float  # max |a - b| / |b| over steps
    grad_error: float  # max over parameters of ||a - b||_inf / ||b||_inf, first step
    param_error: float  # the same, after the last step

    def worst(self) -> float:
        return max(self.loss_error, self.grad_error, self.param_error)


def single_device(config: Config) -> tuple[Config, list[jax.Device]]:
    """The reference: the same config on one device, every mesh axis 1."""
    return dataclasses.replace(config, mesh=MeshConfig(data=1)), jax.devices()[:1]


def run_layout(config: Config, devices: Sequence[jax.Device], steps: int):
    from jaxpar.train import build

    trainer = build(config, devices)
    source = make_source(trainer)
    state = trainer.init()
    _, grads = trainer.grads(state.params, source(0))
    grads = jax.device_get(grads)
    losses = []
    for i in range(steps):
        state, metrics = trainer.step(state, source(i))
        losses.append(float(metrics["loss"]))
    return losses, grads, jax.device_get(state.params)


def compare_layouts(
    config: Config,
    layout_a: Sequence[str],
    layout_b: Sequence[str] | None = None,
    steps: int = 3,
) -> Comparison:
    """Train `config` with overrides `layout_a` on all devices and with `layout_b` (default:
    the single-device reference) and measure how far apart they end up."""
    config_a = apply_overrides(config, list(layout_a))
    if layout_b is None:
        config_b, devices_b = single_device(config)
    else:
        config_b, devices_b = apply_overrides(config, list(layout_b)), jax.devices()
    la, ga, pa = run_layout(config_a, jax.devices(), steps)
    lb, gb, pb = run_layout(config_b, devices_b, steps)
    return Comparison(
        losses=(la, lb),
        loss_error=max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(la, lb)),
        grad_error=tree_error(ga, gb),
        param_error=tree_error(pa, pb),
    )


def tree_error(a, b) -> float:
    """Max over leaves of ||a - b||_inf / ||b||_inf (normwise relative error)."""
    errs = jax.tree.map(
        lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        / max(float(np.max(np.abs(np.asarray(y, np.float64)))), 1e-30),
        a,
        b,
    )
    return max(jax.tree.leaves(errs))


def assert_equivalent(
    config: Config,
    layout_a: Sequence[str],
    layout_b: Sequence[str] | None = None,
    steps: int = 3,
    rtol: float = 1e-5,
    param_rtol: float | None = None,
) -> Comparison:
    """compare_layouts, asserting losses and gradients within `rtol` and parameters after
    `steps` within `param_rtol` (default `rtol`)."""
    c = compare_layouts(config, layout_a, layout_b, steps)
    param_rtol = rtol if param_rtol is None else param_rtol
    where = f"{list(layout_a)} vs {list(layout_b) if layout_b is not None else 'single device'}"
    assert c.loss_error <= rtol, f"{where}: losses differ by {c.loss_error:.2e} > {rtol:.0e}: {c.losses}"
    assert c.grad_error <= rtol, f"{where}: gradients differ by {c.grad_error:.2e} > {rtol:.0e}"
    assert c.param_error <= param_rtol, f"{where}: parameters differ by {c.param_error:.2e} > {param_rtol:.0e}"
    return c
