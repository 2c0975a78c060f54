"""Text in (jaxpar.data.text, data.source=text): documents from .txt, .jsonl and .parquet,
a tokenizer.json, packing that keeps document boundaries, rows in epochs
(jaxpar.data.order), each process's own rows, `jaxpar tokenize`, bad input refused before
compile, a held-out loss on text, and a killed run resumed on two processes repeating the
uninterrupted one's losses bitwise.

Here the held-out loss of a text run; the reading and tokenizing: tests/unit/test_text_data.py."""

import numpy as np

from jaxpar.data.heldout import HELD_OUT_STEP, HeldOutTokens
from jaxpar.data.sources import make_source
from jaxpar.train import build, run

from ..unit.test_text_data import corpus, expected_stream, text_config  # noqa: F401  the corpus fixture, shared


def test_held_out_loss_on_text(tiny_llama, corpus):
    """data.eval_fraction holds out the stream's tail; with epochs, held-out batch i is the
    held-out rows i * B to (i + 1) * B - 1 in order, and train.eval_every reports its loss."""
    config = text_config(tiny_llama, corpus, "data.order=epochs", "data.eval_fraction=0.2", "train.eval_every=2",
                          "train.eval_batches=2", "model.num_layers=1")
    trainer = build(config)
    training = make_source(trainer.batch, trainer.config)
    held = HeldOutTokens(training)
    stream = expected_stream(corpus)
    cut = len(stream) - int(len(stream) * 0.2)
    np.testing.assert_array_equal(training.tokens, stream[:cut])
    np.testing.assert_array_equal(held.tokens, stream[cut:])
    rows = (len(held.tokens) - 1) // 16
    batch = held.local(HELD_OUT_STEP + 3, slice(0, 16))["inputs"]
    for j, row in enumerate((3 * 16 + np.arange(16)) % rows):
        np.testing.assert_array_equal(batch[j], held.tokens[row * 16 : row * 16 + 16])
    history = run(trainer, progress=False)
    assert [r["step"] for r in history if "eval_loss" in r] == [2, 3]  # after 2 steps, and the last (steps done)
    assert all(np.isfinite(r["eval_loss"]) for r in history if "eval_loss" in r)
