import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import apply_overrides
from jaxpar.data.batch import BatchLayout, batch_fields, local_rows
from jaxpar.data.sources import check_ids, SyntheticTokens, TokenFile, make_source
from jaxpar.errors import ConfigError
from jaxpar.train import build


@pytest.fixture
def trainer(tiny_llama):
    return build(apply_overrides(tiny_llama, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]))


def test_synthetic_tokens_are_deterministic_shifted_and_sharded(trainer):
    source = make_source(trainer.batch, trainer.config)
    assert isinstance(source, SyntheticTokens)
    a, b = source(3), source(3)
    np.testing.assert_array_equal(np.asarray(a["inputs"]), np.asarray(b["inputs"]))
    np.testing.assert_array_equal(np.asarray(a["inputs"])[:, 1:], np.asarray(a["targets"])[:, :-1])
    assert a["inputs"].shape == (16, 16) and a["inputs"].sharding == trainer.batch.shardings["inputs"]
    assert not np.array_equal(np.asarray(source(4)["inputs"]), np.asarray(a["inputs"]))


def test_a_source_needs_only_a_batch_layout_and_the_config(trainer):
    """No Trainer: a layout made by hand on a 2-device mesh gives the trainer's batches,
    laid out as it says."""
    config = trainer.config
    fields = batch_fields(config.model, config.train.seq_len, config.data)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    layout = BatchLayout(fields, config.train.global_batch, {k: NamedSharding(mesh, P("data")) for k in fields})
    by_hand, built = make_source(layout, config)(3), make_source(trainer.batch, config)(3)
    assert by_hand["inputs"].sharding == layout.shardings["inputs"] and layout.rows == slice(0, 16)
    for k, v in built.items():
        np.testing.assert_array_equal(np.asarray(by_hand[k]), np.asarray(v))


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_token_file_windows(tmp_path, tiny_llama, suffix):
    tokens = (np.arange(5000) % 128).astype(np.uint16)
    path = tmp_path / f"tokens{suffix}"
    np.save(path, tokens) if suffix == ".npy" else tokens.tofile(path)
    config = apply_overrides(tiny_llama, ["data.source=tokens", f"data.path={path}", "data.dtype=uint16"])
    trainer = build(config)
    source = make_source(trainer.batch, trainer.config)
    assert isinstance(source, TokenFile)
    batch = source(0)
    inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
    assert inputs.dtype == np.int32 and inputs.shape == (16, 16)
    np.testing.assert_array_equal((inputs + 1) % 128, targets)  # consecutive ids, shifted by one


def test_token_file_windows_reach_the_last_token(tmp_path, tiny_llama):
    """Every start from 0 to n - seq_len - 1 is drawn, the last included (its row ends on the
    last token), and none past it: each row is whole. So for the training part and for the
    held-out part (data.eval_fraction) alike."""
    from jaxpar.data.heldout import HELD_OUT_STEP, HeldOutTokens

    n, seq, batch = 20, tiny_llama.train.seq_len, tiny_llama.train.global_batch
    path = tmp_path / "short.npy"
    np.save(path, np.arange(2 * n, dtype=np.uint16))  # a token's id is its position: 20 train, 20 held out
    trainer = build(apply_overrides(tiny_llama, ["data.source=tokens", f"data.path={path}", "data.eval_fraction=0.5"]))
    source = make_source(trainer.batch, trainer.config)
    for part, first_step, first_id in ((source, 0, 0), (HeldOutTokens(source), HELD_OUT_STEP, n)):
        rows = [part.local(first_step + i, slice(0, batch)) for i in range(8)]
        starts = np.concatenate([r["inputs"][:, 0] for r in rows])
        assert set(starts.tolist()) == set(range(first_id, first_id + n - seq))
        assert max(int(r["targets"][:, -1].max()) for r in rows) == first_id + n - 1
        for r in rows:  # whole rows of consecutive ids, none cut short by the end of the part
            assert r["inputs"].shape[1] == seq
            np.testing.assert_array_equal(r["targets"], r["inputs"] + 1)


def test_token_file_errors(tmp_path, tiny_llama):
    with pytest.raises(ConfigError, match="is not a file"):
        trainer = build(apply_overrides(tiny_llama, ["data.source=tokens", f"data.path={tmp_path}/none.npy"]))
        make_source(trainer.batch, trainer.config)
    big = tmp_path / "big.npy"
    np.save(big, np.full(100, 500, np.int32))
    with pytest.raises(ConfigError, match="holds token id 500 .at position 0. but model.vocab_size=128"):
        trainer = build(apply_overrides(tiny_llama, ["data.source=tokens", f"data.path={big}"]))
        make_source(trainer.batch, trainer.config)
    late = tmp_path / "late.npy"  # an id out of range far into the file, past any sample of its head
    ids = np.arange(300_000, dtype=np.int32) % 128
    ids[-3] = 128
    np.save(late, ids)
    with pytest.raises(ConfigError, match="holds token id 128 .at position 299997."):
        check_ids(np.load(late, mmap_mode="r"), 128, str(late), chunk=1 << 16)


def test_local_rows_cover_this_process(trainer):
    # One process holds every row; the per-process slice is what multi-host runs read.
    assert local_rows(trainer.batch.shardings["inputs"], (16, 16)) == slice(0, 16)


def test_packed_documents_get_segments_positions_and_no_cross_document_target(tmp_path, tiny_llama):
    """data.eos_id: a new segment after each end-of-document token, positions restarting,
    and the end-of-document token's target (the next document's first token) weighing 0."""
    from jaxpar.data.sources import _lm_rows

    rows = _lm_rows(np.array([[5, 6, 0, 7, 8, 9, 0, 0, 4, 3]]), eos_id=0)
    np.testing.assert_array_equal(rows["segment_ids"], [[0, 0, 0, 1, 1, 1, 1, 2, 3]])
    np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 0, 1, 2, 3, 0, 0]])
    np.testing.assert_array_equal(rows["weights"], [[1, 1, 0, 1, 1, 1, 0, 0, 1]])
    path = tmp_path / "docs.npy"
    np.save(path, np.random.default_rng(0).integers(0, 128, 5000).astype(np.uint16))
    trainer = build(apply_overrides(tiny_llama, ["mesh.data=2", "mesh.context=4", "data.source=tokens",
                                                 f"data.path={path}", "data.eos_id=3"]))
    batch = make_source(trainer.batch, trainer.config)(0)
    assert set(batch) == {"inputs", "targets", "weights", "segment_ids", "positions"}
    assert batch["segment_ids"].sharding == trainer.batch.shardings["segment_ids"]
    with pytest.raises(ConfigError, match=r"data.eos_id=128 must be a token id \(0 to model.vocab_size - 1 = 127\)"):
        build(apply_overrides(tiny_llama, ["data.eos_id=128"]))
    from jaxpar.config import Config
    from jaxpar.models.mlp import MLPConfig

    with pytest.raises(ConfigError, match="data.eos_id=0 packs documents of a language model, but model.task='classify'"):
        build(apply_overrides(Config(model=MLPConfig()), ["data.eos_id=0"]))


@pytest.mark.parametrize("name, content, message", [
    ("empty.bin", b"", "is empty (0 bytes)"),
    ("floats.npy", "float32", "holds float32 values, not token ids"),
    ("none.npy", "empty", "holds no tokens"),
    ("broken.npy", b"not a numpy file", "is not a readable .npy file"),
])
def test_token_files_that_hold_no_ids_are_refused(tmp_path, name, content, message):
    """Each refused by the source, which `run` makes before the step compiles."""
    import re

    import numpy as np

    from jaxpar.data.sources import open_tokens
    from jaxpar.errors import ConfigError

    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        np.save(path, np.zeros(0 if content == "empty" else 100, np.float32 if content == "float32" else np.uint16))
    with pytest.raises(ConfigError, match=re.escape(message)):
        open_tokens(str(path), "uint16")


def test_each_source_says_in_one_line_what_it_trains_on(tmp_path, tiny_llama):
    """The line a run prints as it starts (Source.describe): the source, its path, what it
    holds (documents counted by data.eos_id in the pass that checks the ids), and the epochs
    train.steps read: whole rows (data.order=epochs) or windows' tokens over the tokens."""
    from jaxpar.data.user import UserBatches

    def line(config, steps: int) -> str:
        return make_source(build(config).batch, config).describe(steps)

    assert line(tiny_llama, 3) == (
        "data: synthetic random tokens (data.source=synthetic: a made-up language of 128 ids drawn from train.seed, "
        "no text) | 3 steps x 256 tokens; train on real text with data.source=text data.path=FILE (or tokens, chat)")
    tokens = np.arange(5000, dtype=np.uint16) % 10  # id 3 every 10 tokens: 500 documents
    np.save(tmp_path / "docs.npy", tokens)
    file = ["data.source=tokens", f"data.path={tmp_path / 'docs.npy'}", "data.eos_id=3", "data.eval_fraction=0.2"]
    lines = {order: line(apply_overrides(tiny_llama, file + [f"data.order={order}"]), 100) for order in ("epochs", "windows")}
    held = f"data: tokens '{tmp_path / 'docs.npy'}' | 500 documents, 5,000 tokens (4,000 to train on, 1,000 held out) | "
    # epochs: (4000 - 1) // 16 = 249 rows, 100 steps x 16 rows; windows: 100 x 256 tokens over 4,000
    assert lines["epochs"] == held + "100 steps x 256 tokens = 6.43 epochs"
    assert lines["windows"] == held + "100 steps x 256 tokens = 6.4 epochs (windows at random places: data.order=windows)"
    batch = build(tiny_llama).batch
    assert UserBatches(batch, lambda step: {}).describe(5) == (
        "data: your own batches (jaxpar.train.run(data=...): a function step -> batch) | 5 steps x 16 rows")


def test_a_checkpoint_fine_tuned_on_synthetic_tokens_is_warned_of(tiny_llama, tmp_path):
    """The recipe hf:FOLDER with no data settings: the start line says synthetic tokens, and a
    warning says what that does to the checkpoint and how to give real data."""
    from jaxpar.errors import JaxparWarning

    base = tmp_path / "base"  # a Hugging Face folder as far as the warning looks (a wrong one is refused first)
    base.mkdir()
    (base / "config.json").write_text("{}")
    config = apply_overrides(tiny_llama, [f"checkpoint.init_from={base}"])
    with pytest.warns(JaxparWarning, match=rf"^checkpoint.init_from='{base}' with data.source=synthetic fine-tunes "
                                           r"the checkpoint on random tokens, which unlearns what it knows; give it real "
                                           r"data: --set data.source=text --set data.path=FILE"):
        source = make_source(build(config).batch, config)
    assert source.describe(3).startswith("data: synthetic random tokens")
