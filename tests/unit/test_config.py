"""Bad input: one ConfigError naming the field, the value and what would work, raised by
`build` before anything is compiled."""

import dataclasses
import functools
import re

import pytest

from jaxpar.config import Config, apply_overrides, flatten
from jaxpar.errors import ConfigError
from jaxpar.mesh import MeshConfig
from jaxpar.train import build


def test_overrides_convert_to_field_types():
    c = apply_overrides(Config(), ["mesh.fsdp=2", "train.steps=7", "optim.lr=0.5", "parallel.tensor.sequence_parallel=on"])
    assert (c.mesh.fsdp, c.train.steps, c.optim.lr, c.parallel.tensor.sequence_parallel) == (2, 7, 0.5, True)
    assert apply_overrides(Config(), ["mesh.hosts.data=2"]).mesh.hosts.data == 2
    assert flatten(c)["mesh.fsdp"] == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ("mesh.fdsp=2", r"unknown key 'mesh.fdsp': mesh has no 'fdsp' \(did you mean mesh.fsdp\?\); valid keys: mesh.stage, mesh.data, mesh.fsdp"),
        ("trian.steps=2", r"unknown key 'trian.steps'.*valid keys: model, mesh, parallel, train"),
        ("train.steps=ten", r"train.steps='ten' is not a valid int; e.g. train.steps=2"),
        ("parallel.tensor.sequence_parallel=maybe", r"is not a valid bool"),
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
        (llama(), ["mesh.data=1", "mesh.tensor=2", "mesh.context=4", "parallel.context.impl=ulysses"],
         r"mesh.context=4 does not divide the 2 query heads per tensor shard"),
        (llama(num_heads=8, num_kv_heads=8, vocab_size=100), ["mesh.tensor=8"], r"does not divide model.vocab_size=100"),
        (llama(num_heads=8, num_kv_heads=8, mlp=36), ["mesh.tensor=8"], r"does not divide model.mlp=36"),
        (llama(embed=36), ["mesh.fsdp=8", "mesh.data=1"], r"mesh.fsdp=8 does not divide model.embed=36"),
        (llama(), ["train.global_batch=12"], r"train.global_batch=12 is not divisible by data x fsdp x expert x microbatches = 8 x 1 x 1 x 1 = 8"),
        (llama(), ["train.global_batch=16", "train.microbatches=4"], r"= 8 x 1 x 1 x 4 = 32"),
        (llama(), ["mesh.data=2", "mesh.tensor=4", "parallel.tensor.sequence_parallel=true", "train.seq_len=18", "model.num_heads=4", "model.num_kv_heads=4"], r"train.seq_len=18 is not divisible by context x tensor = 4"),
        (llama(), ["train.compute_dtype=float16"], r"train.compute_dtype='float16'; use one of float32, bfloat16"),
        (llama(), ["optim.name=adagrad"], r"optim.name='adagrad'; use one of adam, adamw, lion, sgd"),
        (llama(remat="some"), [], r"model.remat='some'; use one of none, full"),
        (llama(), ["parallel.rules.storage=embed=gpu"], r"unknown mesh axis 'gpu'"),
        (llama(), ["data.source=tokens"], r"data.source=tokens needs data.path"),
        (Config(mesh=MeshConfig(data=-1, tensor=3)), [], r"mesh.tensor=3 does not divide the 8 devices"),
    ],
)
def test_bad_config_raises_before_compile(config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        build(apply_overrides(config, overrides))


@pytest.mark.parametrize("name", ["llama", "moe", "mlp_dp"])
def test_every_key_says_what_it_means_and_the_toml_form_reads_back(name, tmp_path):
    """Each field's meaning is its own comment (beside it or right above it), so a field
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


def test_config_files_and_print_config_on_the_command_line(tmp_path, capsys):
    from jaxpar.commands import main

    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 7\nlog_every = 3\n\n[mesh.hosts]\ndata = 1\n")
    # the file's keys first, --set on top, wherever --config stands
    assert main(["train", "llama", "--set", "train.steps=5", "--config", str(path), "--print-config", "train."]) == 0
    out = capsys.readouterr().out
    assert "train.steps=5  # optimizer steps" in out and "train.log_every=3" in out and "mesh." not in out
    assert main(["train", "llama", "--print-config", "--as-toml"]) == 0
    assert "[train]\n# optimizer steps the run ends at" in capsys.readouterr().out
    typo = rf"--config {re.escape(str(path))}: unknown key 'train.stpes': train has no 'stpes' \(did you mean train.steps\?\); "
    for text, message in (("[train\n", r"is not TOML: .*line 1"), ("[train]\nstpes = 3\n", typo),
                          ("[model]\nembd = 3\n", r"run.toml: unknown key 'model.embd'.*did you mean model.embed\?"),
                          ("[train]\nsteps = \"x\"\n", r"run.toml: train.steps='x' is not a valid int"),
                          ("[train]\nsteps = [1, 2]\n", r"train.steps = \[1, 2\] is a list; config values are")):
        path.write_text(text)
        assert main(["train", "llama", "--config", str(path)]) == 2
        assert re.search(message, capsys.readouterr().err.strip())
    assert main(["train", "llama", "--config", str(tmp_path / "none.toml")]) == 2
    assert "none.toml: no such file" in capsys.readouterr().err


# ------------------------------------------------ each field's meaning is its own comment


@functools.cache
def _class_source(cls: type):
    """(the class body's statements, {line: comment text}, its lines), read with ast and tokenize."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return [], {}, []
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    return ast.parse(source).body[0].body, comments, source.splitlines()


def _declaration(cls: type, name: str) -> dict | None:
    """Where `cls`'s own source declares field `name` (None: it does not): the comment beside
    it (on its lines), the unbroken comment block right above it, and whether that block also
    sits right above the next field, which has no comment of its own (then it heads a run of
    fields and is no one field's)."""
    import ast

    body, comments, lines = _class_source(cls)
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.AnnAssign) and getattr(stmt.target, "id", None) == name:
            break
    else:
        return None
    beside = " ".join(comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments)
    first = stmt.lineno - 1
    while first >= 1 and lines[first - 1].strip().startswith("#"):
        first -= 1
    above = " ".join(comments[n] for n in range(first + 1, stmt.lineno))
    after = body[i + 1] if i + 1 < len(body) else None
    heads_run = (isinstance(after, ast.AnnAssign) and after.lineno == stmt.end_lineno + 1
                 and not any(n in comments for n in range(after.lineno, after.end_lineno + 1)))
    return {"beside": beside, "above": above, "heads_run": heads_run, "where": f"{cls.__qualname__}.{name}"}


def _sections(config, prefix=""):
    """(prefix, dataclass) for `config` and every section under it."""
    yield prefix, config
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            yield from _sections(value, f"{prefix}{f.name}.")


def _shipped_configs():
    from jaxpar.families import SHIPPED, families

    return [Config(model=f.config_class()) for f in families() if f.config_class.__module__.startswith(SHIPPED)]


def test_print_config_shows_each_field_its_own_comment_never_a_neighbours_or_a_headers():
    """For every field of every section and of each shipped family's model config, the
    meaning `--print-config` shows is that field's own comment: the one beside it or the
    block right above it, exactly (not with a section header before it, not the previous
    field's, not a comment heading a run of fields); no two fields of a section show one
    meaning; and every field of jaxpar/config.py's sections has one."""
    from jaxpar import config as config_module
    from jaxpar.config_text import field_docs, listing

    problems = []
    for config in _shipped_configs():
        docs = field_docs(config)
        for prefix, section in _sections(config):
            seen: dict[str, str] = {}
            for f in dataclasses.fields(section):
                if dataclasses.is_dataclass(getattr(section, f.name)):
                    continue
                key, shown = prefix + f.name, docs.get(prefix + f.name, "")
                declared = [d for cls in type(section).__mro__ if dataclasses.is_dataclass(cls)
                            for d in [_declaration(cls, f.name)] if d is not None]
                commented = [d for d in declared if d["beside"] or (d["above"] and not d["heads_run"])]
                if commented:
                    own = commented[0]  # the most derived class that comments it
                    expected = own["beside"] or own["above"]
                    if shown != expected:
                        problems.append(f"{key} shows {shown!r}; its own comment ({own['where']}) is {expected!r}")
                elif shown:
                    problems.append(f"{key} shows {shown!r} but has no comment of its own")
                if shown and shown in seen:
                    problems.append(f"{key} and {seen[shown]} show the same meaning {shown!r}")
                seen[shown or key] = key
                if not shown and type(section).__module__ == config_module.__name__:
                    problems.append(f"{key} ({type(section).__name__}) has no meaning")
    assert problems == [], "\n".join(dict.fromkeys(problems))
    listed = listing(Config(), "train.")  # what the command prints is these meanings
    assert "train.eval_batches=4  # " + field_docs(Config())["train.eval_batches"] in listed.splitlines()


def test_parallel_sections_read_their_flat_keys_of_before(tmp_path):
    """ParallelConfig's sections (issue 54) keep the flat keys of before working: on `--set`,
    in a --config file, and in a checkpoint's recorded config; each section is the very spec
    the step's layout carries."""
    import jax

    from jaxpar.checks import validate
    from jaxpar.config import RENAMED_KEYS
    from jaxpar.config_record import rebuild, record
    from jaxpar.config_text import read_toml
    from jaxpar.step.layout import layout_for

    asked = {"parallel.tensor.sequence_parallel": "true", "parallel.tensor.collective_matmul": "ring",
             "parallel.zero.stage": "3", "parallel.zero.offload_optimizer": "true", "parallel.zero.hpz": "true",
             "parallel.zero.quantized_weights": "true", "parallel.zero.quantized_gradients": "true",
             "parallel.zero.quantization_block": "64", "parallel.compression.method": "topk",
             "parallel.compression.powersgd_rank": "2", "parallel.compression.topk_fraction": "0.5",
             "parallel.context.impl": "ulysses", "parallel.context.layout": "contiguous", "parallel.context.block": "16",
             "parallel.context.kernel": "pallas_interpret", "parallel.pipeline.schedule": "gpipe",
             "parallel.pipeline.chunks": "2", "parallel.rules.storage": "embed=fsdp", "parallel.rules.compute": "mlp=tensor",
             "parallel.rules.on_replicated": "error"}
    assert set(asked) == set(RENAMED_KEYS.values())
    old = {new: flat for flat, new in RENAMED_KEYS.items()}
    new_form = apply_overrides(Config(), [f"{k}={v}" for k, v in asked.items()])
    assert new_form != Config()
    assert apply_overrides(Config(), [f"{old[k]}={v}" for k, v in asked.items()]) == new_form
    path = tmp_path / "old.toml"
    path.write_text("[parallel]\nzero_stage = 2\npipeline_schedule = \"gpipe\"\n")
    assert apply_overrides(Config(), read_toml(str(path))) == apply_overrides(
        Config(), ["parallel.zero.stage=2", "parallel.pipeline.schedule=gpipe"])
    saved = record(new_form)
    saved["config"] = {old.get(k, k): v for k, v in saved["config"].items()}
    assert "parallel.zero_stage" in saved["config"] and rebuild(saved, "an old record", 1) == new_form
    config = apply_overrides(Config(), ["parallel.zero.stage=1", "parallel.tensor.sequence_parallel=true"])
    layout = layout_for(config, jax.devices()[:1], validate(config, 1, "cpu"))
    parallel = config.parallel
    assert (layout.tensor, layout.zero, layout.compression, layout.context, layout.pipeline) == (
        parallel.tensor, parallel.zero, parallel.compression, parallel.context, parallel.pipeline)
