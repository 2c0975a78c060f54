import os
import jax
import numpy as np
import pytest

from jaxpar.errors import ConfigError
from jaxpar.mesh import AXES, HostSplit, MeshConfig, force_cpu_devices, make_mesh


def test_cpu_devices_get_two_runtime_threads_each_unless_the_user_chose(monkeypatch):
    """Fewer pool threads than blocked collectives deadlocks XLA's CPU runtime (FSDP x ring
    aborted on half the runs of a 2-core machine): force_cpu_devices sizes the pool, read
    when the client starts (this process's was sized by conftest's force_cpu_devices(8))."""
    for name in ("PJRT_NPROC", "NPROC"):
        monkeypatch.delenv(name, raising=False)
    force_cpu_devices(8)  # JAX has started with 8: the size is checked, the pool left as it is
    assert int(os.environ["PJRT_NPROC"]) >= 16
    monkeypatch.setenv("PJRT_NPROC", "3")
    force_cpu_devices(8)
    assert os.environ["PJRT_NPROC"] == "3"


def test_fill_axis_takes_the_rest():
    assert MeshConfig(fsdp=2, tensor=2).resolve(8) == dict(stage=1, data=2, fsdp=2, expert=1, context=1, tensor=2)
    assert MeshConfig(data=1, fsdp=-1).resolve(8)["fsdp"] == 8


@pytest.mark.parametrize(
    "mesh, devices, message",
    [
        (MeshConfig(data=2, fsdp=2, tensor=4), 8, "multiplies to 16, but there are 8 devices"),
        (MeshConfig(data=-1, tensor=3), 8, "mesh.tensor=3 does not divide the 8 devices"),
        (MeshConfig(data=-1, fsdp=-1), 8, "only one axis may be -1"),
        (MeshConfig(data=0), 8, "mesh.data=0 is not a valid axis size"),
        (MeshConfig(data=4, tensor=2, hosts=HostSplit(data=3)), 8, "mesh.hosts.data=3 does not divide mesh.data=4"),
    ],
)
def test_bad_mesh_is_named(mesh, devices, message):
    with pytest.raises(ConfigError, match=message):
        mesh.resolve(devices)


@pytest.mark.parametrize(
    "mesh, devices, message",
    [
        (MeshConfig(tensor=3), 8, ("mesh.tensor=3 does not divide the 8 devices (mesh.data=-1 takes what the set "
                                   "axes leave); use mesh.tensor in [1, 2, 4, 8]")),
        (MeshConfig(tensor=4), 6, ("mesh.tensor=4 does not divide the 6 devices (mesh.data=-1 takes what the set "
                                   "axes leave); use mesh.tensor in [1, 2, 3, 6]")),
        (MeshConfig(fsdp=2, tensor=3), 8, ("mesh.fsdp=2 x mesh.tensor=3 = 6 does not divide the 8 devices "
                                           "(mesh.data=-1 takes what the set axes leave); use mesh.tensor in [1, 2, 4]")),
    ],
)
def test_axes_that_leave_no_whole_fill_are_named_with_sizes_that_fit(mesh, devices, message):
    """The axes the user set, not the -1 axis they did not touch, and sizes to use instead."""
    with pytest.raises(ConfigError) as info:
        mesh.resolve(devices)
    assert str(info.value) == message


def test_mesh_has_canonical_axes_and_all_devices():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert mesh.axis_names == AXES
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_hybrid_mesh_keeps_inner_axes_inside_a_host():
    # 2 simulated hosts of 4 devices: data = 2 across hosts x 2 within, tensor within.
    mesh = make_mesh(MeshConfig(data=4, tensor=2, hosts=HostSplit(data=2)))
    host_of = {d.id: i // 4 for i, d in enumerate(sorted(jax.devices(), key=lambda d: d.id))}
    grid = np.vectorize(lambda d: host_of[d.id])(mesh.devices).reshape(4, 2)  # [data, tensor]
    assert (grid[:, 0] == grid[:, 1]).all(), "a tensor group spans hosts"
    assert list(grid[:, 0]) == [0, 0, 1, 1], "data's outer (across-host) part must be outermost"


def test_hosts_must_match_processes_when_they_cannot_be_simulated():
    from types import SimpleNamespace

    from jaxpar.mesh import _host_groups

    two_processes = [SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
    assert [[d.id for d in g] for g in _host_groups(two_processes, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ConfigError, match="asks for 4 hosts, but the devices come from 2 processes"):
        _host_groups(two_processes, 4)
