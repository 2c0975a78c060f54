"""Model shapes the planner knows by name, and the hardware it predicts for."""

from __future__ import annotations

import dataclasses

from jaxpar.families import View, presets

# The registered model families' presets (jaxpar.families.register; the shipped ones in
# models/llama.py and models/moe.py).
MODELS = View(presets)


def tf32_share(dtype: str) -> float:
    """A matmul's rate in `dtype` as a share of the bf16 peak's: float32 multiplies as TF32,
    at half of it."""
    return 0.5 if dtype == "float32" else 1.0


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the roofline assumes per device (defaults: H100 SXM, reference.md)."""

    name: str = "H100 SXM"
    peak_tflops: float = 989.0  # dense bf16
    matmul_efficiency: float = 0.8  # a large bf16 matmul reaches about 790 TFLOP/s
    hbm_gb_per_s: float = 3350.0
    intra_host_gb_per_s: float = 450.0  # NVLink, per direction
    inter_host_gb_per_s: float = 50.0  # one 400 Gb/s NIC per GPU
    devices_per_host: int = 8
    # Host memory to the device (parameters resting on the host): PCIe Gen5 x16 carries
    # 64 GB/s per direction; 50 is an assumption of what a copy reaches until a GPU measures it.
    host_link_gb_per_s: float = 50.0
    # Between mesh.data's replicas where they sit in different clusters or datacenters
    # (`jaxpar plan --group-link-gbit`): GB/s per device; 0: they meet over the hosts' links.
    group_link_gb_per_s: float = 0.0
    # Shares of collective time hidden behind compute: the data-parallel axes' gathers and
    # reductions are scheduled behind other layers' matmuls (the overlap preset); the
    # tensor, context and expert collectives sit on the critical path between matmuls.
    overlap_data: float = 0.9
    overlap_model: float = 0.0

    def matmul_flops_per_s(self, dtype: str) -> float:
        """What a matmul in `dtype` reaches: the bf16 peak at the matmul efficiency, half of
        it for float32, which multiplies as TF32 (jaxpar.inspect.cost.GpuCost.tf32_tflops)."""
        return self.peak_tflops * 1e12 * self.matmul_efficiency * tf32_share(dtype)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.peak_tflops:g} TFLOP/s bf16 peak, matmuls at {self.matmul_efficiency:.0%} of it, "
            f"HBM {self.hbm_gb_per_s / 1000:g} TB/s, {self.intra_host_gb_per_s:g} GB/s inside a host of "
            f"{self.devices_per_host}, {self.inter_host_gb_per_s:g} GB/s per device across hosts, "
            f"{self.host_link_gb_per_s:g} GB/s between host memory and a device; "
            + (f"{self.group_link_gb_per_s * 8:g} Gb/s per device between mesh.data's replicas (DiLoCo's exchange "
               "there not hidden); " if self.group_link_gb_per_s else "")
            + f"{self.overlap_data:.0%} of data/fsdp collective time and {self.overlap_model:.0%} of "
            "tensor/context/expert time hidden behind compute (host copies: as data/fsdp's)"
        )
