"""Sampling (jaxpar.generate.sample, `jaxpar sample`): greedy generation on sharded layouts
equals a plain greedy loop on one device, token for token; top-k and temperature draws; the
command end to end from a checkpoint directory alone (jaxpar.loop.checkpoint.saved_config),
and its refusals of bad input."""

import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.checks import base_config
from jaxpar.config import apply_overrides
from jaxpar.errors import ConfigError
from jaxpar.commands import main as jaxpar_main
from jaxpar.train import build
from jaxpar.loop.checkpoint import saved_config
from jaxpar.generate.inference import unsharded_model
from jaxpar.loop.run import run
from jaxpar.generate.sample import choose, generate
from jaxpar.testing import initial_state

PROMPT = [5, 17, 3, 99, 42]
GOLDEN = pathlib.Path(__file__).parents[1] / "golden" / "llama_tied"  # a tiny Llama in Hugging Face's format
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "to", "big", "red", "house", "and", "then", "slept"]


def main(argv: list[str]) -> int:
    """`jaxpar sample ARGV`."""
    return jaxpar_main(["sample", *argv])


def _greedy_on_one_device(model, prompt: list[int], new: int) -> list[int]:
    """The plain loop: the whole sequence so far through the unsharded model, argmax of the last logits."""
    apply, ids = nnx.jit(lambda module, inputs: module(inputs)), list(prompt)
    for _ in range(new):
        ids.append(int(jnp.argmax(apply(model, jnp.asarray([ids]))[0, -1])))
    return ids[len(prompt):]


def test_greedy_on_sharded_layouts_equals_a_greedy_loop_on_one_device(tiny_llama):
    layouts = {"tensor4": ["mesh.tensor=4"],  # data=2 x tensor=4: vocab-parallel head, batch rows 2
               "fsdp2_tensor2_sp": ["mesh.fsdp=2", "mesh.tensor=2", "parallel.tensor.sequence_parallel=true"]}
    trainers = {name: build(apply_overrides(tiny_llama, layout)) for name, layout in layouts.items()}
    states = {name: initial_state(trainer) for name, trainer in trainers.items()}  # random weights, the same in each
    want = _greedy_on_one_device(unsharded_model(trainers["tensor4"], states["tensor4"]), PROMPT, 6)
    for name, trainer in trainers.items():  # with the key/value cache (the default) and without
        assert generate(trainer, states[name].params, PROMPT, 6) == want, name
        assert generate(trainer, states[name].params, PROMPT, 6, kv_cache=False) == want, name
    tensor4, params = trainers["tensor4"], states["tensor4"].params
    assert generate(tensor4, params, PROMPT, 6, stop_ids=[want[2]]) == want[:3]  # stops at a stop id, included
    assert generate(tensor4, params, PROMPT, 6, stop_ids={127, want[4], want[1]}) == want[:2]  # at the first drawn
    with pytest.raises(ConfigError, match=r"^stop_ids=2; give a collection of token ids, e.g. stop_ids=\[2\]"):
        generate(tensor4, params, PROMPT, 6, stop_ids=2)
    # one key/value head on tensor 4: repeated at use, the cache holds each device's copy
    one_kv = build(apply_overrides(tiny_llama, ["mesh.tensor=4", "model.num_kv_heads=1"]))
    state = initial_state(one_kv)
    assert generate(one_kv, state.params, PROMPT, 6) == _greedy_on_one_device(unsharded_model(one_kv, state), PROMPT, 6)


def test_sampling_under_stages_warns_of_the_whole_model_on_each_device(tiny_llama):
    """stage=2 x data=4: parameters rest half on each stage (the layers), replicated over
    data; to sample, each device holds the whole model, every parameter's bytes. The tokens
    are those of the same weights with no pipeline."""
    import warnings

    from jaxpar.generate.sample import StagesGathered
    from jaxpar.units import byte_size

    piped = build(apply_overrides(tiny_llama, ["mesh.stage=2", "train.microbatches=2"]))
    params = initial_state(piped).params
    whole = sum(x.nbytes for x in jax.tree.leaves(params))
    resting = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
    assert resting < whole
    gathered = f"{byte_size(whole)} of parameters per device (training holds {byte_size(resting)})"
    with pytest.warns(StagesGathered, match=rf"^mesh.stage=2: sampling runs the whole model on every device, not "
                      rf"stage by stage, so each device gathers every stage's layers: {re.escape(gathered)}; where"):
        piped_tokens = generate(piped, params, PROMPT, 3)
    plain = build(apply_overrides(tiny_llama, ["mesh.data=8"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", StagesGathered)  # none without stages
        assert generate(plain, initial_state(plain).params, PROMPT, 3) == piped_tokens


def test_top_k_one_is_greedy_and_draws_are_reproducible(tiny_llama):
    trainer = build(apply_overrides(tiny_llama, ["mesh.tensor=4"]))
    params = initial_state(trainer).params
    greedy = generate(trainer, params, PROMPT, 6)
    assert generate(trainer, params, PROMPT, 6, temperature=1.0, top_k=1, seed=3) == greedy
    drawn = {seed: generate(trainer, params, PROMPT, 6, temperature=1.0, seed=seed) for seed in (0, 0, 1)}
    assert generate(trainer, params, PROMPT, 6, temperature=1.0, seed=0) == drawn[0]
    assert drawn[0] != drawn[1]
    assert max(generate(trainer, params, PROMPT, 6, temperature=1.0, seed=0, vocab_limit=10)) < 10


def test_prompts_of_different_lengths_in_one_batch_continue_as_each_alone(tiny_llama):
    """Three prompts of 5, 2 and 8 tokens in one buffer (4 rows over data=2 x tensor=4): each
    row reads its next token at its own position and continues as it does alone, token for
    token; a row that draws the end-of-text id stops there while the others go on."""
    from jaxpar.generate.sample import generate_batch

    trainer = build(apply_overrides(tiny_llama, ["mesh.tensor=4"]))
    params = initial_state(trainer).params
    prompts = [PROMPT, PROMPT[:2], [7, 8, 9, 10, 11, 12, 13, 14]]
    together = generate_batch(trainer, params, prompts, 5, length=16)
    assert together == [generate_batch(trainer, params, [p], 5, length=16)[0] for p in prompts]
    from jaxpar.generate.sample import cached_steps

    # compiled once a buffer shape, whatever the prompts' lengths: [4, 16] (three prompts) and [2, 16] (one)
    assert [step._cache_size() for step in cached_steps(trainer)] == [2, 2]
    eos, turn = together[1][1], together[0][2]  # each row stops at the first of either it draws
    stopped = generate_batch(trainer, params, prompts, 5, stop_ids=(eos, turn), length=16)
    first = lambda d: min((d.index(t) for t in (eos, turn) if t in d), default=len(d) - 1)
    assert stopped == [d[:first(d) + 1] for d in together] and len(stopped[1]) == 2 and len(stopped[0]) <= 3


def test_draws_stay_within_the_top_k():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=64), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 2000)
    draw = jax.vmap(choose, in_axes=(None, None, None, None, 0))
    top3 = set(np.argsort(-np.asarray(logits))[:3].tolist())
    assert set(np.asarray(draw(logits, 2.0, 3, 1.0, keys)).tolist()) == top3  # every one of them, nothing else
    assert len(set(np.asarray(draw(logits, 2.0, 0, 1.0, keys)).tolist())) > 10  # top_k=0: the whole vocabulary
    assert set(np.asarray(draw(logits, 0.0, 3, 1.0, keys)).tolist()) == {int(jnp.argmax(logits))}  # greedy


# ------------------------------------------------------------------ the command


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> str:
    """A word-level tokenizer of 16 tokens (the tiny Llama has 128)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {word: i for i, word in enumerate(["[UNK]"] + WORDS)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, tokenizer_file) -> tuple[str, object]:
    """A tiny Llama (tests/conftest.py's tiny_llama, as jaxpar.checks.base_config gives it)
    trained 3 steps on text (data.source=text) on fsdp x tensor with sequence parallelism."""
    folder = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(0)
    (folder / "corpus.txt").write_text(" ".join(rng.choice(WORDS, size=400)))
    directory = str(folder / "checkpoints")
    config = apply_overrides(base_config("llama"), [
        "mesh.fsdp=2", "mesh.tensor=2", "parallel.tensor.sequence_parallel=true", f"checkpoint.dir={directory}",
        "data.source=text", f"data.path={folder / 'corpus.txt'}", f"data.tokenizer={tokenizer_file}"])
    run(build(config), progress=False)
    return directory, config


def test_sample_command_prints_the_continuation_from_the_checkpoint_alone(checkpoint_dir, capsys, tmp_path):
    directory, config = checkpoint_dir
    assert saved_config(directory) == config  # the model's class and every section, as trained
    assert main([directory, "--prompt", "the cat sat", "--max-new-tokens", "5", "--set", "mesh.tensor=4"]) == 0
    header, text = capsys.readouterr().out.splitlines()
    assert "step 3: LlamaConfig | mesh data=2 tensor=4 on 8 cpu devices | 5 tokens, greedy" in header
    assert text.startswith("the cat sat ") and len(text.split()) == 3 + 5
    # --file: many prompts of different lengths, --batch of them a buffer, one JSON line an answer
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a dog", "the cat sat", "the big red house and")))
    out = tmp_path / "answers.jsonl"
    assert main([directory, "--file", str(prompts), "--out", str(out), "--batch", "2", "--max-new-tokens", "5",
                 "--set", "mesh.tensor=4"]) == 0
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["prompt"] for a in answers] == ["a dog", "the cat sat", "the big red house and"]
    assert answers[1]["prompt"] + answers[1]["completion"] == text  # as that prompt alone
    assert all(a["tokens"] == 5 and not a["stopped"] for a in answers) and not (tmp_path / "answers.jsonl.partial").exists()
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote 3 answers to {out}"


def test_sample_command_draws_with_temperature_and_top_k(checkpoint_dir, capsys):
    directory, _ = checkpoint_dir
    args = [directory, "--prompt", "a dog", "--max-new-tokens", "4", "--temperature", "0.8", "--top-k", "5"]
    assert all(main(args + ["--seed", str(seed)]) == 0 for seed in (1, 1, 2, 3, 4))
    texts = capsys.readouterr().out.splitlines()[1::2]
    assert texts[0] == texts[1] and texts[0].startswith("a dog ")  # a seed gives its text again
    assert len(set(texts)) > 1  # and the seeds draw: not greedy, not one fixed text


def test_a_checkpoint_without_its_model_class_is_refused_in_one_line(checkpoint_dir, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(checkpoint_dir[0], old)
    meta_file = old / "3" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["model_class"]  # as written before checkpoints recorded it
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="was written before checkpoints recorded their model's class"):
        saved_config(old)
    assert main([str(old), "--prompt", "the cat"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "train.steps=4" in err


def test_a_checkpoint_from_before_a_model_field_existed_restores_at_its_default(checkpoint_dir, tmp_path):
    """model.scale_tied_logits came after the first checkpoints: a record without it is read
    as its default, as long as this run keeps the default too."""
    from jaxpar.config import apply_overrides
    from jaxpar.train import build
    from jaxpar.loop.checkpoint import Checkpoints

    old = tmp_path / "old"
    shutil.copytree(checkpoint_dir[0], old)
    meta_file = old / "3" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["config"]["model.scale_tied_logits"]
    meta_file.write_text(json.dumps(meta))
    config = checkpoint_dir[1]
    checkpoints = Checkpoints.open(old, async_save=False)
    try:
        assert checkpoints.restore(build(config))[1] == 3
        with pytest.raises(ConfigError, match=r"written with model.scale_tied_logits=None, but this run has .*False"):
            checkpoints.restore(build(apply_overrides(config, ["model.scale_tied_logits=false"])))
    finally:
        checkpoints.close()


@pytest.fixture(scope="module")
def large_tokenizer(tmp_path_factory) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(200)}
    path = tmp_path_factory.mktemp("large") / "tokenizer.json"
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0")).save(str(path))
    return str(path)


@pytest.mark.parametrize("args, message", [
    (["{missing}", "--prompt", "the"], "CHECKPOINT='{missing}' is not a directory"),
    (["{empty}", "--prompt", "the"], "holds no checkpoint; give the checkpoint.dir of a run that saved some"),
    (["{ckpt}", "--prompt", "the", "--step", "7"], "has no checkpoint for step 7; it holds steps [3]"),
    (["{ckpt}", "--prompt", "the", "--tokenizer", "{missing}"], "--tokenizer='{missing}' is not a file"),
    (["{ckpt}", "--prompt", "the", "--tokenizer", "{checkpoint_file}"], "is not a readable tokenizer.json"),
    (["{ckpt}", "--prompt", "the", "--tokenizer", "{large}"],
     "has 200 tokens, more than the checkpoint's model.vocab_size=128"),
    (["{ckpt}", "--prompt", "the", "--set", "data.tokenizer="], "--tokenizer is not given and the checkpoint's "
                                                                 "data.tokenizer is empty"),
    (["{ckpt}", "--prompt", "the", "--temperature", "-1"], "--temperature=-1.0; use 0 for greedy"),
    (["{ckpt}", "--prompt", "the", "--top-k", "-2"], "--top-k=-2; use 0 for the whole vocabulary"),
    (["{ckpt}", "--prompt", ""], "--prompt='' is empty"),
    (["{ckpt}", "--prompt", "   "], "--prompt='   ' encodes to no tokens"),
    (["{ckpt}", "--prompt", "the", "--max-new-tokens", "0"], "--max-new-tokens=0; give at least 1"),
    (["{ckpt}", "--file", "{bad_prompts}"], "--file='{bad_prompts}' line 2 has no \"prompt\" text"),
    (["{ckpt}", "--file", "{missing}"], "--file='{missing}' is not a file"),
    (["{ckpt}", "--prompt", "the", "--out", "{missing}"], "--out applies to --file's prompts"),
    (["{ckpt}", "--file", "{bad_prompts}", "--batch", "0"], "--batch=0; give at least 1"),
    (["{ckpt}", "--prompt", "the", "--set", "mesh.tensor=3"],
     "mesh.tensor=3 does not divide the 8 devices"),
    (["{golden}", "--prompt", "the"], "CHECKPOINT='{golden}' is a Hugging Face checkpoint (config.json and safetensors "
     "files), not a jaxpar run's checkpoint.dir; sample its weights as they are with jaxpar sample hf:{golden} ..., or "
     "fine-tune it with jaxpar train hf:{golden} --set checkpoint.dir=DIR ... and sample DIR"),
    (["hf:{golden}", "--prompt", "the", "--step", "3"], "--step=3 picks a step of a run's checkpoint.dir, but "
     "CHECKPOINT='hf:{golden}' is a Hugging Face checkpoint, one set of weights; leave --step out"),
])
def test_bad_input_is_one_line_naming_the_argument(checkpoint_dir, large_tokenizer, tmp_path, capsys, args, message):
    (tmp_path / "empty").mkdir()
    names = {"missing": str(tmp_path / "missing"), "empty": str(tmp_path / "empty"), "ckpt": checkpoint_dir[0],
             "large": large_tokenizer, "checkpoint_file": str(tmp_path / "not_json"), "golden": str(GOLDEN),
             "bad_prompts": str(tmp_path / "prompts.jsonl")}
    (tmp_path / "not_json").write_text("not a tokenizer")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "the"}\n{"text": "the"}\n')
    assert main([a.format(**names) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.format(**names) in err, err


def test_a_hugging_face_checkpoint_samples_as_published(capsys, monkeypatch):
    """hf:FOLDER: the recipe hf:FOLDER's model, its weights read onto the mesh, its tokenizer,
    and the id that tokenizer puts before a text (Gemma 3's <bos>, data.bos_id) before the
    prompt's own ids."""
    import jaxpar.generate.sample

    folder, seen = GOLDEN.parent / "gemma3", []
    batch = jaxpar.generate.sample.generate_batch
    monkeypatch.setattr(jaxpar.generate.sample, "generate_batch", lambda trainer, params, prompts, *a, **k: (
        seen.extend(list(p) for p in prompts), batch(trainer, params, prompts, *a, **k))[1])
    assert main([f"hf:{folder}", "--prompt", "The old ship", "--max-new-tokens", "4", "--set", "mesh.tensor=4"]) == 0
    header, text = capsys.readouterr().out.splitlines()
    assert header == (f"hf:{folder} as published: Gemma3Config | mesh data=2 tensor=4 on 8 cpu devices | 4 tokens, greedy, "
                      "kv cache")
    assert text.startswith("The old ship") and len(text) > len("The old ship")
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode("The old ship").ids  # <bos> first, as Gemma's
    assert seen == [ids] and ids[0] == 1 and 1 not in ids[1:]


def test_a_relative_tokenizer_path_of_an_older_run_is_one_line_naming_the_folder_before_any_restore(
        checkpoint_dir, tokenizer_file, tmp_path, monkeypatch, capsys):
    """A run recorded data.tokenizer relative to the folder it trained in (as jaxpar did
    before it recorded paths absolute); sample and export run from elsewhere name the path
    and the folder it was resolved against, before building or restoring anything."""
    from jaxpar import train
    from jaxpar.commands import main as cli_main

    old, trained_in, elsewhere = tmp_path / "old", tmp_path / "trained_in", tmp_path / "elsewhere"
    shutil.copytree(checkpoint_dir[0], old)
    (trained_in / "tok").mkdir(parents=True)
    shutil.copy(tokenizer_file, trained_in / "tok" / "tokenizer.json")
    meta_file = old / "3" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["config"]["data.tokenizer"] = "tok/tokenizer.json"
    meta_file.write_text(json.dumps(meta))
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(train, "build", lambda *a, **k: pytest.fail("built a trainer before the check"))
    recorded = f"data.tokenizer='tok/tokenizer.json' (as the run recorded it in '{old}') is a relative path, not " \
               f"found from this folder, '{elsewhere}'; run from the folder the run was trained in, or give "
    assert main([str(old), "--prompt", "the cat"]) == 2
    assert capsys.readouterr().err == f"jaxpar: error: {recorded}--tokenizer PATH\n"
    assert cli_main(["export", str(old), str(tmp_path / "out")]) == 2
    export_hint = "--set data.tokenizer=PATH to the run's tokenizer.json"
    assert capsys.readouterr().err == f"jaxpar: error: {recorded}{export_hint}\n"
    assert not (tmp_path / "out").exists()


def test_a_chat_answer_stops_at_the_templates_end_of_turn(tmp_path, capsys, monkeypatch):
    """A Qwen3-style checkpoint whose config.json and generation_config.json name
    <|endoftext|> (0) as the end of text while its ChatML template ends each turn with
    <|im_end|> (2): `--chat` stops at both, plain sampling at the end of text alone, and an
    answer that ends at the end of turn is reported "stopped"."""
    import jaxpar.generate.sample

    folder = tmp_path / "qwen3_chat"
    folder.mkdir()
    chatml = GOLDEN.parent / "chat" / "chatml"  # <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2; the template inside
    for source in (GOLDEN.parent / "qwen3" / "model.safetensors", chatml / "tokenizer.json", chatml / "tokenizer_config.json"):
        shutil.copy(source, folder / source.name)
    config = json.loads((GOLDEN.parent / "qwen3" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "bos_token_id": 1}))
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Hello"}) + "\n")
    seen = []
    monkeypatch.setattr(jaxpar.generate.sample, "generate_batch", lambda trainer, params, prompts, *a, stop_ids, **k: (
        seen.append(stop_ids), [[7, 8, 2] for _ in prompts])[1])
    common = [f"hf:{folder}", "--file", str(tmp_path / "prompts.jsonl"), "--set", "mesh.tensor=4"]
    assert main(common + ["--chat"]) == 0 and main(common) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert seen == [[0, 2], [0]]
    assert [a["stopped"] for a in answers] == [True, False] and answers[0]["tokens"] == 3
