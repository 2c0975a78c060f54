"""Checkpoints (jaxpar.train.checkpoint): exact resume, restore onto another layout and
device count, keep-last-k, atomic saves, no pickles."""

import pickle

import jax
import numpy as np
import pytest

from jaxpar.config import apply_overrides
from jaxpar.errors import ConfigError
from jaxpar.train import build
from jaxpar.train.checkpoint import Checkpoints
from jaxpar.train.loop import run


def _losses(history):
    return [r["loss"] for r in history]


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


# bfloat16: fp32 master weights saved too; fp8: its scales are taken afresh each step, so
# nothing of FP8's is saved, and resuming must still repeat the losses
@pytest.mark.parametrize("compute_dtype, matmul_dtype", [("float32", "compute"), ("bfloat16", "compute"),
                                                         ("bfloat16", "fp8")])
def test_resumed_run_repeats_the_uninterrupted_one_bitwise(tiny_llama, tmp_path, compute_dtype, matmul_dtype):
    config = apply_overrides(tiny_llama, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.steps=4",
                                          f"train.compute_dtype={compute_dtype}", f"train.matmul_dtype={matmul_dtype}"])
    whole = run(build(config), progress=False)
    saving = apply_overrides(config, [f"checkpoint.dir={tmp_path}", "checkpoint.every=1"])
    first = run(build(saving), steps=2, progress=False)  # "killed" after step 2
    assert Checkpoints.open(tmp_path).all_steps() == [1, 2]
    rest = run(build(saving), progress=False)  # resumes at step 2, data position included
    assert [r["step"] for r in rest] == [2, 3]
    assert _losses(first) + _losses(rest) == _losses(whole)  # bitwise


def test_written_under_fsdp8_restored_under_data2_tensor2_on_four_devices(tiny_llama, tmp_path):
    a = build(apply_overrides(tiny_llama, ["mesh.data=1", "mesh.fsdp=8", f"checkpoint.dir={tmp_path}", "train.steps=2"]))
    run(a, progress=False)
    saved, _ = Checkpoints.open(tmp_path).restore(a)
    b_config = apply_overrides(tiny_llama, ["mesh.data=2", "mesh.tensor=2", f"checkpoint.dir={tmp_path}", "train.steps=3"])
    b = build(b_config, jax.devices()[:4])
    state, step = Checkpoints.open(tmp_path).restore(b)
    assert step == 2
    jax.tree.map(np.testing.assert_array_equal, _host(state.params), _host(saved.params))
    jax.tree.map(np.testing.assert_array_equal, _host(state.opt_state), _host(saved.opt_state))
    assert jax.tree.leaves(state.params)[0].sharding == jax.tree.leaves(b.state_shardings.params)[0]
    history = run(b, progress=False)  # trains on from step 2
    assert [r["step"] for r in history] == [2] and np.isfinite(history[0]["loss"])


def test_keeps_the_newest_and_a_half_written_save_is_not_a_checkpoint(tiny_llama, tmp_path):
    config = apply_overrides(
        tiny_llama, ["mesh.data=8", f"checkpoint.dir={tmp_path}", "checkpoint.every=1", "checkpoint.keep=2", "train.steps=3"]
    )
    trainer = build(config)
    run(trainer, progress=False)
    assert Checkpoints.open(tmp_path).all_steps() == [2, 3]
    # what a save killed midway leaves: orbax's temporary directory, renamed only when complete
    partial = tmp_path / "4.orbax-checkpoint-tmp-1700000000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "junk").write_bytes(b"\x00" * 10)
    checkpoints = Checkpoints.open(tmp_path)
    assert checkpoints.latest_step() == 3 and not partial.exists()
    assert checkpoints.restore(trainer)[1] == 3


def test_restore_never_unpickles(tiny_llama, tmp_path, monkeypatch):
    config = apply_overrides(tiny_llama, ["mesh.data=8", f"checkpoint.dir={tmp_path}", "train.steps=1"])
    trainer = build(config)
    run(trainer, progress=False)

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    assert Checkpoints.open(tmp_path).restore(trainer)[1] == 1


def test_interleaved_pipeline_checkpoints_in_model_order(tiny_llama, tmp_path):
    """Interleaved stages store strided layers (here 6 layers as 2 stages x 3 chunks, an
    order that is not its own inverse). A checkpoint of their state after one step restores
    onto a layout without stages as that layout's own state after the same step: parameters
    and optimizer state, to fp32 rounding."""
    from jaxpar.data.sources import make_source
    from jaxpar.testing import tree_error

    deep = apply_overrides(tiny_llama, ["model.num_layers=6", "train.microbatches=2"])
    piped = build(apply_overrides(deep, ["mesh.stage=2", "mesh.data=4", "parallel.pipeline_schedule=interleaved",
                                         "parallel.pipeline_chunks=3"]))
    flat = build(apply_overrides(deep, ["mesh.data=8"]))
    state, _ = piped.step(piped.init(), make_source(piped)(0))
    Checkpoints.open(tmp_path).save(piped, state, 1)
    want, _ = flat.step(flat.init(), make_source(flat)(0))
    got, step = Checkpoints.open(tmp_path).restore(flat)
    assert step == 1
    assert tree_error(_host(got.params), _host(want.params)) <= 1e-5
    assert tree_error(_host(got.opt_state), _host(want.opt_state)) <= 1e-5


def test_bad_checkpoint_settings_are_refused(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.keep=0"):
        build(apply_overrides(tiny_llama, ["mesh.data=8", "checkpoint.keep=0"]))
    with pytest.raises(ConfigError, match="checkpoint.every=-1"):
        build(apply_overrides(tiny_llama, ["mesh.data=8", "checkpoint.every=-1"]))
    trainer = build(apply_overrides(tiny_llama, ["mesh.data=8"]))
    with pytest.raises(ConfigError, match="has no checkpoint"):
        Checkpoints.open(tmp_path).restore(trainer)


# ------------------------------------------------------------------ killed with SIGKILL

TINY = ["model.num_layers=1", "train.seq_len=32", "train.global_batch=16", "train.compute_dtype=float32",
        "train.steps=8", "mesh.data=4", "mesh.tensor=2"]


def _train_process(metrics, ckpt=None, kill_at_save=None):
    """`jaxpar train` in a child process; with `kill_at_save`, one that SIGKILLs itself inside
    that step's save (tests/kill_during_save.py)."""
    import os
    import subprocess
    import sys

    sets = TINY + ([f"checkpoint.dir={ckpt}", "checkpoint.every=1"] if ckpt else [])
    entry, env = ["-m", "jaxpar.cli"], dict(os.environ)
    if kill_at_save is not None:
        entry, env["JAXPAR_TEST_KILL_AT_SAVE"] = [os.path.join(os.path.dirname(__file__), "kill_during_save.py")], str(kill_at_save)
    cmd = [sys.executable, *entry, "train", "llama", "--no-progress", "--metrics-file", str(metrics)]
    return subprocess.Popen(cmd + [x for s in sets for x in ("--set", s)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _rows(path):
    import json

    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _saving(ckpt):
    return ckpt.exists() and any(".orbax-checkpoint-tmp" in p.name for p in ckpt.iterdir())


def _killed_at_step(kill_point, metrics, ckpt):
    """SIGKILL from outside once `kill_point` steps are logged: wherever the run then is."""
    import os
    import signal
    import time

    proc = _train_process(metrics, ckpt)
    deadline = time.monotonic() + 600
    while len(_rows(metrics)) < kill_point:
        assert proc.poll() is None, f"the run ended before step {kill_point}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"no step {kill_point} in 600 s"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_killed_anywhere_and_resumed_repeats_the_uninterrupted_losses_bitwise(tmp_path):
    """SIGKILL after two steps drawn at random (seeded), and inside a save (the process kills
    itself between orbax writing the arrays and the rename that commits them); the resumed
    run really resumes (it says from which step) and its losses equal the uninterrupted
    run's at every step."""
    import random
    import re
    import signal

    reference = tmp_path / "reference.jsonl"
    proc = _train_process(reference)
    assert proc.wait(timeout=600) == 0, proc.stderr.read()[-2000:]
    want = {r["step"]: r["loss"] for r in _rows(reference)}
    assert sorted(want) == list(range(8))

    for kill_point in (*random.Random(0).sample(range(1, 7), 2), "inside the save of step 3"):
        ckpt, metrics = tmp_path / f"ckpt-{kill_point}", tmp_path / f"run-{kill_point}.jsonl"
        if isinstance(kill_point, int):
            _killed_at_step(kill_point, metrics, ckpt)
        else:
            proc = _train_process(metrics, ckpt, kill_at_save=3)
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == -signal.SIGKILL, err[-2000:]
            assert _saving(ckpt) and not (ckpt / "3").exists(), sorted(p.name for p in ckpt.iterdir())
        resumed = _train_process(metrics, ckpt)
        out, err = resumed.communicate(timeout=600)
        assert resumed.returncode == 0, err[-2000:]
        start = int(re.search(r"resumed from step (\d+)", out).group(1))
        assert start >= 1, out
        rows = _rows(metrics)
        assert [r["step"] for r in rows] == list(range(8)), kill_point  # the lost run's extra rows replaced
        for r in rows:
            assert r["loss"] == want[r["step"]], (kill_point, r["step"])


def test_a_checkpoint_dir_that_is_a_file_is_refused(tmp_path):
    """Orbax retried and then hung on it; one line now, before anything compiles."""
    from jaxpar.errors import ConfigError
    from jaxpar.train.checkpoint import Checkpoints

    path = tmp_path / "not_a_folder"
    path.write_text("")
    with pytest.raises(ConfigError, match="checkpoint.dir=.*is a file, not a folder"):
        Checkpoints.open(path)


def test_an_unreadable_latest_step_is_set_aside_for_the_newest_intact_one(tiny_llama, tmp_path):
    """A truncated save (its array files cut short) is passed over with a warning naming it;
    the run resumes exactly from the step before and saves the lost step again."""
    import dataclasses

    from jaxpar.config import CheckpointConfig
    from jaxpar.train import build, run
    from jaxpar.train.checkpoint import UnreadableCheckpoint

    config = dataclasses.replace(tiny_llama, checkpoint=CheckpointConfig(dir=str(tmp_path), every=2, async_save=False))
    whole = [r["loss"] for r in run(build(config), steps=4, progress=False)]  # saves steps 2 and 4
    for f in (tmp_path / "4" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[:10])
    with pytest.warns(UnreadableCheckpoint, match=r"step 4 \(.*\) cannot be read .*resuming from step 2"):
        resumed = [r["loss"] for r in run(build(config), steps=4, progress=False)]
    assert resumed == whole[2:], (resumed, whole)
    assert (tmp_path / "4.unreadable").is_dir() and (tmp_path / "4").is_dir()
