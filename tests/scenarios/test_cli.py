"""`jaxpar train` end to end: a short run of the llama recipe writes its metrics rows and plain
lines. The command line's parsing and refusals: tests/unit/test_cli.py."""

import json

import pytest

from jaxpar.commands import main


@pytest.mark.smoke  # the smoke tier: jaxpar train
def test_train_writes_metrics(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    overrides = ["train.steps=5", "model.num_layers=1", "train.seq_len=32", "train.log_every=2"]
    args = ["train", "llama", "--no-progress", "--metrics-file", str(path)]
    assert main(args + [x for o in overrides for x in ("--set", o)]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # steps done, as the plain lines count
    assert {"step", "loss", "grad_norm", "learning_rate", "tokens_per_s", "nonfinite", "first_nonfinite_grad",
            "nonfinite_grads"} <= set(rows[0])
    assert set(rows[0]) - readme_metrics() == set(), "README.md's metrics fields lack these"
    assert (rows[0]["nonfinite"], rows[0]["first_nonfinite_grad"], rows[0]["nonfinite_grads"]) == (0, -1, 0)
    assert all(type(rows[0][k]) is int for k in ("nonfinite", "first_nonfinite_grad", "nonfinite_grads"))
    out = capsys.readouterr().out
    assert "mesh data=2 fsdp=2 tensor=2 on 8 cpu devices" in out
    # without a bar, a plain line every train.log_every steps and after the last
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/5", "step 4/5", "step 5/5"], out
    assert f"loss {rows[1]['loss']:.4f} | grad_norm {rows[1]['grad_norm']:.3g} | lr " in lines[0], lines[0]


def readme_metrics() -> set[str]:
    """The fields README.md says a metrics row can have (its `--metrics-file` paragraph)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    paragraph = text[text.index("`--metrics-file` writes one JSON object per step"):text.index("`jaxpar plot RUN.jsonl")]
    return set(re.findall(r"`([a-z_]+)`", paragraph))
