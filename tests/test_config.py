"""Bad input: one ConfigError naming the field, the value and what would work, raised by
`build` before anything is compiled."""

import dataclasses
import re

import pytest

from jaxpar.config import Config, apply_overrides, flatten
from jaxpar.errors import ConfigError
from jaxpar.mesh import MeshConfig
from jaxpar.train import build


def test_overrides_convert_to_field_types():
    c = apply_overrides(Config(), ["mesh.fsdp=2", "train.steps=7", "optim.lr=0.5", "parallel.sequence_parallel=on"])
    assert (c.mesh.fsdp, c.train.steps, c.optim.lr, c.parallel.sequence_parallel) == (2, 7, 0.5, True)
    assert apply_overrides(Config(), ["mesh.hosts.data=2"]).mesh.hosts.data == 2
    assert flatten(c)["mesh.fsdp"] == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ("mesh.fdsp=2", r"unknown key 'mesh.fdsp': mesh. has no 'fdsp'; valid keys: mesh.stage, mesh.data, mesh.fsdp"),
        ("trian.steps=2", r"unknown key 'trian.steps'.*valid keys: model, mesh, parallel, train"),
        ("train.steps=ten", r"train.steps='ten' is not a valid int; e.g. train.steps=2"),
        ("parallel.sequence_parallel=maybe", r"is not a valid bool"),
        ("train.steps", r"is not key=value"),
        ("train=3", r"train is a section; set one of its keys: train.steps"),
        ("train.steps.x=3", r"train.steps is a value, not a section"),
    ],
)
def test_bad_override(override, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(Config(), [override])


def llama(**model):
    from jaxpar.models.llama import LlamaConfig

    base = LlamaConfig(vocab_size=128, embed=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp=64)
    return Config(model=dataclasses.replace(base, **model))


@pytest.mark.parametrize(
    "config, overrides, message",
    [
        (llama(), ["mesh.data=4"], r"mesh.data=4 multiplies to 4, but there are 8 devices"),
        (llama(), ["mesh.tensor=8"], r"mesh.tensor=8 does not divide model.num_heads=4; use mesh.tensor in \[1, 2, 4\]"),
        (llama(num_heads=8), ["mesh.tensor=4"], r"mesh.tensor=4 does not divide model.num_kv_heads=2"),
        (llama(num_heads=8, num_kv_heads=8, vocab_size=100), ["mesh.tensor=8"], r"does not divide model.vocab_size=100"),
        (llama(num_heads=8, num_kv_heads=8, mlp=36), ["mesh.tensor=8"], r"does not divide model.mlp=36"),
        (llama(embed=36), ["mesh.fsdp=8", "mesh.data=1"], r"mesh.fsdp=8 does not divide model.embed=36"),
        (llama(), ["train.global_batch=12"], r"train.global_batch=12 is not divisible by data x fsdp x expert x microbatches = 8 x 1 x 1 x 1 = 8"),
        (llama(), ["train.global_batch=16", "train.microbatches=4"], r"= 8 x 1 x 1 x 4 = 32"),
        (llama(), ["mesh.data=2", "mesh.tensor=4", "parallel.sequence_parallel=true", "train.seq_len=18", "model.num_heads=4", "model.num_kv_heads=4"], r"train.seq_len=18 is not divisible by context x tensor = 4"),
        (llama(), ["train.compute_dtype=float16"], r"train.compute_dtype='float16'; use one of float32, bfloat16"),
        (llama(), ["optim.name=adagrad"], r"optim.name='adagrad'; use one of adam, adamw, lion, sgd"),
        (llama(remat="some"), [], r"model.remat='some'; use one of none, full"),
        (llama(), ["parallel.storage_rules=embed=gpu"], r"unknown mesh axis 'gpu'"),
        (llama(), ["data.source=tokens"], r"data.source=tokens needs data.path"),
        (Config(mesh=MeshConfig(data=-1, tensor=3)), [], r"mesh.data=-1 cannot fill 8 devices"),
    ],
)
def test_bad_config_raises_before_compile(config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        build(apply_overrides(config, overrides))


@pytest.mark.parametrize("name", ["llama", "moe", "mlp_dp"])
def test_every_key_says_what_it_means_and_the_toml_form_reads_back(name, tmp_path):
    """Each field's meaning is the comment beside it (or above its run of fields), so a field
    added without one fails here; `--print-config --as-toml` is read back by `--config` to
    the same config, choices and all."""
    from jaxpar import recipes
    from jaxpar.config_text import field_docs, read_toml, to_toml

    config = apply_overrides(recipes.load(name), ["train.compute_dtype=float32", "checkpoint.dir=runs/a \"b\"",
                                                  "optim.lr=0.00025"])
    docs = field_docs(config)
    assert [k for k in flatten(config) if k not in docs] == []
    assert docs["train.steps"].startswith("optimizer steps") and "RMSNorm" not in docs.get("model.tie_embeddings", "")
    path = tmp_path / "run.toml"
    path.write_text(to_toml(config))
    assert apply_overrides(recipes.load(name), read_toml(str(path))) == config
    if name == "llama":  # a run of fields under one comment: the TOML says it once
        assert path.read_text().count("Llama 3.1+ RoPE frequency scaling") == 1


def test_config_files_and_print_config_on_the_command_line(tmp_path, capsys):
    from jaxpar.commands import main

    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 7\nlog_every = 3\n\n[mesh.hosts]\ndata = 1\n")
    # the file's keys first, --set on top, wherever --config stands
    assert main(["train", "llama", "--set", "train.steps=5", "--config", str(path), "--print-config", "train."]) == 0
    out = capsys.readouterr().out
    assert "train.steps=5  # optimizer steps" in out and "train.log_every=3" in out and "mesh." not in out
    assert main(["train", "llama", "--print-config", "--as-toml"]) == 0
    assert "[mesh.hosts]\n# How many hosts" in capsys.readouterr().out
    for text, message in (("[train\n", r"is not TOML: .*line 1"), ("[train]\nstpes = 3\n", "unknown key 'train.stpes'"),
                          ("[train]\nsteps = [1, 2]\n", r"train.steps = \[1, 2\] is a list; config values are")):
        path.write_text(text)
        assert main(["train", "llama", "--config", str(path)]) == 2
        assert re.search(message, capsys.readouterr().err)
    assert main(["train", "llama", "--config", str(tmp_path / "none.toml")]) == 2
    assert "none.toml: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("jaxpar ")
