"""Model FLOPs utilisation: achieved training FLOPs over the devices' dense bf16 peak."""

from __future__ import annotations

import jax

# Dense bf16 peak per device, FLOP/s, by substring of `device_kind` (vendor datasheets).
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
}


def peak_flops(device: jax.Device, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device, or None where unknown (the CPU backend)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_BF16.items() if k in kind), None)


def mfu(flops_per_step: float, step_seconds: float, num_devices: int, peak: float | None) -> float | None:
    if peak is None or step_seconds <= 0:
        return None
    return flops_per_step / step_seconds / (peak * num_devices)
