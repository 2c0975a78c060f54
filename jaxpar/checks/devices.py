"""The mesh against the device count: the first rule, which resolves the axis sizes every
later rule reads."""

from __future__ import annotations

from jaxpar.checks.rule import Rule, collector
from jaxpar.mesh import AXES

RULES: list[Rule] = []
rule = collector(RULES)


# MeshConfig.resolve also builds every mesh (make_mesh), so its five checks stay there and
# this rule wraps them; `also` breaks each of the others.
@rule(
    "mesh-fits-devices",
    fields=[f"mesh.{a}" for a in AXES] + ["mesh.hosts"],
    summary="The mesh axis sizes are positive (or one of them -1, which fills) and multiply to the device count; "
    "each mesh.hosts.<axis> divides its axis.",
    example=["mesh.data=4"],
    also=[["mesh.tensor=0"], ["mesh.fsdp=-1"], ["mesh.tensor=3"], ["mesh.hosts.tensor=2"]],
    needs="devices",
)
def mesh_fits_devices(config, num_devices: int) -> dict[str, int]:
    return config.mesh.resolve(num_devices)
