"""Batch sources. Each is a pure function of (seed, step): a resumed run sees the same data,
and every process builds only the rows its devices hold, then joins the global batch.

A source takes the batch's layout (jaxpar.data.batch.BatchLayout) and plain values; the
configs it reads (a jaxpar.config.Config, its DataConfig) are typed Any because
jaxpar.config sits above this package (docs/architecture.md)."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np

from jaxpar.data.batch import BatchLayout
from jaxpar.data.chat import chat_rows, preference_rows
from jaxpar.data.order import Epochs, Windows, row_order, split_tokens
from jaxpar.data.text import TextSpec, tokenize
from jaxpar.errors import ConfigError
from jaxpar.model import has


class Source:
    """Rows [lo, hi) of step `step` as numpy arrays; `__call__` returns the global batch,
    laid out as `batch` says (this process builds only its `rows`)."""

    def __init__(self, batch: BatchLayout):
        self.batch, self.rows = batch, batch.rows

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def __call__(self, step: int) -> dict[str, jax.Array]:
        return self.batch.to_global(self.local(step, self.rows))


class SyntheticTokens(Source):
    """A learnable language: each token is followed by a fixed successor (a random
    permutation of the vocabulary) 90% of the time, by a uniform random token otherwise.
    The best achievable loss is about 0.1 * ln(V) + 0.33 nats; a fresh model starts near ln(V)."""

    def __init__(self, batch: BatchLayout, vocab_size: int, seed: int, eos_id: int = -1):
        super().__init__(batch)
        self.vocab, self.seed, self.eos_id = vocab_size, seed, eos_id
        self.successor = np.random.default_rng([seed, 7]).permutation(vocab_size)

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        batch, seq = self.batch.shapes["inputs"]
        rng = np.random.default_rng([self.seed, step])
        first = rng.integers(0, self.vocab, size=batch)
        noise = rng.random((batch, seq)) < 0.1
        random_tokens = rng.integers(0, self.vocab, size=(batch, seq))
        first, noise, random_tokens = first[rows], noise[rows], random_tokens[rows]
        tokens = np.empty((len(first), seq + 1), np.int32)
        tokens[:, 0] = first
        for i in range(seq):
            tokens[:, i + 1] = np.where(noise[:, i], random_tokens[:, i], self.successor[tokens[:, i]])
        return _lm_rows(tokens, self.eos_id)


class TokenRows(Source):
    """Rows of seq_len + 1 tokens from a stream of token ids (a memory-mapped file, or an
    array), started where `order` places them (jaxpar.data.order). Only this process's rows
    are read."""

    def __init__(self, batch: BatchLayout, tokens: np.ndarray, order: Windows | Epochs, eos_id: int = -1):
        super().__init__(batch)
        self.tokens, self.order, self.eos_id = tokens, order, eos_id

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        seq = self.batch.shapes["inputs"][1]
        starts = self.order.starts(step, rows)
        tokens = np.stack([np.asarray(self.tokens[s : s + seq + 1]) for s in starts]).astype(np.int32)
        return _lm_rows(tokens, self.eos_id)


class TokenFile(TokenRows):
    """Rows from a memory-mapped file of token ids (.npy, or a raw .bin of `data.dtype`), in
    data.order. The file's last data.eval_fraction is held out (`held_out`, read by
    jaxpar.data.heldout with this source's `data` and `seed`); rows are drawn from the part
    before it."""

    def __init__(self, batch: BatchLayout, data: Any, vocab_size: int, seed: int):
        self.data, self.seed = data, seed
        seq = batch.shapes["inputs"][1]
        tokens = self.read(data, vocab_size)
        if len(tokens) < seq + 2:
            raise ConfigError(f"data.path={data.path!r} holds {len(tokens)} tokens, fewer than train.seq_len + 2 = {seq + 2}")
        check_ids(tokens, vocab_size, data.path)
        training, self.held_out = split_tokens(tokens, data.eval_fraction, seq, data.path)
        order = row_order(data.order, len(training), seq, batch.global_batch, seed)
        super().__init__(batch, training, order, data.eos_id)

    def read(self, data: Any, vocab_size: int) -> np.ndarray:
        return open_tokens(data.path, data.dtype)


class TextSource(TokenFile):
    """data.source=text: the documents of data.path tokenized with data.tokenizer when the
    run starts, each followed by data.eos_id (jaxpar.data.text), then read as a token file
    is. Every process tokenizes the whole corpus and holds its ids in memory, which suits
    corpora of some tens of megabytes; tokenize a bigger one once, in parallel, with
    `jaxpar tokenize` and train on the file it writes (data.source=tokens): the same ids."""

    def read(self, data: Any, vocab_size: int) -> np.ndarray:
        return tokenize(TextSpec.from_config(data), vocab_size)


class ChatSource(Source):
    """data.source=chat: the conversations of data.path rendered, tokenized and packed into
    rows when the run starts (jaxpar.data.chat), the loss on the assistant's tokens; the last
    data.eval_fraction of them held out (`held_out`, packed rows, read by jaxpar.data.heldout)."""

    def __init__(self, batch: BatchLayout, data: Any, vocab_size: int, seed: int):
        super().__init__(batch)
        self.data, self.seed = data, seed
        self.reader, self.held_out = chat_rows(batch, data, vocab_size, seed)

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        return self.reader.local(step, rows)


class PreferenceSource(Source):
    """data.source=preference: a row a {"prompt", "chosen", "rejected"} record of data.path, the
    chosen conversation then the rejected one (jaxpar.data.chat.pack_pairs), rows in
    data.order. Its batches carry `reference` [B, 2], the reference model's log-probabilities
    of both answers, which the run computes once from its starting weights before the first
    step (jaxpar.train.preference.attach_reference); until then it has none to give."""

    def __init__(self, batch: BatchLayout, data: Any, vocab_size: int, seed: int):
        super().__init__(batch)
        self.data, self.seed = data, seed
        self.reader = preference_rows(batch, data, vocab_size, seed)
        self.pairs = self.reader.rows
        self.reference: np.ndarray | None = None  # [pairs, 2]

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        if self.reference is None:
            raise ConfigError("data.source=preference: the reference log-probabilities are not computed yet; "
                              "jaxpar.train.preference.attach_reference(source, trainer, params) first")
        ids = self.reader.row_ids(step, rows)
        return {**self.pairs.fields(ids), "reference": self.reference[ids]}


class SyntheticClasses(Source):
    """Gaussian inputs (of any shape per example: features, images) labelled by a fixed
    random linear teacher of the flattened input: learnable to ~100%."""

    def __init__(self, batch: BatchLayout, num_classes: int, seed: int):
        super().__init__(batch)
        self.seed = seed
        features = int(np.prod(batch.shapes["inputs"][1:]))
        self.teacher = np.random.default_rng([seed, 11]).normal(size=(features, num_classes))

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        shape = self.batch.shapes["inputs"]
        x = np.random.default_rng([self.seed, step]).normal(size=shape).astype(np.float32)[rows]
        return {
            "inputs": x,
            "targets": np.argmax(x.reshape(len(x), -1) @ self.teacher, axis=-1).astype(np.int32),
            "weights": np.ones(len(x), np.float32),
        }


def _lm_rows(tokens: np.ndarray, eos_id: int = -1) -> dict[str, np.ndarray]:
    """Inputs, next-token targets and weights from windows of seq_len + 1 tokens; with
    `eos_id` >= 0, packed documents: a new segment starts after each end-of-document token,
    positions count from 0 in each, and the end-of-document token's own target (the next
    document's first token) weighs 0."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    rows = {"inputs": inputs, "targets": targets, "weights": np.ones(targets.shape, np.float32)}
    if eos_id < 0:
        return rows
    ends = inputs == eos_id
    segment_ids = np.concatenate([np.zeros((len(inputs), 1), np.int32), np.cumsum(ends, 1, dtype=np.int32)[:, :-1]], 1)
    index = np.arange(inputs.shape[1])
    first = np.where(np.diff(segment_ids, axis=1, prepend=-1) != 0, index, 0)
    rows["positions"] = (index - np.maximum.accumulate(first, axis=1)).astype(np.int32)
    rows["segment_ids"] = segment_ids
    rows["weights"] = np.where(ends, 0.0, 1.0).astype(np.float32)
    return rows


def open_tokens(path: str, dtype: str) -> np.ndarray:
    """The file's token ids, memory-mapped; a file that holds none, or no integers, is
    refused naming what it holds."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"data.path={path!r} is not a file; give a .npy or .bin file of token ids")
    if p.suffix == ".npy":
        try:
            tokens = np.load(p, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise ConfigError(f"data.path={path!r} is not a readable .npy file ({e}); save token ids with np.save") from None
    elif p.suffix == ".bin":
        try:
            kind = np.dtype(dtype)
        except TypeError:
            raise ConfigError(f"data.dtype={dtype!r} is not a numpy dtype; use uint16 or uint32") from None
        if kind.kind not in "iu":
            raise ConfigError(f"data.dtype={dtype!r} is not an integer type; token ids are uint16 or uint32")
        if p.stat().st_size < kind.itemsize:
            raise ConfigError(f"data.path={path!r} is empty ({p.stat().st_size} bytes); give a file of token ids")
        tokens = np.memmap(p, dtype=kind, mode="r")
    else:
        raise ConfigError(f"data.path={path!r}: unknown file type {p.suffix!r}; use .npy or .bin")
    if tokens.dtype.kind not in "iu":
        raise ConfigError(f"data.path={path!r} holds {tokens.dtype} values, not token ids; save integers "
                          "(e.g. np.save(path, ids.astype(np.uint16)))")
    if tokens.size == 0:
        raise ConfigError(f"data.path={path!r} holds no tokens; give a file of token ids")
    return tokens.reshape(-1)


def check_ids(tokens: np.ndarray, vocab: int, path: str, chunk: int = 1 << 26) -> None:
    """Refuse a file holding an id outside [0, vocab): the embedding would clamp it and the
    run would train on other tokens, silently. Every id is read, a chunk at a time (about a
    second per 10^9 tokens)."""
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start : start + chunk])
        low, high = int(part.min()), int(part.max())
        if high >= vocab or low < 0:
            bad = high if high >= vocab else low
            where = start + int(np.argmax(part == bad))
            raise ConfigError(f"data.path={path!r} holds token id {bad} (at position {where}) but "
                              f"model.vocab_size={vocab}; set model.vocab_size above the largest id, or re-tokenize")


def make_source(batch: BatchLayout, config: Any) -> Source:
    """The config's source of batches laid out as `batch` (a Trainer's `batch`): its model
    config gives the task and the vocabulary or classes, train.seed the random streams."""
    model, seed = config.model, config.train.seed
    if has(model, "batch_fields"):
        raise ConfigError(f"model {type(model).__name__} declares its own batch fields "
                          f"({', '.join(batch.fields)}), which jaxpar's data sources do not make; "
                          "give your batches to jaxpar.train.run(..., data=...) (docs/your_model.md)")
    if model.task == "classify":
        return SyntheticClasses(batch, model.num_classes, seed)
    if config.data.source == "synthetic":
        return SyntheticTokens(batch, model.vocab_size, seed, config.data.eos_id)
    sources = {"tokens": TokenFile, "text": TextSource, "chat": ChatSource, "preference": PreferenceSource}
    return sources[config.data.source](batch, config.data, model.vocab_size, seed)
