"""Text in (jaxpar.data.text, data.source=text): documents from .txt, .jsonl and .parquet,
a tokenizer.json, packing that keeps document boundaries, rows in epochs
(jaxpar.data.order), each process's own rows, `jaxpar tokenize`, bad input refused before
compile, a held-out loss on text, and a killed run resumed on two processes repeating the
uninterrupted one's losses bitwise.

Here the held-out loss of a text run; the reading and tokenizing: tests/unit/test_text_data.py."""

import json

import numpy as np
import pytest

from jaxpar.config import apply_overrides
from jaxpar.data.heldout import HELD_OUT_STEP, HeldOutTokens
from jaxpar.data.sources import make_source
from jaxpar.train import build, run

WORDS = ("the cat sat on a mat while dog ran far away from big red house near river under old bridge "
         "café naïve garden light rain fell slowly over green hills and quiet town people walked home").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """150 documents of 2 to 30 words, the tokenizer.json of a word-level tokenizer trained on
    them ([UNK] 0, <|endoftext|> 1, then the 36 words: 38 tokens), and the documents as a JSONL
    file, a Parquet file of two row groups and a folder of .txt files."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, rng.integers(2, 31))) for _ in range(150)]
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"]))
    tokenizer.save(str(root / "tokenizer.json"))
    lines = [json.dumps({"id": i, "text": d}) for i, d in enumerate(docs)]
    (root / "docs.jsonl").write_text("\n".join(lines[:70] + [""] + lines[70:]) + "\n")  # a blank line is no document
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs, "id": range(150)}), root / "docs.parquet", row_group_size=100)
    (root / "txt").mkdir()
    for i, d in enumerate(docs):
        (root / "txt" / f"{i:03d}.txt").write_text(d)
    (root / "txt" / "README.md").write_text("not a document: a folder's other files are left out")
    return {"root": root, "docs": docs, "tokenizer": str(root / "tokenizer.json"), "eos": 1}


def _expected_stream(corpus) -> np.ndarray:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(corpus["tokenizer"])
    ids = [tokenizer.encode(d, add_special_tokens=False).ids + [corpus["eos"]] for d in corpus["docs"]]
    return np.array([i for doc in ids for i in doc], np.uint16)


def _text_config(tiny_llama, corpus, *overrides):
    return apply_overrides(tiny_llama, ["mesh.data=8", "data.source=text", f"data.path={corpus['root'] / 'docs.jsonl'}",
                                        f"data.tokenizer={corpus['tokenizer']}", f"data.eos_id={corpus['eos']}",
                                        *overrides])


def test_held_out_loss_on_text(tiny_llama, corpus):
    """data.eval_fraction holds out the stream's tail; with epochs, held-out batch i is the
    held-out rows i * B to (i + 1) * B - 1 in order, and train.eval_every reports its loss."""
    config = _text_config(tiny_llama, corpus, "data.order=epochs", "data.eval_fraction=0.2", "train.eval_every=2",
                          "train.eval_batches=2", "model.num_layers=1")
    trainer = build(config)
    training = make_source(trainer.batch, trainer.config)
    held = HeldOutTokens(training)
    stream = _expected_stream(corpus)
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
