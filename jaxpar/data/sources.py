"""Batch sources. Each is a pure function of (seed, step): a resumed run sees the same data,
and every process builds only the rows its devices hold, then joins the global batch."""

from __future__ import annotations

import pathlib

import jax
import numpy as np

from jaxpar.data.batch import local_rows, to_global
from jaxpar.data.order import Epochs, Windows, row_order, split_tokens
from jaxpar.data.text import TextSpec, tokenize
from jaxpar.errors import ConfigError


class Source:
    """Rows [lo, hi) of step `step` as numpy arrays; `__call__` returns the global batch."""

    def __init__(self, trainer):
        self.shardings = trainer.batch_shardings
        self.shapes = trainer.batch_shapes
        self.rows = local_rows(self.shardings["inputs"], self.shapes["inputs"])
        self.seed = trainer.config.train.seed
        self.eos_id = trainer.config.data.eos_id

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def __call__(self, step: int) -> dict[str, jax.Array]:
        return to_global(self.local(step, self.rows), self.shardings, self.shapes)


class SyntheticTokens(Source):
    """A learnable language: each token is followed by a fixed successor (a random
    permutation of the vocabulary) 90% of the time, by a uniform random token otherwise.
    The best achievable loss is about 0.1 * ln(V) + 0.33 nats; a fresh model starts near ln(V)."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self.vocab = trainer.config.model.vocab_size
        self.successor = np.random.default_rng([self.seed, 7]).permutation(self.vocab)

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        batch, seq = self.shapes["inputs"]
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

    def __init__(self, trainer, tokens: np.ndarray, order: Windows | Epochs):
        super().__init__(trainer)
        self.tokens, self.order = tokens, order

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        seq = self.shapes["inputs"][1]
        starts = self.order.starts(step, rows)
        tokens = np.stack([np.asarray(self.tokens[s : s + seq + 1]) for s in starts]).astype(np.int32)
        return _lm_rows(tokens, self.eos_id)


class TokenFile(TokenRows):
    """Rows from a memory-mapped file of token ids (.npy, or a raw .bin of `data.dtype`), in
    data.order. The file's last data.eval_fraction is held out (`held_out`, read by
    jaxpar.data.heldout); rows are drawn from the part before it."""

    def __init__(self, trainer):
        cfg = trainer.config.data
        batch, seq = trainer.batch_shapes["inputs"]
        tokens = self.read(trainer)
        if len(tokens) < seq + 2:
            raise ConfigError(f"data.path={cfg.path!r} holds {len(tokens)} tokens, fewer than train.seq_len + 2 = {seq + 2}")
        check_ids(tokens, trainer.config.model.vocab_size, cfg.path)
        training, self.held_out = split_tokens(tokens, cfg.eval_fraction, seq, cfg.path)
        super().__init__(trainer, training, row_order(cfg.order, len(training), seq, batch, trainer.config.train.seed))

    def read(self, trainer) -> np.ndarray:
        cfg = trainer.config.data
        return open_tokens(cfg.path, cfg.dtype)


class TextSource(TokenFile):
    """data.source=text: the documents of data.path tokenized with data.tokenizer when the
    run starts, each followed by data.eos_id (jaxpar.data.text), then read as a token file
    is. Every process tokenizes the whole corpus and holds its ids in memory, which suits
    corpora of some tens of megabytes; tokenize a bigger one once, in parallel, with
    `jaxpar tokenize` and train on the file it writes (data.source=tokens): the same ids."""

    def read(self, trainer) -> np.ndarray:
        return tokenize(TextSpec.from_config(trainer.config.data), trainer.config.model.vocab_size)


class SyntheticClasses(Source):
    """Gaussian inputs (of any shape per example: features, images) labelled by a fixed
    random linear teacher of the flattened input: learnable to ~100%."""

    def __init__(self, trainer):
        super().__init__(trainer)
        features = int(np.prod(self.shapes["inputs"][1:]))
        classes = trainer.config.model.num_classes
        self.teacher = np.random.default_rng([self.seed, 11]).normal(size=(features, classes))

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        shape = self.shapes["inputs"]
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


def make_source(trainer) -> Source:
    model = trainer.config.model
    if hasattr(model, "batch_fields"):
        raise ConfigError(f"model {type(model).__name__} declares its own batch fields "
                          f"({', '.join(trainer.batch_fields)}), which jaxpar's data sources do not make; "
                          "give your batches to jaxpar.train.run(trainer, data=...) (docs/your_model.md)")
    if model.task == "classify":
        return SyntheticClasses(trainer)
    sources = {"synthetic": SyntheticTokens, "tokens": TokenFile, "text": TextSource}
    return sources[trainer.config.data.source](trainer)
