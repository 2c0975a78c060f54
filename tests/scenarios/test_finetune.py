"""Issue 22's acceptance, end to end on 8 CPU devices, through the CLI as a user runs it: a
tiny Hugging Face Llama (tied embeddings, GQA, llama3 RoPE scaling; tests/golden/llama_tied)
imported into fsdp 2 x tensor 4, fine-tuned on a text file tokenized by its tokenizer.json
with a held-out split, exported (by one process, and by two: the same files), re-imported
(identical logits), and sampled."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np

from jaxpar.commands import main
from jaxpar.hf import model_config, prepare_import
from jaxpar.train import build
from jaxpar.loop.checkpoint import Checkpoints, saved_config
from jaxpar.generate.inference import forward

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"
FINETUNE = ["mesh.fsdp=2", "mesh.tensor=4", "data.source=text", f"data.path={GOLDEN / 'corpus.txt'}",
            "data.order=epochs", "data.eval_fraction=0.1", "train.eval_every=4", "train.eval_batches=2",
            "train.steps=12", "train.global_batch=8", "train.seq_len=32", "train.compute_dtype=float32",
            "optim.lr=3e-3", "optim.warmup_steps=2"]


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def test_a_hugging_face_llama_is_fine_tuned_on_text_exported_reimported_and_sampled(tmp_path, capsys, monkeypatch):
    """Trained as the docs say, from the repository root with relative paths; exported and
    sampled from another folder."""
    ckpt, metrics, out = tmp_path / "ckpt", tmp_path / "metrics.jsonl", tmp_path / "exported"
    monkeypatch.chdir(GOLDEN.parents[1])
    code = main(["train", "hf:tests/golden/llama_tied", "--no-progress", "--metrics-file", str(metrics),
                 *_sets(FINETUNE + [f"checkpoint.dir={ckpt}"])])
    printed = capsys.readouterr().out
    assert code == 0 and f"started from the weights of {GOLDEN.absolute() / 'llama_tied'}" in printed
    assert f"data: text '{GOLDEN / 'corpus.txt'}' | 1 document, " in printed  # what it trains on, first
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    held_out = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(held_out) == 3 and held_out[-1] < held_out[0] - 0.5, held_out  # the fine-tune learned the corpus

    monkeypatch.chdir(tmp_path)  # the tokenizer the run recorded is found from here too
    assert main(["export", str(ckpt), str(out)]) == 0
    assert "exported step 12" in capsys.readouterr().out
    launched = subprocess.run([sys.executable, "-m", "jaxpar.commands", "launch", "--nproc", "2", "--cpu-devices-per-proc", "4",
                               "--", "export", str(ckpt), str(tmp_path / "by_two")], capture_output=True, text=True, timeout=600)
    assert launched.returncode == 0, launched.stderr[-3000:]  # two processes gather, process 0 writes: the same bytes
    assert sorted(p.name for p in (tmp_path / "by_two").iterdir()) == sorted(p.name for p in out.iterdir())
    assert all((tmp_path / "by_two" / p.name).read_bytes() == p.read_bytes() for p in out.iterdir())
    assert (out / "tokenizer.json").is_file() and model_config(out) == model_config(GOLDEN / "llama_tied")
    # where generation stops: the end of text the run trained with (data.eos_id=2, config.json's), in both files
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2
    trainer = build(saved_config(ckpt))  # fsdp 2 x tensor 4, as trained
    checkpoints = Checkpoints.open(ckpt)
    trained, _ = checkpoints.restore(trainer)
    checkpoints.close()
    tokens = np.tile(np.load(GOLDEN / "llama_tied" / "tokens.npy"), (4, 1))[:8, :16]
    apply = forward(trainer)
    reimported = prepare_import(trainer, out)()
    np.testing.assert_array_equal(np.asarray(apply(reimported.params, {"inputs": tokens})),
                                  np.asarray(apply(trained.params, {"inputs": tokens})))

    assert main(["sample", str(ckpt), "--prompt", "The old ship", "--max-new-tokens", "12", "--set", "mesh.tensor=4"]) == 0
    text = capsys.readouterr().out.strip().splitlines()[-1]
    assert text.startswith("The old ship") and len(text) > len("The old ship") + 5, text


def test_export_refuses_in_one_line_before_restoring(tmp_path, capsys):
    """A Hugging Face folder for CHECKPOINT, a file or a full folder for OUT, or OUT under a
    file: one line each, before any checkpoint is read."""
    folder = GOLDEN / "llama_tied"
    run = tmp_path / "run"  # never read: OUT is checked first
    (tmp_path / "a_file").write_text("")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = {
        (str(folder), str(tmp_path / "out")): f"CHECKPOINT='{folder}' is a Hugging Face checkpoint already (config.json "
        f"and safetensors files), not a jaxpar run's checkpoint.dir; fine-tune it with jaxpar train hf:{folder} --set "
        "checkpoint.dir=DIR ..., then export DIR",
        (f"hf:{folder}", str(tmp_path / "out")): f"CHECKPOINT='hf:{folder}' is a Hugging Face checkpoint already",
        (str(run), str(tmp_path / "a_file")): f"OUT='{tmp_path / 'a_file'}' is a file; give a new folder to export into "
        "(it will hold config.json, the safetensors files and the tokenizer)",
        (str(run), str(tmp_path / "full")): f"OUT='{tmp_path / 'full'}' is a folder that holds files already; give a "
        "new or empty folder to export into",
        (str(run), str(tmp_path / "a_file" / "out")): f"OUT='{tmp_path / 'a_file' / 'out'}': '{tmp_path / 'a_file'}' "
        "is a file, so no folder can be made under it; give another path",
    }
    for (checkpoint, out), message in cases.items():
        assert main(["export", checkpoint, out]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"jaxpar: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
