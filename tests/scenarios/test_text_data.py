"""Text in (jaxpar.data.text, data.source=text): documents from .txt, .jsonl and .parquet,
a tokenizer.json, packing that keeps document boundaries, rows in epochs
(jaxpar.data.order), each process's own rows, `jaxpar tokenize`, bad input refused before
compile, a held-out loss on text, and a killed run resumed on two processes repeating the
uninterrupted one's losses bitwise.

Here a text run killed and resumed on two processes; the reading and tokenizing:
tests/unit/test_text_data.py."""

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from jaxpar.train import build, run
from jaxpar.loop.metrics import JsonLines


# ------------------------------------------------------------------ killed, resumed on two processes

def _cli(*args):
    return subprocess.Popen([sys.executable, "-m", "jaxpar.commands", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("data", ["text", "mix"])
def test_text_run_resumed_on_two_processes_repeats_the_losses_bitwise(tmp_path, data):
    """Issue 22's acceptance: the fine-tune of a Hugging Face Llama (tests/golden/llama_tied,
    its tokenizer.json and end-of-text id, by the recipe hf:DIR) on a text file, in epochs,
    resumed by `jaxpar launch` on two processes of four devices from a checkpoint that one
    process wrote after three steps: every later step's loss equals that of the one process
    running on, bitwise. (The later checkpoints of that run are removed, as if it had been
    killed after step 3; a SIGKILL at any point: tests/scenarios/test_checkpoint.py. data=2 x fsdp=2 x
    tensor=2 is bitwise across process counts as is: no sum over more than 2 devices;
    docs/distributed.md.) Issue 59's too: the same with the text in a mixture beside
    synthetic tokens (data.source=mix), each process building its rows of both."""
    golden = pathlib.Path(__file__).parents[1] / "golden"
    steps = 10  # about 7 steps an epoch: the resumed run crosses into the second
    sets = ["train.seq_len=32", "train.global_batch=16", "train.compute_dtype=float32", f"train.steps={steps}",
            "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "data.order=epochs", "optim.lr=3e-3", "checkpoint.every=3",
            "checkpoint.keep=10"]
    sets += (["data.source=text", f"data.path={golden / 'corpus.txt'}"] if data == "text" else
             ["data.source=mix", f"data.mix=0.6 text:{golden / 'corpus.txt'}, 0.4 synthetic"])
    recipe = f"hf:{golden / 'llama_tied'}"
    alone, metrics, ckpt = tmp_path / "alone.jsonl", tmp_path / "m.jsonl", tmp_path / "ckpt"
    train = lambda metrics: ["train", recipe, "--no-progress", "--metrics-file", str(metrics),  # noqa: E731
                             *[x for s in sets + [f"checkpoint.dir={ckpt}"] for x in ("--set", s)]]
    # The one process is this one: `jaxpar train`'s config, trainer and loop on the same 8
    # devices (XLA's in-process collectives, as in a child of its own, which cost 5 s more).
    import jax

    from jaxpar.recipes import resolve_config

    config = resolve_config(recipe, sets + [f"checkpoint.dir={ckpt}"], len(jax.devices()))
    run(build(config), writers=[JsonLines(str(alone))], progress=False)
    saved = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert saved[0] == 3 and len(saved) > 1, saved
    for step in saved[1:]:
        shutil.rmtree(ckpt / str(step))

    resumed = _cli("launch", "--nproc", "2", "--cpu-devices-per-proc", "4", "--", *train(metrics))
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    assert "resumed from step 3" in out and "on 8 cpu devices in 2 processes" in out, out
    want = [(r["step"], r["loss"]) for r in _rows(alone)]
    assert [s for s, _ in want] == list(range(1, steps + 1))
    want = [(s, loss) for s, loss in want if s > 3]
    assert [(r["step"], r["loss"]) for r in _rows(metrics)] == want
