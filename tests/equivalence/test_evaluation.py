"""Evaluation and metrics: the held-out loss every train.eval_every steps (jaxpar.loop.evaluation)
on batches never trained on (jaxpar.data.heldout), rows with a time to JSON Lines and
TensorBoard (jaxpar.loop.metrics), and the trained model applied (jaxpar.generate.inference).

Here the runs; what compiles no training step: tests/unit/test_evaluation.py."""

import json
import pathlib
import struct

import jax
import numpy as np
import pytest

from jaxpar.config import apply_overrides
from jaxpar.data.heldout import held_out_batches
from jaxpar.data.sources import make_source
from jaxpar.errors import ConfigError
from jaxpar.train import build, run
from jaxpar.loop.evaluation import held_out_loss
from jaxpar.loop.metrics import writers_for
from jaxpar.generate.inference import forward, unsharded_model
from jaxpar.testing import initial_state


from ..unit.test_evaluation import read_scalars


def read_wandb_history(folder) -> list[dict]:
    """The history rows of the offline W&B run under `folder` (its .wandb file: after a
    7-byte header, records of a 7-byte header each, crc, length, kind, in 32 KiB blocks)."""

    from wandb.proto import wandb_internal_pb2

    (path,) = pathlib.Path(folder).glob("wandb/offline-run-*/run-*.wandb")
    data, pos, pending, rows = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_evaluation_changes_no_loss_and_rows_hold_the_held_out_loss(tiny_llama, tmp_path, monkeypatch):
    """... and the rows reach the metrics file, TensorBoard and W&B (offline) alike."""
    pytest.importorskip("tensorboardX")
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_DIR", str(tmp_path)), ("WANDB_SILENT", "true")):
        monkeypatch.setenv(name, value)
    config = apply_overrides(tiny_llama, ["mesh.data=8", "train.steps=5"])
    off = run(build(config), progress=False)
    evaluated = apply_overrides(config, ["train.eval_every=2", "train.eval_batches=2"])
    trainer = build(evaluated)
    tb, jsonl = tmp_path / "tb", tmp_path / "runs" / "m.jsonl"  # neither folder exists yet
    on = run(trainer, progress=False, writers=writers_for(str(jsonl), str(tb), "jaxpar-test"))
    assert [r["loss"] for r in on] == [r["loss"] for r in off]  # bitwise
    assert [r["grad_norm"] for r in on] == [r["grad_norm"] for r in off]
    assert [r["step"] for r in on if "eval_loss" in r] == [2, 4, 5]  # after 2 and 4 steps, and the last (steps done)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["eval_loss"] for r in rows if "eval_loss" in r] == [r["eval_loss"] for r in on if "eval_loss" in r]
    assert all(isinstance(r["time"], float) and abs(r["time"] - rows[0]["time"]) < 600 for r in rows)

    # The same held-out loss by hand: two steps, then trainer.evaluate over the held-out batches.
    state, source = initial_state(trainer), make_source(trainer.batch, trainer.config)
    for step in range(2):
        state, _ = trainer.step(state, source(step))
    assert held_out_loss(trainer, state.params) == on[1]["eval_loss"]
    sums = [jax.device_get(trainer.evaluate(state.params, held_out_batches(trainer.batch, trainer.config)(i))) for i in range(2)]
    assert on[1]["eval_loss"] == pytest.approx(sum(s for s, _ in sums) / sum(w for _, w in sums), rel=1e-7)

    scalars = read_scalars(tb)
    assert [s for s, _, _ in scalars["loss"]] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([v for _, v, _ in scalars["loss"]], [r["loss"] for r in rows], rtol=1e-6)
    np.testing.assert_allclose([v for _, v, _ in scalars["eval_loss"]], [r["eval_loss"] for r in rows if "eval_loss" in r],
                               rtol=1e-6)
    assert [t for _, _, t in scalars["loss"]] == pytest.approx([r["time"] for r in rows])
    assert {"grad_norm", "learning_rate", "tokens_per_s", "step_time_s"} <= set(scalars)
    assert "step" not in scalars and "time" not in scalars
    logged = read_wandb_history(tmp_path)
    assert [r["_step"] for r in logged] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in logged] == [r["loss"] for r in rows] and "time" not in logged[0]
    assert [r["eval_loss"] for r in logged if "eval_loss" in r] == [r["eval_loss"] for r in rows if "eval_loss" in r]


def test_user_eval_data(tiny_llama):
    trainer = build(apply_overrides(tiny_llama, ["train.eval_every=2", "train.eval_batches=2", "train.steps=2"]))
    source = make_source(trainer.batch, trainer.config)
    local = lambda step: {k: np.asarray(v) for k, v in source(step).items()}  # noqa: E731
    held = [local(100), local(101)]
    history = run(trainer, progress=False, data=local, eval_data=iter(held + [None]))  # only the first two are read
    state = initial_state(trainer)
    for step in range(2):
        state, _ = trainer.step(state, source(step))
    assert history[-1]["eval_loss"] == held_out_loss(trainer, state.params, lambda i: source(100 + i), 2)
    by_function = run(trainer, progress=False, data=local, eval_data=lambda i: held[i])
    assert by_function[-1]["eval_loss"] == history[-1]["eval_loss"]


def test_forward_on_pipeline_and_context_layouts_equals_one_device(tiny_llama):
    config = apply_overrides(tiny_llama, ["model.num_layers=4", "train.microbatches=4"])
    flat = build(config, jax.devices()[:1])
    inputs = np.asarray(make_source(flat.batch, flat.config)(0)["inputs"])
    want = np.asarray(forward(flat)(initial_state(flat).params, {"inputs": inputs}))
    assert want.shape == (16, 16, 128)
    layouts = {
        "interleaved pipeline": ["mesh.stage=2", "mesh.data=4", "parallel.pipeline.schedule=interleaved",
                                 "parallel.pipeline.chunks=2"],  # layers rest in pipeline order
        "zigzag context": ["mesh.data=2", "mesh.context=4"],  # the sequence is permuted inside
    }
    trainers = {name: build(apply_overrides(config, layout)) for name, layout in layouts.items()}
    states = {name: initial_state(trainer) for name, trainer in trainers.items()}
    for name, trainer in trainers.items():
        got = forward(trainer)(states[name].params, {"inputs": inputs, "targets": inputs})  # other fields are ignored
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=name)
    piped, state = trainers["interleaved pipeline"], states["interleaved pipeline"]
    np.testing.assert_allclose(np.asarray(unsharded_model(piped, state)(inputs)), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"forward: batch field 'inputs' of shape \(3, 16\) does not split"):
        forward(piped)(state.params, {"inputs": inputs[:3]})
