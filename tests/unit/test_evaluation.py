"""Evaluation and metrics: the held-out loss every train.eval_every steps (jaxpar.loop.evaluation)
on batches never trained on (jaxpar.data.heldout), rows with a time to JSON Lines and
TensorBoard (jaxpar.loop.metrics), and the trained model applied (jaxpar.generate.inference).

Here what compiles no training step; the runs: tests/equivalence/test_evaluation.py."""

import dataclasses
import json
import pathlib
import struct
import sys

import numpy as np
import pytest

from jaxpar.config import apply_overrides
from jaxpar.data.heldout import HELD_OUT_STEP, HeldOutTokens, held_out_batches
from jaxpar.data.order import split_tokens
from jaxpar.data.sources import TokenFile, make_source
from jaxpar.errors import ConfigError
from jaxpar.train import build, run
from jaxpar.loop.metrics import JsonLines, TensorBoard, WandB, Writers, writers_for


def read_events(file) -> list:
    """The Events of one event file: TFRecords (length, its CRC, an Event, its CRC) read with
    tensorboardX's own Event message."""
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    data, i, events = pathlib.Path(file).read_bytes(), 0, []
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i : i + 8])
        events.append(event_pb2.Event.FromString(data[i + 12 : i + 12 + n]))
        i += 12 + n + 4
    return events


def read_scalars(logdir) -> dict[str, list[tuple[int, float, float]]]:
    """tag -> [(step, value, wall time)] from the event files in `logdir`, file by file."""
    scalars: dict = {}
    for file in sorted(pathlib.Path(logdir).glob("events.out.tfevents.*")):
        for event in read_events(file):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value, event.wall_time))
    return scalars


def test_held_out_synthetic_batches_are_their_own_stream(tiny_llama):
    trainer = build(apply_overrides(tiny_llama, ["train.eval_every=1"]))
    source, held_out = make_source(trainer.batch, trainer.config), held_out_batches(trainer.batch, trainer.config)
    first = np.asarray(held_out(0)["inputs"])
    np.testing.assert_array_equal(first, np.asarray(source(HELD_OUT_STEP)["inputs"]))  # the same language
    assert not np.array_equal(first, np.asarray(held_out(1)["inputs"]))
    assert not any(np.array_equal(first, np.asarray(source(step)["inputs"])) for step in range(4))
    # Its seed words are (seed, i, 2**30), a training step's (seed, step) = (seed, step, 0).
    words = lambda *entropy: list(np.random.SeedSequence(list(entropy)).generate_state(4))  # noqa: E731
    assert words(0, HELD_OUT_STEP + 3) == words(0, 3, 2**30) != words(0, 3) == words(0, 3, 0)


def test_token_file_holds_out_its_tail_and_trains_on_the_rest(tiny_llama, tmp_path):
    n, fraction = 5000, 0.2
    tokens = np.where(np.arange(n) < n - int(n * fraction), np.arange(n) % 64, 64 + np.arange(n) % 64).astype(np.uint16)
    path = tmp_path / "tokens.npy"
    np.save(path, tokens)
    base = apply_overrides(tiny_llama, ["data.source=tokens", f"data.path={path}"])
    trainer = build(apply_overrides(base, [f"data.eval_fraction={fraction}", "train.eval_every=2"]))
    training = make_source(trainer.batch, trainer.config)
    held = HeldOutTokens(training)
    assert isinstance(training, TokenFile) and len(training.tokens) == 4000 and len(held.tokens) == 1000
    rows = slice(0, 16)
    for step in range(64):  # every training window lies before the split, every held-out one after it
        window = training.local(step, rows)
        assert window["inputs"].max() < 64 and window["targets"].max() < 64
    for i in range(16):
        window = held.local(HELD_OUT_STEP + i, rows)
        assert window["inputs"].min() >= 64 and window["targets"].min() >= 64
    np.testing.assert_array_equal(np.asarray(held_out_batches(trainer.batch, trainer.config)(3)["inputs"]),
                                  held.local(HELD_OUT_STEP + 3, rows)["inputs"])

    # Off, the whole file trains, drawn exactly as before the split existed.
    plain = build(base)
    whole = make_source(plain.batch, plain.config)
    assert len(whole.tokens) == n and len(whole.held_out) == 0
    starts = np.random.default_rng([0, 5]).integers(0, n - 16, size=16)  # starts 0 to n - seq_len - 1
    np.testing.assert_array_equal(whole.local(5, rows)["inputs"], np.stack([tokens[s : s + 16] for s in starts]))

    too_small = r"data.eval_fraction=0.001 .* 5 held out; each part needs train.seq_len \+ 2 = 18: use 0.0036 to 0.996"
    with pytest.raises(ConfigError, match=too_small):
        split_tokens(tokens, 0.001, 16, str(path))
    with pytest.raises(ConfigError, match="data.eval_fraction=0 holds none"):
        HeldOutTokens(whole)


class _NoCompile:
    """A step that fails the test if anything gets as far as compiling it."""

    def lower(self, *args):
        raise AssertionError("compiled before the bad input was refused")


BAD_RUNS = {  # id: (overrides, run's arguments from (rows of a batch, tmp_path), message)
    "eval_data-without-eval": ([], lambda rows, tmp: {"eval_data": [rows]},
                               r"run\(eval_data=...\) is evaluated every train.eval_every steps, but train.eval_every=0"),
    "data-without-eval_data": (["train.eval_every=2"], lambda rows, tmp: {"data": [rows]}, r"no eval_data was given"),
    "short-eval_data": (["train.eval_every=2"], lambda rows, tmp: {"data": [rows], "eval_data": [rows]},
                        r"eval_data: the iterable holds 1 batches but train.eval_batches=4"),
    "bad-eval_data": (["train.eval_every=2", "train.eval_batches=2"],
                      lambda rows, tmp: {"data": [rows], "eval_data": [rows, {"inputs": rows["inputs"]}]},
                      r"^eval_data: the batch has no targets, weights"),
    "metrics-file-a-folder": ([], lambda rows, tmp: {"writers": [JsonLines(str(tmp))]},
                              r"metrics_file='.*' \(--metrics-file\) is a directory"),
    "tensorboard-a-file": ([], lambda rows, tmp: {"writers": [TensorBoard(str(tmp / "file"))]},
                           r"tensorboard_dir='.*/file' \(--tensorboard\) is a file"),
    "tensorboard-under-a-file": ([], lambda rows, tmp: {"writers": [TensorBoard(str(tmp / "file" / "tb"))]},
                                 r"cannot create the folder"),
}


@pytest.mark.parametrize("name", BAD_RUNS)
def test_bad_run_inputs_are_refused_before_compile(tiny_llama, tmp_path, name):
    overrides, arguments, message = BAD_RUNS[name]
    if "tensorboard" in name:
        pytest.importorskip("tensorboardX")
    trainer = build(apply_overrides(tiny_llama, overrides))
    (tmp_path / "file").write_text("not a folder")
    rows = {k: np.asarray(v) for k, v in make_source(trainer.batch, trainer.config)(0).items()}
    with pytest.raises(ConfigError, match=message):
        run(dataclasses.replace(trainer, step=_NoCompile()), progress=False, **arguments(rows, tmp_path))


def test_tensorboard_without_its_package_names_the_extra(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import tensorboardX raises ImportError
    trainer = dataclasses.replace(build(tiny_llama), step=_NoCompile())
    with pytest.raises(ConfigError, match=r"tensorboardX, which is not installed; pip install 'jaxpar\[tensorboard\]'"):
        run(trainer, progress=False, writers=[TensorBoard(str(tmp_path / "tb"))])
    assert not (tmp_path / "tb").exists()
    monkeypatch.setitem(sys.modules, "wandb", None)  # and W&B's, before the compile too
    with pytest.raises(ConfigError, match=r"logs with wandb, which is not installed; pip install 'jaxpar\[wandb\]'"):
        run(trainer, progress=False, writers=[WandB("p")])


@pytest.mark.parametrize(
    "overrides, rule",
    [
        (["train.eval_every=-1"], "eval-every"),
        (["train.eval_batches=0"], "eval-batches-positive"),
        (["data.eval_fraction=1.0"], "eval-fraction-range"),
        (["data.eval_fraction=-0.5"], "eval-fraction-range"),
        (["data.eval_fraction=0.1"], "eval-fraction-needs-token-file"),
        (["train.eval_every=5", "data.source=tokens", "data.path=t.npy"], "token-eval-needs-held-out-part"),
    ],
)
def test_bad_eval_config_is_refused_before_build(tiny_llama, overrides, rule):
    with pytest.raises(ConfigError) as info:
        build(apply_overrides(tiny_llama, overrides))
    assert info.value.rule == rule and overrides[0].split("=")[0] in str(info.value)


def test_cli_tensorboard_path_is_checked_before_compile(tmp_path, capsys):
    from jaxpar.commands import main

    pytest.importorskip("tensorboardX")
    (tmp_path / "file").write_text("not a folder")
    assert main(["train", "llama", "--no-progress", "--tensorboard", str(tmp_path / "file")]) == 2
    assert "(--tensorboard) is a file; give a directory" in capsys.readouterr().err


def test_resumed_writers_replace_what_the_lost_run_wrote_past_the_checkpoint(tmp_path):

    pytest.importorskip("tensorboardX")
    jsonl, tb = str(tmp_path / "m.jsonl"), str(tmp_path / "tb")
    for start, stop, loss in ((0, 4, 1.0), (2, 4, 2.0)):  # the lost run got to step 4; the checkpoint is at 2
        writers = Writers(writers_for(jsonl, tb))
        writers.open(start, None)
        for step in range(start + 1, stop + 1):  # a row's step: the steps done
            writers.write({"step": step, "time": 1000.0 + step, "loss": loss})
        writers.close()
    assert [(r["step"], r["loss"]) for r in map(json.loads, open(jsonl))] == [(1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0)]
    resumed = next(pathlib.Path(tb).glob("events.out.tfevents.*.step2"))
    purge = [e.step for e in read_events(resumed) if e.file_version and e.step]
    assert purge == [3]  # TensorBoard hides the lost run's events past step 2
    assert [(s, v) for s, v, _ in read_scalars(tb)["loss"]] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (3, 2.0), (4, 2.0)]
