"""Checkpoints (jaxpar.loop.checkpoint): exact resume, restore onto another layout and
device count, keep-last-k, atomic saves, no pickles."""

import dataclasses
import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import apply_overrides
from jaxpar.errors import ConfigError
from jaxpar.train import build
from jaxpar.loop.checkpoint import Checkpoints, PartialSaveRemoved
from jaxpar.loop.metrics import JsonLines
from jaxpar.loop.run import run


def _losses(history):
    return [r["loss"] for r in history]


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


# bfloat16 (with FP8 matmuls): fp32 master weights saved beside the bf16 compute; FP8's
# scales are taken afresh each step, so nothing of FP8's is saved, and resuming must still
# repeat the losses
@pytest.mark.parametrize("compute_dtype, matmul_dtype", [pytest.param("float32", "compute", marks=pytest.mark.smoke),
                                                         ("bfloat16", "fp8")])  # smoke: checkpoints
def test_resumed_run_repeats_the_uninterrupted_one_bitwise(tiny_llama, tmp_path, compute_dtype, matmul_dtype):
    config = apply_overrides(tiny_llama, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.steps=4",
                                          f"train.compute_dtype={compute_dtype}", f"train.matmul_dtype={matmul_dtype}"])
    whole = run(build(config), progress=False)
    saving = apply_overrides(config, [f"checkpoint.dir={tmp_path}", "checkpoint.every=1"])
    trainer = build(saving)  # each run resumes from the checkpoint folder, as a new process would
    first = run(trainer, steps=2, progress=False)  # "killed" after step 2
    assert Checkpoints.open(tmp_path).all_steps() == [1, 2]
    rest = run(trainer, progress=False)  # resumes at step 2, data position included
    assert [r["step"] for r in rest] == [3, 4]  # rows count the steps done
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
    assert [r["step"] for r in history] == [3] and np.isfinite(history[0]["loss"])


def test_keeps_the_newest_times_saves_apart_and_a_half_written_save_is_not_a_checkpoint_and_never_unpickles(
        tiny_llama, tmp_path, monkeypatch):
    import time

    config = apply_overrides(
        tiny_llama, ["mesh.data=8", f"checkpoint.dir={tmp_path}", "checkpoint.every=1", "checkpoint.keep=2", "train.steps=3"]
    )
    trainer = build(config)
    save = Checkpoints.save

    def slow_second_save(self, trainer, state, step):
        if step == 2:
            time.sleep(1.5)
        return save(self, trainer, state, step)

    monkeypatch.setattr(Checkpoints, "save", slow_second_save)
    rows = run(trainer, progress=False)
    monkeypatch.undo()
    # a step that saves reports the save apart from its own time
    assert [r["step"] for r in rows] == [1, 2, 3] and all("save_s" in r for r in rows)
    assert rows[1]["save_s"] >= 1.5 > rows[1]["step_time_s"], rows[1]
    assert rows[1]["tokens_per_s"] == pytest.approx(16 * 16 / rows[1]["step_time_s"])

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    for name in ("load", "loads", "Unpickler"):  # from here on: listing, cleaning up and restoring
        monkeypatch.setattr(pickle, name, refuse)
    assert Checkpoints.open(tmp_path).all_steps() == [2, 3]
    # what a save killed midway leaves: orbax's temporary directory, renamed only when complete
    partial = tmp_path / "4.orbax-checkpoint-tmp-1700000000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "junk").write_bytes(b"\x00" * 10)
    assert Checkpoints.open(tmp_path).latest_step() == 3 and partial.exists()  # a reader's open leaves it
    with pytest.warns(PartialSaveRemoved, match=r"removed 4.orbax-checkpoint-tmp-1700000000, a save cut short \(never a "
                      r"checkpoint\); its newest complete checkpoint is step 3"):
        checkpoints = Checkpoints.open(tmp_path, remove_partial=True)  # the run that writes here next
    assert checkpoints.latest_step() == 3 and not partial.exists()
    assert checkpoints.restore(trainer)[1] == 3


def test_a_save_compiles_nothing(tiny_llama, tmp_path):
    """orbax's default splits a shard held by several devices among them, each part cut
    with a jit(slice) compiled per shard shape and device: 528 compiles, 19 s, in the
    deepseek recipe's first save (0.4 s the second). In one process each shard is written
    whole, and a save compiles nothing, here with every array replicated 8 ways (shapes of
    this test's own, which no other test's save can have compiled)."""
    import logging

    config = apply_overrides(tiny_llama, ["mesh.data=8", "model.vocab_size=168", "model.embed=40", "model.head_dim=10",
                                          "model.mlp=88"])
    trainer = build(config)
    state = jax.block_until_ready(trainer.init())
    compiles = []
    report = logging.Handler()
    report.emit = lambda record: compiles.append(record.getMessage().split(" with ")[0])
    logger = logging.getLogger("jax._src.interpreters.pxla")  # "Compiling <fn> with ..." under jax_log_compiles
    logger.addHandler(report)
    try:
        with jax.log_compiles(True):
            saver = Checkpoints.open(tmp_path)
            saver.save(trainer, state, 1)
            saver.close()
    finally:
        logger.removeHandler(report)
    assert [c for c in compiles if c.startswith("Compiling")] == [], compiles
    assert Checkpoints.open(tmp_path).all_steps() == [1]


def test_the_first_stop_signal_names_the_step_the_run_stops_after():
    """jaxpar.loop.stop.StopSignals' handler, called as the signal would call it, at each
    point of the loop's boundary protocol: the step its line names is the step `passed`
    stops at; a second SIGINT raises, a second SIGTERM changes nothing; past the last step
    the line says the run is finishing."""
    import signal

    from jaxpar.loop.stop import StopSignals

    lines = []
    stop = StopSignals(sigterm=True, first=1, last=4, directory="runs/ck", say=lines.append)
    assert not stop.passed(1)  # the next boundary is now 2: a signal from here on stops there
    stop._handle(signal.SIGTERM, None)
    assert lines == ["jaxpar: SIGTERM: stopping after step 2, saving to runs/ck (Ctrl-C again to stop without saving)"]
    stop._handle(signal.SIGTERM, None)  # a second SIGTERM: the stop is fixed already
    assert len(lines) == 1 and stop.after == 2
    assert stop.passed(2) and stop.asked == "SIGTERM"
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)

    unsaved = StopSignals(sigterm=False, first=3, last=4, say=lines.append)  # no checkpoint.dir
    unsaved._handle(signal.SIGINT, None)  # before the first boundary: stops at it
    assert lines[-1] == "jaxpar: SIGINT: stopping after step 3; no checkpoint.dir, nothing will be saved"
    assert unsaved.passed(3)

    last = StopSignals(sigterm=False, first=3, last=4, directory="runs/ck", say=lines.append)
    assert not last.passed(3) and not last.passed(4)  # past the last step: no boundary left
    last._handle(signal.SIGINT, None)
    assert lines[-1] == "jaxpar: SIGINT: the last step is done, finishing its save to runs/ck (Ctrl-C again to stop without waiting)"
    assert last.after is None


def test_interleaved_pipeline_checkpoints_in_model_order(tiny_llama, tmp_path):
    """Interleaved stages store strided layers (here 6 layers as 2 stages x 3 chunks, an
    order that is not its own inverse); a checkpoint holds their state in model order.
    Restored onto the same layout it is the state saved, bitwise (so a resumed run repeats
    the uninterrupted one); onto a layout without stages, or with other stages and chunks,
    it is the same state in that layout's order, bitwise. (Every number of the state is
    made distinct first, optimizer moments too: a misplaced layer cannot pass unseen.)"""
    deep = apply_overrides(tiny_llama, ["model.num_layers=6", "train.microbatches=2"])
    interleaved = ["parallel.pipeline.schedule=interleaved", "parallel.pipeline.chunks=3"]
    piped = build(apply_overrides(deep, ["mesh.stage=2", "mesh.data=4", *interleaved]))
    want = _save_distinct(piped, tmp_path)
    others = [(["mesh.data=8"], 8),
              (["mesh.stage=3", "mesh.data=2", "train.global_batch=24", "train.microbatches=3",
                "parallel.pipeline.schedule=interleaved", "parallel.pipeline.chunks=2"], 6)]
    _restores_alike(tmp_path, want, [piped] + [build(apply_overrides(deep, sets), jax.devices()[:n]) for sets, n in others])


def test_uneven_stages_checkpoint_unpadded_in_model_order(tiny_llama, tmp_path):
    """Stages of different sizes rest padded (jaxpar.pipeline.split); a checkpoint holds the
    6 layers unpadded in model order, in a layout of its own (the layer axis whole, `stage`
    on another dimension), read back bitwise onto the same layout, onto one without stages
    and onto another split, interleaved or not. Neither move gathers a stack onto every
    device: no all-gather, nothing the partitioner replicated."""
    from jaxpar.inspect.findings import compiler_warnings
    from jaxpar.loop.checkpoint import reorder_layers

    deep = apply_overrides(tiny_llama, ["model.num_layers=6", "train.microbatches=2"])
    piped = build(apply_overrides(deep, ["mesh.stage=2", "mesh.fsdp=2", "mesh.data=2", "parallel.pipeline.layers=2,4"]))
    assert jax.tree.leaves(piped.abstract_state().params["layers"])[0].shape[0] == 8  # 2 stages x 4 rows
    want = _save_distinct(piped, tmp_path)
    assert jax.tree.leaves(want.params["layers"])[0].shape[0] == 6
    others = [(["mesh.data=8"], 8), (["mesh.stage=4", "mesh.data=2", "parallel.pipeline.schedule=gpipe",
               "parallel.pipeline.layers=1,2,2,1"], 8),
              (["mesh.stage=2", "mesh.data=2", "train.microbatches=2", "parallel.pipeline.schedule=interleaved",
                "parallel.pipeline.chunks=2", "parallel.pipeline.layers=1,2,2,1"], 4)]
    _restores_alike(tmp_path, want, [piped] + [build(apply_overrides(deep, sets), jax.devices()[:n]) for sets, n in others])
    with compiler_warnings() as log:
        saved = dataclasses.replace(piped.abstract_state(), frozen=None)
        texts = [reorder_layers(piped, "model").lower(saved).compile().as_text()]
        texts.append(reorder_layers(piped, "pipeline").lower(dataclasses.replace(piped.model_order_state(), frozen=None)).compile().as_text())
    assert not any("all-gather" in text for text in texts)
    assert not any("Involuntary full rematerialization" in line for line in log)


def _save_distinct(trainer, directory):
    """Save `trainer`'s initial state as step 1, every float of it made distinct first (optimizer
    moments too: a misplaced layer cannot pass unseen); the state in model order, on the host."""
    def distinct(x):
        return x + jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) / x.size if x.dtype == jnp.float32 else x

    state = jax.jit(lambda s: jax.tree.map(distinct, s), out_shardings=trainer.state_shardings)(trainer.init())
    saver = Checkpoints.open(directory)
    saver.save(trainer, state, 1)
    saver.close()  # the save written out
    return trainer.model_order(_host(state))  # the plain reorder, on the host


def _restores_alike(directory, want, trainers) -> None:
    """Step 1 restored onto each trainer is `want` in its order, bitwise, in its shardings."""
    for trainer in trainers:
        got, step = Checkpoints.open(directory).restore(trainer)
        assert step == 1
        jax.tree.map(np.testing.assert_array_equal, trainer.model_order(_host(got)), want)
        assert [a.sharding for a in jax.tree.leaves(got)] == jax.tree.leaves(trainer.state_shardings)


def test_interleaved_checkpoints_move_no_whole_layer_stack():
    """Saving and restoring an interleaved pipeline's state reorders its stage-sharded layers
    (jaxpar.loop.checkpoint.reorder_layers). Compiled for each of the composition matrix's
    interleaved layouts (benchmarks/matrix.py) with a layer sharding of its own, neither
    direction makes XLA's partitioner replicate a stack on every device: it prints
    "Involuntary full rematerialization" when it does (C++, on file descriptor 2, and only
    on a real compile: jaxpar.inspect.findings.compiler_warnings), and the only collectives
    are point to point (no all-gather that it might choose unasked)."""
    from jaxpar.recipes import resolve_config
    from jaxpar.inspect.findings import compiler_warnings
    from jaxpar.loop.checkpoint import reorder_layers

    matrix = _matrix()
    layouts = {}
    for cell in matrix.cells():
        if "interleaved" in cell.strategies:
            try:
                trainer = build(resolve_config(cell.recipe, cell.overrides, cell.devices), jax.devices()[:cell.devices])
            except ConfigError:
                continue  # a pair the checks refuse (ZeRO-2/3 with stages, the moe recipe's layers)
            layouts.setdefault(str(jax.tree.map(lambda s: s.spec, trainer.state_shardings)), (cell.name, trainer))
    assert len(layouts) >= 4, sorted(name for name, _ in layouts.values())
    found = {}  # layout -> (arrays the partitioner replicated, collectives other than point to point)
    for name, trainer in layouts.values():
        with compiler_warnings() as log:
            saved = dataclasses.replace(trainer.abstract_state(), frozen=None)  # as a checkpoint holds it
            texts = [reorder_layers(trainer, to).lower(saved).compile().as_text() for to in ("model", "pipeline")]
        others = {op for text in texts for op in re.findall(r"\b(all-gather|all-reduce|all-to-all)\b", text)}
        found[name] = (sum("Involuntary full rematerialization" in line for line in log), sorted(others))
    assert all(found[name] == (0, []) for name in found), found


def _matrix():
    """benchmarks/matrix.py, which is no package."""
    import importlib.util
    import pathlib
    import sys

    name = "jaxpar_benchmarks_matrix"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).parents[2] / "benchmarks" / "matrix.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up there
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


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


def _train_process(metrics, ckpt=None, kill_at_save=None, hold_stop_save=None, output=None):
    """`jaxpar train` in a child process; with `kill_at_save`, one that SIGKILLs itself inside
    that step's save, with `hold_stop_save` (a file) one whose save after a first SIGINT never
    completes (tests/scenarios/kill_during_save.py). `output`: the path its stdout and stderr go to
    (+ ".out", ".err"), read while it runs; else pipes."""
    import os
    import subprocess
    import sys

    sets = TINY + ([f"checkpoint.dir={ckpt}", "checkpoint.every=1"] if ckpt else [])
    entry, env = ["-m", "jaxpar.commands"], dict(os.environ)
    if kill_at_save is not None or hold_stop_save is not None:
        entry = [os.path.join(os.path.dirname(__file__), "kill_during_save.py")]
        env.update({"JAXPAR_TEST_KILL_AT_SAVE": str(kill_at_save)} if kill_at_save is not None else
                   {"JAXPAR_TEST_HOLD_STOP_SAVE": str(hold_stop_save)})
    cmd = [sys.executable, *entry, "train", "llama", "--no-progress", "--metrics-file", str(metrics)]
    cmd += [x for s in sets for x in ("--set", s)]
    if output is None:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with open(f"{output}.out", "w") as out, open(f"{output}.err", "w") as err:  # the child keeps its own copies
        return subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)


def _rows(path):
    import json

    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _saving(ckpt):
    return ckpt.exists() and any(".orbax-checkpoint-tmp" in p.name for p in ckpt.iterdir())


def _killed_at_step(kill_point, metrics, ckpt, sig=None):
    """SIGKILL (or `sig`) from outside once `kill_point` steps are logged: wherever the run
    then is. Returns the process."""
    import os
    import signal
    import time

    proc = _train_process(metrics, ckpt)
    deadline = time.monotonic() + 600
    while len(_rows(metrics)) < kill_point:
        assert proc.poll() is None, f"the run ended before step {kill_point}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"no step {kill_point} in 600 s"
        time.sleep(0.005)
    os.kill(proc.pid, sig or signal.SIGKILL)
    proc.wait(timeout=600)
    return proc


def test_killed_anywhere_and_resumed_repeats_the_uninterrupted_losses_bitwise(tmp_path):
    """SIGKILL after a step drawn at random (seeded), inside a save (the process kills
    itself between orbax writing the arrays and the rename that commits them), and Ctrl-C
    (SIGINT: answered at once with the step the run stops after, which it saves, and one
    line at the end, no traceback); the resumed run really resumes (it says from which step,
    and names the unfinished save it removes) and its losses equal the uninterrupted run's at
    every step. Then Ctrl-C twice, the second inside the save the first asked for."""
    import random
    import re
    import signal

    import jax

    from jaxpar.recipes import resolve_config

    # The uninterrupted run in this process: `jaxpar train`'s config, trainer and loop on the
    # same 8 devices compile the child processes' program (XLA's in-process collectives in
    # both), so its losses are theirs bitwise; a child of its own cost 5 s more.
    reference = tmp_path / "reference.jsonl"
    run(build(resolve_config("llama", TINY, len(jax.devices()))), writers=[JsonLines(str(reference))], progress=False)
    want = {r["step"]: r["loss"] for r in _rows(reference)}
    assert sorted(want) == list(range(1, 9))  # the steps done, as the log lines count

    for kill_point in (random.Random(0).randrange(1, 7), "inside the save of step 3", "SIGINT"):
        ckpt, metrics = tmp_path / f"ckpt-{kill_point}", tmp_path / f"run-{kill_point}.jsonl"
        if isinstance(kill_point, int):
            _killed_at_step(kill_point, metrics, ckpt)
        elif kill_point == "SIGINT":
            proc = _killed_at_step(2, metrics, ckpt, signal.SIGINT)
            out, err = proc.stdout.read(), proc.stderr.read()
            assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
            stop = re.search(rf"jaxpar: SIGINT: stopping after step (\d), saving to {ckpt} \(Ctrl-C again to stop "
                             r"without saving\)", err)
            assert stop, err
            n = stop.group(1)  # the step the first line named is the step saved, and the last row
            assert re.search(rf"saving step {n} to {ckpt} \.\.\.\nsaved step {n} \(\d+\.\d s\)", out), out
            assert f"stopped by SIGINT after step {n}: saved step {n} to {ckpt}; run the same command" in err, err
            assert _rows(metrics)[-1]["step"] == int(n) and "save_s" in _rows(metrics)[-1]
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
        if kill_point == "inside the save of step 3":  # the unfinished save is named as it goes
            assert start == 2 and re.search(r"jaxpar: warning: checkpoint.dir='.*': removed 3\.orbax-checkpoint-tmp\S*, a "
                                            r"save cut short \(never a checkpoint\); its newest complete checkpoint is "
                                            r"step 2", err), err
        rows = _rows(metrics)
        assert [r["step"] for r in rows] == list(range(1, 9)), kill_point  # the lost run's extra rows replaced
        for r in rows:
            assert r["loss"] == want[r["step"]], (kill_point, r["step"])
    _ctrl_c_twice(tmp_path)


def _ctrl_c_twice(tmp_path):
    """The first Ctrl-C is answered before the save it asks for completes (that save never
    does here: tests/scenarios/kill_during_save.py holds it); the second, inside that save, ends the
    run at once, exit 130, saying which checkpoint the directory keeps and naming the
    unfinished folder it leaves (as it is)."""
    import os
    import signal
    import time

    ckpt, metrics, held, output = (tmp_path / "ckpt-twice", tmp_path / "twice.jsonl", tmp_path / "held",
                                   tmp_path / "twice")
    proc = _train_process(metrics, ckpt, hold_stop_save=held, output=output)
    deadline = time.monotonic() + 600
    while len(_rows(metrics)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, output.with_suffix(".err").read_text()[-2000:]
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGINT)
    while not held.exists():
        assert proc.poll() is None and time.monotonic() < deadline, output.with_suffix(".err").read_text()[-2000:]
        time.sleep(0.005)
    n = held.read_text()
    said = output.with_suffix(".err").read_text()  # while the save is still in flight
    assert f"jaxpar: SIGINT: stopping after step {n}, saving to {ckpt} (Ctrl-C again to stop without saving)" in said
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    err = output.with_suffix(".err").read_text()
    partial = [p.name for p in ckpt.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert len(partial) == 1 and partial[0].startswith(f"{n}.") and not (ckpt / n).exists(), partial
    assert (ckpt / str(int(n) - 1)).is_dir() and "Traceback" not in err, err[-2000:]
    assert (f"jaxpar: interrupted during the save of step {n}; {ckpt} keeps step {int(n) - 1}, its last complete "
            f"checkpoint; the unfinished {partial[0]} stays until the next run removes it, naming it") in err, err


def test_a_checkpoint_dir_that_is_a_file_is_refused(tmp_path):
    """Orbax retried and then hung on it; one line now, before anything compiles."""
    from jaxpar.errors import ConfigError
    from jaxpar.loop.checkpoint import Checkpoints

    path = tmp_path / "not_a_folder"
    path.write_text("")
    with pytest.raises(ConfigError, match="checkpoint.dir=.*is a file, not a folder"):
        Checkpoints.open(path)


def test_an_unreadable_latest_step_is_set_aside_for_the_newest_intact_one(tiny_llama, tmp_path, capsys):
    """A truncated save (its array files cut short) is passed over with a warning naming it;
    the run resumes exactly from the step before and saves the lost step again. Run once
    more, finished, it says so and compiles nothing."""
    import dataclasses

    from jaxpar.config import CheckpointConfig
    from jaxpar.train import build, run
    from jaxpar.loop.checkpoint import UnreadableCheckpoint

    config = dataclasses.replace(tiny_llama, checkpoint=CheckpointConfig(dir=str(tmp_path), every=2, async_save=False))
    trainer = build(config)  # each run resumes from the checkpoint folder, as a new process would
    whole = [r["loss"] for r in run(trainer, steps=4, progress=False)]  # saves steps 2 and 4
    for f in (tmp_path / "4" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[:10])
    with pytest.warns(UnreadableCheckpoint, match=r"step 4 \(.*\) cannot be read .*resuming from step 2"):
        resumed = [r["loss"] for r in run(trainer, steps=4, progress=False)]
    assert resumed == whole[2:], (resumed, whole)
    assert (tmp_path / "4.unreadable").is_dir() and (tmp_path / "4").is_dir()
    finished = build(config)
    capsys.readouterr()
    assert run(dataclasses.replace(finished, step=None), steps=4, progress=False) == []  # no step to compile
    assert "already holds step 4 of train.steps=4: nothing to do" in capsys.readouterr().out
    # Readable steps written with another optimizer are not "broken": one line saying so,
    # and nothing set aside.
    from jaxpar.config import apply_overrides
    from jaxpar.errors import ConfigError
    from jaxpar.loop.checkpoint import Checkpoints

    with pytest.raises(ConfigError, match=r"step 4 .* another shape .* optim.name='adamw' .* resume with the optimizer"):
        Checkpoints.open(tmp_path).restore(build(apply_overrides(config, ["optim.name=sgd"])))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "4", "4.unreadable"]
