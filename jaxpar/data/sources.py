"""Batch sources. Each is a pure function of (seed, step): a resumed run sees the same data,
and every process builds only the rows its devices hold, then joins the global batch. Each
says in one line what it holds (`describe`, printed as a run starts), from what it counted
while opening the data: nothing is read again for it.

A source takes the batch's layout (jaxpar.data.batch.BatchLayout) and plain values; the
configs it reads (a jaxpar.config.Config, its DataConfig) are typed Any because
jaxpar.config sits above this package (docs/architecture.md)."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np

from jaxpar.data.batch import BatchLayout
from jaxpar.data.chat import ChatRows, PackedRows, chat_rows, preference_rows
from jaxpar.data.order import Epochs, Windows, row_order, split_tokens
from jaxpar.data.text import Corpus, TextSpec, read_corpus
from jaxpar.errors import ConfigError
from jaxpar.model import field_name, settable_field


class Source:
    """Rows [lo, hi) of step `step` as numpy arrays; `__call__` returns the global batch,
    laid out as `batch` says (this process builds only its `rows`)."""

    def __init__(self, batch: BatchLayout):
        self.batch, self.rows = batch, batch.rows

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def describe(self, steps: int) -> str:
        """One line: what the source holds and how much of it `steps` steps read (each source
        says more of itself)."""
        return f"data: {type(self).__name__} | {counted(steps, 'step')} x {self.batch.global_batch:,} rows"

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

    def describe(self, steps: int) -> str:
        batch, seq = self.batch.shapes["inputs"]
        return (f"data: synthetic random tokens (data.source=synthetic: a made-up language of {self.vocab:,} ids drawn "
                f"from train.seed, no text) | {counted(steps, 'step')} x {batch * seq:,} tokens; train on real text with "
                "data.source=text data.path=FILE (or tokens, chat)")

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

    def coverage(self, steps: int) -> str:
        """How much of the stream `steps` steps read."""
        batch, seq = self.batch.shapes["inputs"]
        read = "epochs" if isinstance(self.order, Epochs) else "epochs (windows at random places: data.order=windows)"
        return f"{counted(steps, 'step')} x {batch * seq:,} tokens = {self.order.epochs(steps):.3g} {read}"

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

    kind = "tokens"

    def __init__(self, batch: BatchLayout, data: Any, vocab_size: int, seed: int):
        self.data, self.seed = data, seed
        seq = batch.shapes["inputs"][1]
        tokens, self.files, documents = self.read(data, vocab_size)
        if len(tokens) < seq + 2:
            raise ConfigError(f"data.path={data.path!r} holds {len(tokens)} tokens, fewer than train.seq_len + 2 = {seq + 2}")
        ends = check_ids(tokens, vocab_size, data.path, data.eos_id)
        self.documents = documents if documents is not None else ends if data.eos_id >= 0 else None
        training, self.held_out = split_tokens(tokens, data.eval_fraction, seq, data.path)
        order = row_order(data.order, len(training), seq, batch.global_batch, seed)
        super().__init__(batch, training, order, data.eos_id)

    def read(self, data: Any, vocab_size: int) -> Corpus:
        tokens = open_tokens(data.path, data.dtype)
        return Corpus(tokens, getattr(tokens, "shards", 1), None)  # documents: counted by data.eos_id, if any

    def describe(self, steps: int) -> str:
        training, held = len(self.tokens), len(self.held_out)
        files = f" ({self.files} files)" if self.files > 1 else ""
        documents = f"{counted(self.documents, 'document')}, " if self.documents is not None else ""
        split = f" ({training:,} to train on, {held:,} held out)" if held else ""
        return (f"data: {self.kind} {self.data.path!r}{files} | {documents}{training + held:,} tokens{split} | "
                f"{self.coverage(steps)}")


class TextSource(TokenFile):
    """data.source=text: the documents of data.path tokenized with data.tokenizer when the
    run starts, each followed by data.eos_id (jaxpar.data.text), then read as a token file
    is. Every process tokenizes the whole corpus and holds its ids in memory, which suits
    corpora of some tens of megabytes; tokenize a bigger one once, in parallel, with
    `jaxpar tokenize` and train on the file it writes (data.source=tokens): the same ids."""

    kind = "text"

    def read(self, data: Any, vocab_size: int) -> Corpus:
        spec = TextSpec.from_config(data)
        if data.cache or data.workers > 1:  # a pool of processes, and a cache folder (jaxpar.data.tokenized)
            from jaxpar.data.tokenized import cached_corpus, parallel_corpus

            return (cached_corpus(spec, vocab_size, data.workers, data.cache) if data.cache
                    else parallel_corpus(spec, vocab_size, data.workers))
        return read_corpus(spec, vocab_size)


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

    def describe(self, steps: int) -> str:
        rows = self.reader.rows
        held = f" ({self.held_out.conversations:,} more held out)" if self.held_out is not None else ""
        return (f"data: chat {self.data.path!r} | {counted(rows.conversations, 'conversation')}{held}, {rows.tokens:,} tokens, "
                f"{rows.trained:,} of them trained (the assistant's) | {_rows(rows)} | "
                f"{_row_coverage(self.reader, steps, self.batch.global_batch)}")


class PreferenceSource(Source):
    """data.source=preference: a row a {"prompt", "chosen", "rejected"} record of data.path, the
    chosen conversation then the rejected one (jaxpar.data.chat.pack_pairs), rows in
    data.order. Its batches carry `reference` [B, 2], the reference model's log-probabilities
    of both answers, which the run computes once from its starting weights before the first
    step (jaxpar.loop.start.attach_reference); until then it has none to give."""

    def __init__(self, batch: BatchLayout, data: Any, vocab_size: int, seed: int):
        super().__init__(batch)
        self.data, self.seed = data, seed
        self.reader = preference_rows(batch, data, vocab_size, seed)
        self.pairs = self.reader.rows
        self.reference: np.ndarray | None = None  # [pairs, 2]

    def describe(self, steps: int) -> str:
        pairs = self.pairs
        return (f"data: preference {self.data.path!r} | {counted(len(pairs), 'pair')}, {pairs.tokens:,} tokens, "
                f"{pairs.trained:,} of them answers' | a row a pair: {_rows(pairs)} | "
                f"{_row_coverage(self.reader, steps, self.batch.global_batch)}")

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        if self.reference is None:
            raise ConfigError("data.source=preference: the reference log-probabilities are not computed yet; "
                              "jaxpar.loop.start.attach_reference(source, trainer, params) first")
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

    def describe(self, steps: int) -> str:
        return (f"data: synthetic classes (Gaussian inputs labelled by a random linear teacher, drawn from train.seed) | "
                f"{counted(steps, 'step')} x {self.batch.global_batch:,} examples")

    def local(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        shape = self.batch.shapes["inputs"]
        x = np.random.default_rng([self.seed, step]).normal(size=shape).astype(np.float32)[rows]
        return {
            "inputs": x,
            "targets": np.argmax(x.reshape(len(x), -1) @ self.teacher, axis=-1).astype(np.int32),
            "weights": np.ones(len(x), np.float32),
        }


def counted(n: int, noun: str) -> str:
    """'1 document', '2,000 documents'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _rows(rows: PackedRows) -> str:
    """Packed rows: how many, how wide, how full of tokens (the rest is padding)."""
    return f"{counted(len(rows), 'row')} of {rows.ids.shape[1]} tokens, {rows.tokens / rows.ids.size:.1%} filled"


def _row_coverage(reader: ChatRows, steps: int, batch: int) -> str:
    read = "epochs" if isinstance(reader.order, Epochs) else "epochs (rows at random: data.order=windows)"
    return f"{counted(steps, 'step')} x {batch:,} rows = {reader.order.epochs(steps):.3g} {read}"


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
    """The file's token ids, memory-mapped, or a folder's or glob's shards as one lazy stream
    (jaxpar.data.shards); a file that holds none, or no integers, is refused naming what it
    holds."""
    p = pathlib.Path(path)
    if p.is_dir() or any(c in path for c in "*?["):  # many shards, opened lazily (jaxpar.data.shards)
        from jaxpar.data.shards import TokenShards

        return TokenShards.open(path, dtype)
    if not p.is_file():
        raise ConfigError(f"data.path={path!r} is not a file; give a .npy or .bin file of token ids, a folder of "
                          "them, or a glob")
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


def check_ids(tokens: np.ndarray, vocab: int, path: str, eos_id: int = -1, chunk: int = 1 << 26) -> int:
    """Refuse a file holding an id outside [0, vocab): the embedding would clamp it and the
    run would train on other tokens, silently. Every id is read, a chunk at a time (about a
    second per 10^9 tokens); returns how many of them are `eos_id` (documents), counted on the way."""
    ends = 0
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start : start + chunk])
        ends += int(np.count_nonzero(part == eos_id)) if eos_id >= 0 else 0
        low, high = int(part.min()), int(part.max())
        if high >= vocab or low < 0:
            bad = high if high >= vocab else low
            where = start + int(np.argmax(part == bad))
            raise OutsideVocabulary(f"data.path={path!r} holds token id {bad} (at position {where})", vocab)
    return ends


class OutsideVocabulary(ConfigError):
    """check_ids' refusal. It knows the vocabulary's size alone; make_source words it for the
    model (`worded`), whose vocab_size may be a property over a field of another name
    (model.n_vocab), where --set model.vocab_size finds nothing."""

    def __init__(self, held: str, vocab: int):
        self.held, self.vocab = held, vocab
        super().__init__(f"{held} but model.vocab_size={vocab}; set model.vocab_size above the largest id, or "
                         "re-tokenize")

    def worded(self, model: Any) -> str:
        field = settable_field(model, "vocab_size")
        larger = f"set {field} above the largest id" if field else "give the model a larger vocabulary"
        return f"{self.held} but {field_name(model, 'vocab_size', self.vocab)}; {larger}, or re-tokenize"


def make_source(batch: BatchLayout, config: Any) -> Source:
    """The config's source of batches laid out as `batch` (a Trainer's `batch`): its model
    config gives the task and the vocabulary or classes, train.seed the random streams."""
    model, seed = config.model, config.train.seed
    if batch.model_fields:
        raise ConfigError(f"model {type(model).__name__} declares its own batch fields "
                          f"({', '.join(batch.fields)}), which jaxpar's data sources do not make; "
                          "give your batches to jaxpar.train.run(..., data=...) (docs/your_model.md)")
    if model.task == "classify":
        return SyntheticClasses(batch, model.num_classes, seed)
    if config.data.source == "synthetic":
        if config.checkpoint.init_from:
            _warn_of_random_fine_tuning(config.checkpoint.init_from)
        return SyntheticTokens(batch, model.vocab_size, seed, config.data.eos_id)
    try:
        return OPENERS[config.data.source](batch, config)
    except OutsideVocabulary as e:
        raise ConfigError(e.worded(model)) from None


# data.source -> (the batch's layout, the run's config) -> its source. A source made of others
# registers itself where it is defined (data.source=mix: jaxpar.data.mixture, which this
# package's __init__ imports).
OPENERS: dict[str, Any] = {
    kind: (lambda cls: lambda batch, config: cls(batch, config.data, config.model.vocab_size, config.train.seed))(cls)
    for kind, cls in (("tokens", TokenFile), ("text", TextSource), ("chat", ChatSource),
                      ("preference", PreferenceSource))
}


def _warn_of_random_fine_tuning(init_from: str) -> None:
    """A run that starts from a checkpoint's weights on synthetic tokens (the recipe hf:FOLDER
    with no data settings, which `jaxpar explain` and `plan` read as it is) unlearns it."""
    import warnings

    from jaxpar.errors import JaxparWarning

    if not (pathlib.Path(init_from) / "config.json").is_file():
        return  # no checkpoint there: the import's error names checkpoint.init_from, without this warning first
    warnings.warn(f"checkpoint.init_from={init_from!r} with data.source=synthetic fine-tunes the checkpoint on random "
                  "tokens, which unlearns what it knows; give it real data: --set data.source=text --set "
                  "data.path=FILE (a .txt, .jsonl or .parquet file), or data.source=chat for conversations",
                  JaxparWarning, stacklevel=3)
