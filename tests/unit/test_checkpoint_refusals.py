"""Checkpoint settings a new user gets wrong, each refused in one line before compile: a
checkpoint.dir of another model class, a checkpoint.dir that cannot be a folder, a
checkpoint.init_from that is no Hugging Face folder (before the synthetic-data warning), and
a model without a Hugging Face format asked to export or start from one."""

from __future__ import annotations

import re
import warnings

import pytest

from jaxpar.checks import base_config, by_id, example_config, validate
from jaxpar.commands import main
from jaxpar.config import apply_overrides
from jaxpar.data.sources import make_source
from jaxpar.errors import ConfigError
from jaxpar.hf import prepare_import
from jaxpar.loop.checkpoint import Checkpoints
from jaxpar.train import build


@pytest.fixture(scope="module")
def mlp_checkpoint(tmp_path_factory):
    """A folder holding step 1 of the MLP base config (an init, saved; no step compiled)."""
    directory = tmp_path_factory.mktemp("mlp_run")
    trainer = build(base_config("mlp"))
    checkpoints = Checkpoints.open(directory, async_save=False, remove_partial=True)
    checkpoints.save(trainer, trainer.init(), 1)
    checkpoints.close()
    return directory


def test_a_checkpoint_of_another_model_class_is_refused_by_name(mlp_checkpoint, tiny_llama):
    """Before any field is compared: another class's fields all read as "added since" or
    changed, and the advice that gave (a compute_dtype, an optimizer) was false."""
    checkpoints = Checkpoints.open(mlp_checkpoint)
    try:
        with pytest.raises(ConfigError) as info:
            checkpoints.restore(build(apply_overrides(tiny_llama, ["train.compute_dtype=bfloat16"])))
        _, own = checkpoints.restore(build(base_config("mlp")))  # its own class resumes
    finally:
        checkpoints.close()
    assert str(info.value) == (
        f"checkpoint.dir={str(mlp_checkpoint)!r}: step 1 was written by model MLPConfig (jaxpar.models.mlp), but this "
        "run's is LlamaConfig (jaxpar.models.llama); use another checkpoint.dir for this model, or resume with the "
        "model that wrote it")
    assert own == 1


def test_a_checkpoint_dir_that_cannot_be_a_folder_is_refused_before_anything_is_made(tmp_path, tiny_llama):
    (tmp_path / "m.jsonl").write_text("")
    under_a_file = tmp_path / "m.jsonl" / "ck"
    with pytest.raises(ConfigError) as info:
        build(apply_overrides(tiny_llama, [f"checkpoint.dir={under_a_file}"]))
    assert info.value.rule == "checkpoint-dir-can-be-a-folder"
    assert str(info.value) == (f"checkpoint.dir={str(under_a_file)!r} cannot be created ({tmp_path / 'm.jsonl'} is "
                               "not a folder); give a folder this user can write, or checkpoint.dir='' for no "
                               "checkpoints")
    with pytest.raises(ConfigError, match=re.escape(f"({tmp_path / 'm.jsonl'} is not a folder)")):
        Checkpoints.open(under_a_file, remove_partial=True)  # run() with a config checked before: the same line
    assert [p.name for p in tmp_path.iterdir()] == ["m.jsonl"]


def test_a_checkpoint_dir_this_user_cannot_write_is_refused_to_the_run_that_saves(tmp_path, monkeypatch):
    """Asked only by the writer: export and sample read the checkpoint.dir a run recorded,
    perhaps on another machine. (Tests run as root, who may write anywhere: os.access is
    made to say no.)"""
    import jaxpar.checks.checkpoint as checks

    monkeypatch.setattr(checks.os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError) as info:
        Checkpoints.open(tmp_path / "new" / "ck", remove_partial=True)
    assert str(info.value) == (f"checkpoint.dir={str(tmp_path / 'new' / 'ck')!r} cannot be created ({tmp_path} is not "
                               "writable by this user); give a folder this user can write, or checkpoint.dir='' for "
                               "no checkpoints")
    with pytest.raises(ConfigError, match=r"is a folder this user cannot write; give a folder this user can write"):
        Checkpoints.open(tmp_path, remove_partial=True)
    Checkpoints.open(tmp_path).close()  # a reader
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("made, said", [(False, "is not a folder"), (True, "has no config.json")])
def test_init_from_that_is_no_hugging_face_folder_is_named_before_the_data_warning(tmp_path, tiny_llama, made, said):
    """A run's own checkpoint.dir is what a new user gives first: the error says where that
    goes. No warning about fine-tuning on random tokens comes before it."""
    folder = tmp_path / "runs" / "ckpt"
    if made:
        folder.mkdir(parents=True)
    config = apply_overrides(tiny_llama, [f"checkpoint.init_from={folder}"])
    trainer = build(config)
    expected = (f"checkpoint.init_from={str(folder)!r} {said}; checkpoint.init_from takes only the folder of a Hugging "
                "Face checkpoint (config.json and *.safetensors); a jaxpar run's own checkpoints resume through "
                "checkpoint.dir")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no synthetic-data warning for a folder that holds no checkpoint
        make_source(trainer.batch, config)
    with pytest.raises(ConfigError) as info:  # the import's own check
        prepare_import(trainer, folder)
    assert str(info.value) == expected


def test_a_model_without_a_hugging_face_format_is_told_what_fits_the_command(mlp_checkpoint, tmp_path, capsys):
    """The same refusal serves export and init_from: no advice to train from its own
    initialisation on export; init_from adds that way out."""
    no_format = ("model MLPConfig declares no Hugging Face format, so its weights can be neither read from nor "
                 "exported as a Hugging Face checkpoint; give its family one to do either "
                 "(jaxpar.families.Family(..., hf=jaxpar.hf.HFFormat(...)), docs/your_model.md)")
    assert main(["export", str(mlp_checkpoint), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"jaxpar: error: {no_format}\n"
    with pytest.raises(ConfigError) as info:
        validate(example_config(by_id("init-from-needs-hf-format")), 8, "cpu")
    assert str(info.value) == (f"checkpoint.init_from='checkpoints/llama': {no_format}, or drop checkpoint.init_from "
                               "to train it from its own initialisation")
    assert not (tmp_path / "out").exists()
