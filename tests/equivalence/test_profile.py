"""train.profile_steps: a jax.profiler trace of the chosen steps, in TensorBoard's layout."""

import dataclasses

import pytest

from jaxpar.errors import ConfigError
from jaxpar.train import build
from jaxpar.loop.run import run
from jaxpar.config import parse_steps


def test_trace_of_the_chosen_steps(tiny_llama, tmp_path, capsys):
    folder = tmp_path / "trace"
    train = dataclasses.replace(tiny_llama.train, steps=3, profile_steps="1:3", profile_dir=str(folder))
    rows = run(build(dataclasses.replace(tiny_llama, train=train)), progress=False)
    assert len(rows) == 3
    traces = list(folder.glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert "wrote the trace of steps 2-3" in capsys.readouterr().out  # after 1 step done, through step 3


@pytest.mark.parametrize("spec", ["3", "a:b", "4:2", "-1:2"])
def test_bad_windows_refused(spec):
    with pytest.raises(ConfigError, match="train.profile_steps"):
        parse_steps(spec)


def test_profile_dir_that_is_a_file_refused_before_compile(tiny_llama, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    train = dataclasses.replace(tiny_llama.train, profile_steps="0:1", profile_dir=str(blocker))
    with pytest.raises(ConfigError, match="train.profile_dir"):
        run(build(dataclasses.replace(tiny_llama, train=train)), progress=False)
