"""Text in (jaxpar.data.text, data.source=text): documents from .txt, .jsonl and .parquet,
a tokenizer.json, packing that keeps document boundaries, rows in epochs
(jaxpar.data.order), each process's own rows, `jaxpar tokenize`, bad input refused before
compile, a held-out loss on text, and a killed run resumed on two processes repeating the
uninterrupted one's losses bitwise.

The held-out loss of a text run: tests/equivalence/test_text_data.py; a text run killed and
resumed on two processes: tests/scenarios/test_text_data.py."""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

from jaxpar.config import apply_overrides
from jaxpar.data import text
from jaxpar.data.order import Epochs
from jaxpar.data.sources import TextSource, TokenFile, make_source
from jaxpar.commands import main as tokenize_main
from jaxpar.errors import ConfigError
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


def expected_stream(corpus) -> np.ndarray:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(corpus["tokenizer"])
    ids = [tokenizer.encode(d, add_special_tokens=False).ids + [corpus["eos"]] for d in corpus["docs"]]
    return np.array([i for doc in ids for i in doc], np.uint16)


def text_config(tiny_llama, corpus, *overrides):
    return apply_overrides(tiny_llama, ["mesh.data=8", "data.source=text", f"data.path={corpus['root'] / 'docs.jsonl'}",
                                        f"data.tokenizer={corpus['tokenizer']}", f"data.eos_id={corpus['eos']}",
                                        *overrides])


@pytest.mark.parametrize("path", ["docs.jsonl", "docs.parquet", "txt", "txt/*.txt"])
def test_documents_from_each_file_type_tokenize_alike(corpus, path):
    spec = text.TextSpec(str(corpus["root"] / path), corpus["tokenizer"], eos_id=corpus["eos"])
    files = text.document_files(spec)
    assert list(text.documents(files, spec)) == corpus["docs"]
    assert text.count_documents(files, spec) == 150
    stream = text.tokenize(spec, model_vocab=128, chunk=64)  # chunks of 64 documents: the same stream as one
    assert stream.dtype == np.uint16
    np.testing.assert_array_equal(stream, expected_stream(corpus))
    assert text.token_dtype(1 << 16) == np.uint16 and text.token_dtype((1 << 16) + 1) == np.uint32


def test_packed_rows_keep_document_boundaries(tiny_llama, corpus):
    """Every document ends with <|endoftext|>; in each row a new segment starts right after
    it, positions restart there, and its own target (the next document) weighs nothing."""
    trainer = build(text_config(tiny_llama, corpus, "data.order=epochs"))
    source = make_source(trainer.batch, trainer.config)
    assert isinstance(source, TextSource)
    np.testing.assert_array_equal(source.tokens, expected_stream(corpus))
    eos = corpus["eos"]
    for step in (0, 7):
        rows = source.local(step, slice(0, 16))
        starts = source.order.starts(step, slice(0, 16))
        for r, start in enumerate(starts):
            inputs, segments, positions = rows["inputs"][r], rows["segment_ids"][r], rows["positions"][r]
            np.testing.assert_array_equal(inputs, source.tokens[start : start + 16])
            np.testing.assert_array_equal(rows["targets"][r], source.tokens[start + 1 : start + 17])
            ends = inputs[:-1] == eos
            np.testing.assert_array_equal(np.diff(segments), ends.astype(int))  # a new segment exactly after each end
            np.testing.assert_array_equal(positions[1:], np.where(ends, 0, positions[:-1] + 1))
            np.testing.assert_array_equal(rows["weights"][r], np.where(inputs == eos, 0.0, 1.0))
    batch = source(7)  # the global batch, laid out on the devices
    assert batch["segment_ids"].sharding == trainer.batch.shardings["segment_ids"]
    # the line a run starts with: documents counted as they were read, epochs of whole rows
    tokens, rows = len(source.tokens), (len(source.tokens) - 1) // 16
    assert source.describe(30) == (f"data: text '{corpus['root'] / 'docs.jsonl'}' | 150 documents, {tokens:,} tokens | "
                                   f"30 steps x 256 tokens = {30 * 16 / rows:.3g} epochs")
    folder = text_config(tiny_llama, corpus, f"data.path={corpus['root'] / 'txt'}")
    assert make_source(trainer.batch, folder).describe(30).startswith(f"data: text '{corpus['root'] / 'txt'}' (150 files) "
                                                                       f"| 150 documents, {tokens:,} tokens | ")


def test_epochs_read_every_row_once_per_epoch_in_an_order_of_the_seed():
    seq, rows = 16, 37  # 37 rows of 17 tokens; batches of 8 straddle the epochs
    order = Epochs(rows * seq + 1 + 5, seq, 8, seed=0)  # a tail shorter than a row is left out
    assert order.rows == rows
    seen = np.concatenate([order.row_ids(step, slice(0, 8)) for step in range(14)])  # 112 rows: 3 epochs and 1
    epochs = [seen[e * rows : (e + 1) * rows] for e in range(3)]
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(rows))  # every row once
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[0], np.arange(rows))
    np.testing.assert_array_equal(order.starts(3, slice(0, 8)), order.row_ids(3, slice(0, 8)) * seq)
    other_seed = np.concatenate([Epochs(rows * seq + 1, seq, 8, seed=1).row_ids(s, slice(0, 8)) for s in range(5)])
    assert not np.array_equal(other_seed[:rows], epochs[0])
    # A fresh order (another process, a resumed run) asked for step 13 alone gives the same rows.
    np.testing.assert_array_equal(Epochs(rows * seq + 1, seq, 8, seed=0).row_ids(13, slice(2, 6)), seen[13 * 8 + 2 : 13 * 8 + 6])
    in_order = Epochs(rows * seq + 1, seq, 8, seed=0, shuffle=False, first_step=100)
    np.testing.assert_array_equal(in_order.row_ids(104, slice(0, 8)), (np.arange(32, 40) % rows))


@pytest.mark.parametrize("order", ["epochs", "windows"])
def test_each_process_builds_the_rows_of_the_global_batch(tiny_llama, corpus, order):
    """A source asked for rows [lo, hi) (what a process of a multi-process run asks for) makes
    rows lo to hi of the global batch; so does a second source, as another process would."""
    trainer = build(text_config(tiny_llama, corpus, f"data.order={order}"))
    first, second = make_source(trainer.batch, trainer.config), make_source(trainer.batch, trainer.config)
    for step in (0, 9, 23):
        whole = first.local(step, slice(0, 16))
        for lo, hi in ((0, 8), (8, 16), (4, 12)):
            part = second.local(step, slice(lo, hi))
            for field, value in whole.items():
                np.testing.assert_array_equal(part[field], value[lo:hi], err_msg=f"{order} step {step} {field}")
    np.testing.assert_array_equal(np.asarray(first(9)["inputs"]), first.local(9, slice(0, 16))["inputs"])


@pytest.fixture
def worker_pools():
    """After the test, the helper process that Python's spawned pools start (multiprocessing's
    resource tracker, which would live as long as this process) is stopped."""
    yield
    from multiprocessing import resource_tracker

    resource_tracker._resource_tracker._stop()


def test_tokenize_command_writes_what_text_reads(tiny_llama, corpus, tmp_path, capsys, worker_pools):
    jsonl, expected = corpus["root"] / "docs.jsonl", expected_stream(corpus)
    common = ["tokenize", str(jsonl), "--tokenizer", corpus["tokenizer"], "--eos-id", "1", "--no-progress"]
    assert tokenize_main(common + ["--out", str(tmp_path / "parallel.npy"), "--workers", "2", "--bos-id", "0"]) == 0
    starts = [0, *(np.flatnonzero(expected == 1)[:-1] + 1)]  # each document after the last one's end
    np.testing.assert_array_equal(np.load(tmp_path / "parallel.npy", mmap_mode="r"), np.insert(expected, starts, 0))
    assert np.load(tmp_path / "parallel.npy", mmap_mode="r").dtype == np.uint16
    assert tokenize_main(common + ["--out", str(tmp_path / "one.bin"), "--workers", "1"]) == 0
    np.testing.assert_array_equal(np.fromfile(tmp_path / "one.bin", np.uint16), expected)
    sidecar = json.loads((tmp_path / "one.bin.json").read_text())
    assert sidecar == {"tokenizer": corpus["tokenizer"], "vocab_size": 38, "dtype": "uint16", "eos_id": 1, "bos_id": -1,
                       "documents": 150, "tokens": len(expected), "source": str(jsonl), "text_field": "text"}
    line = capsys.readouterr().out.strip().splitlines()[-1]
    sets = f"--set data.source=tokens --set data.path={tmp_path / 'one.bin'} --set data.dtype=uint16 --set data.eos_id=1"
    assert line == f"jaxpar tokenize: 150 documents, {len(expected)} tokens (uint16) in {tmp_path / 'one.bin'}; " \
                   f"train on it with {sets}"
    # Trained on as the line says, the file gives the rows the text gives.
    file_trainer = build(apply_overrides(tiny_llama, ["mesh.data=8", *sets.replace("--set ", "").split()]))
    text_trainer = build(text_config(tiny_llama, corpus))
    on_file = make_source(file_trainer.batch, file_trainer.config)
    on_text = make_source(text_trainer.batch, text_trainer.config)
    assert isinstance(on_file, TokenFile) and not isinstance(on_file, TextSource)
    for field, value in on_text.local(4, slice(0, 16)).items():
        np.testing.assert_array_equal(on_file.local(4, slice(0, 16))[field], value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.bin", "one.bin.json", "parallel.npy", "parallel.npy.json"]


def test_tokenize_leaves_nothing_half_written(corpus, tmp_path, capsys, monkeypatch, worker_pools):
    """A bad line after some chunks were written, and Ctrl-C: the temporary file is gone and
    an earlier file at --out is left as it was."""
    lines = [json.dumps({"text": d}) for d in corpus["docs"] * 3]  # 450 documents: chunks of 256
    many, bad = tmp_path / "many.jsonl", tmp_path / "bad.jsonl"
    many.write_text("\n".join(lines) + "\n")
    bad.write_text("\n".join(lines[:300] + ["{not json"] + lines[300:]) + "\n")  # in the second chunk
    out = tmp_path / "out" / "tokens.bin"
    out.parent.mkdir()
    out.write_bytes(b"earlier")
    args = ["tokenize", str(bad), "--tokenizer", corpus["tokenizer"], "--out", str(out), "--no-progress"]
    for workers in ("1", "2"):
        assert tokenize_main(args + ["--workers", workers]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"jaxpar: error: PATH={str(bad)!r} line 301 is not JSON") and err.count("\n") == 1
        assert sorted(p.name for p in out.parent.iterdir()) == ["tokens.bin"] and out.read_bytes() == b"earlier"

    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return encode(*args)

    encode = text.encode
    monkeypatch.setattr(text, "encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tokenize_main(args[:1] + [str(many)] + args[2:] + ["--workers", "1"])
    assert len(calls) == 2
    assert sorted(p.name for p in out.parent.iterdir()) == ["tokens.bin"] and out.read_bytes() == b"earlier"
    assert tokenize_main(["tokenize", str(bad), "--tokenizer", corpus["tokenizer"], "--out", str(tmp_path / "x.txt")]) == 2
    assert "--out=" in capsys.readouterr().err


def test_tokenize_checks_its_output_paths_before_reading_the_corpus(corpus, tmp_path, capsys, monkeypatch):
    """--out that is a folder, in a folder missing, under a file or unwritable, or whose side
    file is a folder: one line each, and not a document read (text.documents is never called)."""
    monkeypatch.setattr(text, "documents", lambda *a: pytest.fail("read the corpus before checking --out"))
    (tmp_path / "made.bin").mkdir()
    (tmp_path / "a_file").write_text("")
    (tmp_path / "taken.npy.json").mkdir()
    (tmp_path / "locked").mkdir()
    cases = {
        "made.bin": f"--out='{tmp_path / 'made.bin'}' is a folder; give the file to write, e.g. "
                    f"--out={tmp_path / 'made.bin' / 'tokens.bin'}",
        "none/x.bin": f"--out='{tmp_path / 'none/x.bin'}': no folder '{tmp_path / 'none'}'; create it first",
        "a_file/x.bin": f"--out='{tmp_path / 'a_file/x.bin'}': '{tmp_path / 'a_file'}' is a file, not a folder; "
                        "give a path in a folder",
        "taken.npy": f"--out='{tmp_path / 'taken.npy'}': its side file '{tmp_path / 'taken.npy.json'}' is a folder; "
                     "move it, or give another --out",
        "locked/x.bin": f"--out='{tmp_path / 'locked/x.bin'}': the folder '{tmp_path / 'locked'}' is not writable by "
                        "this user; give a folder you can write",
    }

    writable = os.access  # root may write anywhere: the locked folder is locked by saying so
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(tmp_path / "locked") and writable(path, mode))
    for out, message in cases.items():
        args = ["tokenize", corpus["root"] / "docs.jsonl", "--tokenizer", corpus["tokenizer"], "--out", tmp_path / out]
        assert tokenize_main([str(a) for a in args] + ["--no-progress"]) == 2
        assert capsys.readouterr().err == f"jaxpar: error: {message}\n"


def _bad_inputs(root, corpus):
    """id -> (data overrides, the message expected)."""
    (root / "empty").mkdir()
    (root / "empty.txt").write_text(" \n")
    (root / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (root / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (root / "not_json.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    (root / "no_field.jsonl").write_text('{"body": "the cat"}\n')
    (root / "garbage.json").write_text('{"version": "1.0", "model": 5}')
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["the cat"]}), root / "no_column.parquet")
    pq.write_table(pa.table({"text": ["the cat", None]}), root / "null.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), root / "numbers.parquet")
    tokenizer = corpus["tokenizer"]
    return {
        "missing-path": ([f"data.path={root}/none.jsonl"], rf"data.path='{root}/none.jsonl' does not exist; give a .txt"),
        "glob-matches-nothing": ([f"data.path={root}/*.csv"], r"matches no file"),
        "folder-of-nothing": ([f"data.path={root}/empty"], r"is a folder with no .txt, .jsonl or .parquet file"),
        "empty-text-file": ([f"data.path={root}/empty.txt"], r"'.*empty.txt' is empty, a document of no text"),
        "latin1-text": ([f"data.path={root}/latin1.txt"], r"is not UTF-8 text \(byte 0xe9 at byte offset 3\); re-encode"),
        "latin1-jsonl": ([f"data.path={root}/latin1.jsonl"], r"is not UTF-8 text \(byte 0xe9 at byte offset 28\)"),
        # one line number, the file's (json's own message would add "line 1" of the line it was given)
        "line-not-json": ([f"data.path={root}/not_json.jsonl"],
                          r"'.*not_json.jsonl' line 2 is not JSON \(Expecting value at column 10\); give one JSON"),
        "line-without-field": ([f"data.path={root}/no_field.jsonl"],
                               r"data.text_field='text': '.*no_field.jsonl' line 1 holds no text under 'text' "
                               r"\(its keys are 'body'\); set data.text_field"),
        "parquet-without-column": ([f"data.path={root}/no_column.parquet"],
                                   r"data.text_field='text': '.*no_column.parquet' has no column 'text' \(its columns are 'body'\)"),
        "parquet-null": ([f"data.path={root}/null.parquet"], r"data.text_field='text': row 1 of '.*null.parquet' holds no text"),
        "parquet-numbers": ([f"data.path={root}/numbers.parquet"], r"column 'text' of '.*numbers.parquet' holds int64, not text"),
        "tokenizer-missing": ([f"data.tokenizer={root}/none.json"], r"data.tokenizer='.*none.json' is not a file"),
        "tokenizer-unreadable": ([f"data.tokenizer={root}/garbage.json"], r"data.tokenizer='.*garbage.json' is not a readable"),
        "tokenizer-beyond-model": (["model.vocab_size=32"], rf"data.tokenizer='{tokenizer}' has 38 tokens but "
                                   r"model.vocab_size=32; set model.vocab_size to at least 38"),
        "eos-beyond-tokenizer": (["data.eos_id=100"], r"data.eos_id=100 is not a token id of data.tokenizer=.* \(0 to 37\); "
                                 r"its <\|endoftext\|> is data.eos_id=1"),
    }


class _NoCompile:
    """A step that fails the test if anything gets as far as compiling it."""

    def lower(self, *args):
        raise AssertionError("compiled before the bad input was refused")


def test_bad_text_input_is_refused_before_compile(tiny_llama, corpus, tmp_path):
    """Each refused by make_source with one line, and so by jaxpar.train.run before it compiles."""
    for case, (overrides, message) in _bad_inputs(tmp_path, corpus).items():
        trainer = build(text_config(tiny_llama, corpus, *overrides))
        with pytest.raises(ConfigError, match=message) as info:
            make_source(trainer.batch, trainer.config)
        assert "\n" not in str(info.value), case
        with pytest.raises(ConfigError, match=message):
            run(dataclasses.replace(trainer, step=_NoCompile()), progress=False)


def test_a_missing_package_is_named_with_its_extra(corpus, monkeypatch):
    spec = text.TextSpec(str(corpus["root"] / "docs.parquet"), corpus["tokenizer"])
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import pyarrow.parquet raises ImportError
    with pytest.raises(ConfigError, match=r"docs.parquet' is a Parquet file, which needs pyarrow: pip install 'jaxpar\[parquet\]'"):
        list(text.documents(text.document_files(spec), spec))
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ConfigError, match=r"data.tokenizer='.*' needs the tokenizers package: pip install 'jaxpar\[text\]'"):
        text.load_tokenizer(spec)


def test_a_pool_and_a_cache_tokenize_what_the_run_would(tiny_llama, corpus, tmp_path, monkeypatch, worker_pools):
    """data.workers=2 tokenizes the same stream in two processes; data.cache writes it once
    (a .npy and its side file), and the next run memory-maps it without tokenizing (the
    encoder made to fail shows it), its batches and described documents the same."""
    from jaxpar.data import tokenized

    plain = make_source(build(text_config(tiny_llama, corpus)).batch, text_config(tiny_llama, corpus))
    pooled_config = text_config(tiny_llama, corpus, "data.workers=2")
    pooled = make_source(build(pooled_config).batch, pooled_config)
    np.testing.assert_array_equal(np.asarray(pooled.tokens), np.asarray(plain.tokens))
    cached_config = text_config(tiny_llama, corpus, f"data.cache={tmp_path}", "data.workers=2")
    first = make_source(build(cached_config).batch, cached_config)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".npy"]
    monkeypatch.setattr(tokenized, "encoded", lambda *a, **k: (_ for _ in ()).throw(AssertionError("tokenized again")))
    again = make_source(build(cached_config).batch, cached_config)
    assert isinstance(again.tokens.base, np.memmap) or isinstance(again.tokens, np.memmap)
    for source in (first, again):
        np.testing.assert_array_equal(np.asarray(source.tokens), np.asarray(plain.tokens))
        assert source.describe(10) == plain.describe(10)
    with pytest.raises(ConfigError, match="data.cache='/nowhere' is not a folder this user can write"):
        build(text_config(tiny_llama, corpus, "data.cache=/nowhere"))
