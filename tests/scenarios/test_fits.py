"""A step the device cannot hold is refused after its compile, before its state is made."""

import dataclasses

import pytest

from jaxpar.errors import ConfigError
from jaxpar.loop import fits, run as loop
from jaxpar.train import build


def test_run_refuses_a_step_its_device_cannot_hold(tiny_llama, monkeypatch):
    class Small:  # the run's device as a GPU reports its allocator: 1 KiB
        def memory_stats(self):
            return {"bytes_limit": 1024}

        def __str__(self):
            return "cuda:0"

    checked = []
    monkeypatch.setattr(loop, "check_fits", lambda compiled, device: checked.append(device) or
                        fits.check_fits(compiled, Small()))
    monkeypatch.setattr(loop, "starting_state", lambda *a: pytest.fail("the state was made before the check"))
    train = dataclasses.replace(tiny_llama.train, steps=1)
    trainer = build(dataclasses.replace(tiny_llama, train=train))
    with pytest.raises(ConfigError, match="the compiled step needs .* on cuda:0 holds 1.00 KiB"):
        loop.run(trainer, progress=False)
    assert checked == [trainer.mesh.devices.flat[0]]  # this process's first device
