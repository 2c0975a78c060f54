"""`jaxpar plot`: metrics files drawn into one PNG; bad files refused in one line, before drawing."""

import json

import pytest

from jaxpar.commands import main


def _run(path, losses, eval_every=0):
    rows = [{"step": i + 1, "time": 0.0, "loss": loss, "grad_norm": 1.0 / (i + 1), "learning_rate": 1e-3,
             "tokens_per_s": 1000.0 + i, **({"eval_loss": loss + 0.1} if eval_every and (i + 1) % eval_every == 0 else {})}
            for i, loss in enumerate(losses)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plot_draws_several_runs_into_a_png(tmp_path, capsys):
    a = _run(tmp_path / "a.jsonl", [6.0, 4.0, 3.0, 2.5], eval_every=2)
    b = _run(tmp_path / "b.jsonl", [6.0, 5.0, 4.5, 4.0])
    out = tmp_path / "pictures" / "curves.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"wrote {out}: loss, tokens_per_s, grad_norm, learning_rate of 2 runs" in said, said
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert not list(out.parent.glob("*.partial"))


@pytest.mark.parametrize("text, message", [
    (None, "no such metrics file"),
    ("", "holds no rows"),
    ('{"step": 0, "loss": 1}\nnot json\n', r":2 is not a JSON object"),
    ('{"loss": 1}\n', r':1 has no "step"'),
])
def test_plot_refuses_a_bad_metrics_file(tmp_path, capsys, text, message):
    path = tmp_path / "m.jsonl"
    if text is not None:
        path.write_text(text)
    assert main(["plot", str(path), "--out", str(tmp_path / "c.png")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "c.png").exists()
