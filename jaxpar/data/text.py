"""Text in: documents from .txt, .jsonl and .parquet files, a Hugging Face tokenizer.json,
and one stream of token ids with data.eos_id after each document, so that packing keeps the
documents' boundaries (jaxpar.data.sources._lm_rows). data.source=text tokenizes here when
the run starts; `jaxpar tokenize` (jaxpar.commands.tokenize) writes the same ids to a
token file once, in parallel.

Every bad input is refused with one line naming the setting, its value and what would work,
before anything compiles. Settings are named as the config spells them (data.path, ...) or,
for the command, as its flags do (`Names`).
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import pathlib
from typing import Iterable, Iterator, NamedTuple

import numpy as np

from jaxpar.errors import ConfigError

SUFFIXES = (".txt", ".jsonl", ".parquet")
KINDS = ".txt, .jsonl or .parquet"
# End-of-document tokens of common tokenizers, to suggest a data.eos_id that exists.
END_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


class Names(NamedTuple):
    """What each setting is called in messages."""

    path: str
    tokenizer: str
    text_field: str
    eos_id: str
    bos_id: str = "--bos-id"


CONFIG_NAMES = Names("data.path", "data.tokenizer", "data.text_field", "data.eos_id", "data.bos_id")


@dataclasses.dataclass(frozen=True)
class TextSpec:
    """What to tokenize: `path` a file, a folder or a glob; `tokenizer` a tokenizer.json;
    `text_field` the JSONL key or Parquet column of each document; `eos_id` the id appended
    after each document, `bos_id` the one put before it (-1: none)."""

    path: str
    tokenizer: str
    text_field: str = "text"
    eos_id: int = -1
    names: Names = CONFIG_NAMES
    bos_id: int = -1

    @classmethod
    def from_config(cls, data) -> "TextSpec":
        return cls(data.path, data.tokenizer, data.text_field, data.eos_id, bos_id=data.bos_id)


class Corpus(NamedTuple):
    """A corpus of token ids: its stream, and how many files and documents it came from (None:
    not known, a token file's)."""

    ids: np.ndarray
    files: int
    documents: int | None


def tokenize(spec: TextSpec, model_vocab: int | None = None, chunk: int = 1024) -> np.ndarray:
    """The corpus as one stream of token ids (uint16 where the vocabulary fits, else uint32):
    spec.bos_id when >= 0, each document's ids, then spec.eos_id when >= 0, documents in file
    order."""
    return read_corpus(spec, model_vocab, chunk).ids


def read_corpus(spec: TextSpec, model_vocab: int | None = None, chunk: int = 1024) -> Corpus:
    """`tokenize`'s stream, with the files and documents it read counted on the way."""
    tokenizer = load_tokenizer(spec, model_vocab)
    dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    files = document_files(spec)
    parts, count = [], 0
    for part in itertools.batched(documents(files, spec), chunk):
        parts.append(encode(tokenizer, list(part), spec.eos_id, dtype, spec.bos_id))
        count += len(part)
    return Corpus(np.concatenate(parts) if parts else np.zeros(0, dtype), len(files), count)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def encode(tokenizer, docs: list[str], eos_id: int, dtype, bos_id: int = -1) -> np.ndarray:
    """The documents' ids, end to end, with bos_id before and eos_id after each (when >= 0);
    no other special tokens added by the tokenizer. Each document's ids depend on it alone, so
    any split of the corpus into parts gives the same stream."""
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # the same ids, no offsets
    ids = [e.ids for e in encode_batch(docs, add_special_tokens=False)]
    start, end = [bos_id] if bos_id >= 0 else [], [eos_id] if eos_id >= 0 else []
    count = sum(map(len, ids)) + (len(start) + len(end)) * len(ids)
    return np.fromiter(itertools.chain.from_iterable(start + i + end for i in ids), dtype, count=count)


def begin_id(tokenizer) -> int:
    """The one id the tokenizer's own template puts before a text (its <bos>), or -1 where it
    puts none (Qwen's) or more than one."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[0] if start == 1 else -1
    return -1


# ------------------------------------------------------------------ the tokenizer

def load_tokenizer(spec: TextSpec, model_vocab: int | None = None):
    """The tokenizer of spec.tokenizer with truncation and padding off (a tokenizer.json may
    carry either, which would cut or pad every document silently); refused when it is missing
    or unreadable, when its vocabulary exceeds `model_vocab`, or when spec.eos_id is none of
    its ids."""
    n, path = spec.names, spec.tokenizer
    if not pathlib.Path(path).is_file():
        raise ConfigError(f"{n.tokenizer}={path!r} is not a file; give a Hugging Face tokenizer.json "
                          "(the one beside the model's weights)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(f"{n.tokenizer}={path!r} needs the tokenizers package: pip install 'jaxpar[text]'") from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception for every kind of bad file
        raise ConfigError(f"{n.tokenizer}={path!r} is not a readable tokenizer.json ({_first_line(e)}); give one "
                          "a Hugging Face tokenizer saved (tokenizer.save(path))") from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if model_vocab is not None and vocab > model_vocab:
        raise ConfigError(f"{n.tokenizer}={path!r} has {vocab} tokens but model.vocab_size={model_vocab}; set "
                          f"model.vocab_size to at least {vocab}, or use the model's own tokenizer")
    if not -1 <= spec.eos_id < vocab:
        raise ConfigError(f"{n.eos_id}={spec.eos_id} is not a token id of {n.tokenizer}={path!r} (0 to {vocab - 1}); "
                          f"{_eos_hint(tokenizer, n.eos_id)}")
    if not -1 <= spec.bos_id < vocab:
        raise ConfigError(f"{n.bos_id}={spec.bos_id} is not a token id of {n.tokenizer}={path!r} (0 to {vocab - 1}); "
                          f"use {begin_id(tokenizer)}, the id it puts before a text itself (-1: none)")
    return tokenizer


def _eos_hint(tokenizer, field: str) -> str:
    for token in END_TOKENS:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return f"its {token} is {field}={found}"
    return f"set {field} to its end-of-document token's id, or -1 for none"


def json_error(e: json.JSONDecodeError) -> str:
    """What is wrong with a line that is not JSON, by its column: json's own message names
    "line 1" of the one line it was given, a second line number beside the file's."""
    return f"{e.msg} at column {e.colno}"


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# ------------------------------------------------------------------ the files

def document_files(spec: TextSpec) -> list[pathlib.Path]:
    """The files spec.path names: itself, a folder's .txt, .jsonl and .parquet files (not
    its subfolders'), or a glob's matches; sorted by name."""
    field, path = spec.names.path, spec.path
    if any(c in path for c in "*?["):
        matches = sorted(pathlib.Path(p) for p in glob.glob(path, recursive=True) if pathlib.Path(p).is_file())
        if not matches:
            raise ConfigError(f"{field}={path!r} matches no file; give a {KINDS} file, a folder of them, or a glob "
                              "that matches some")
        wrong = [str(p) for p in matches if p.suffix not in SUFFIXES]
        if wrong:
            raise ConfigError(f"{field}={path!r} matches {wrong[0]!r}, not a {KINDS} file; narrow the glob "
                              f"(e.g. {path.rstrip('*')}*.jsonl)")
        return matches
    p = pathlib.Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in SUFFIXES)
        if not files:
            raise ConfigError(f"{field}={path!r} is a folder with no {KINDS} file in it; put the documents there, "
                              "or name the files")
        return files
    if not p.is_file():
        raise ConfigError(f"{field}={path!r} does not exist; give a {KINDS} file, a folder of them, or a glob")
    if p.suffix not in SUFFIXES:
        raise ConfigError(f"{field}={path!r}: unknown file type {p.suffix!r}; use {KINDS} "
                          "(or data.source=tokens for a .npy or .bin file of token ids)")
    return [p]


def documents(files: Iterable[pathlib.Path], spec: TextSpec) -> Iterator[str]:
    """Every document of the files, in order: a .txt file is one, a .jsonl line one (its
    spec.text_field), a .parquet row one (that column). A file that holds none is refused."""
    read = {".txt": _text_file, ".jsonl": _jsonl_documents, ".parquet": _parquet_documents}
    for file in files:
        found = 0
        for found, doc in enumerate(read[file.suffix](file, spec), 1):
            yield doc
        if not found:
            raise ConfigError(f"{_in(file, spec)} holds no documents; "
                              "give it some, or leave it out of the path")


def count_documents(files: Iterable[pathlib.Path], spec: TextSpec) -> int:
    """How many documents `documents` will yield, without decoding them (for a progress bar)."""
    total = 0
    for file in files:
        if file.suffix == ".txt":
            total += 1
        elif file.suffix == ".jsonl":
            with open(file, "rb") as f:
                total += sum(1 for line in f if line.strip())
        else:
            total += parquet_file(file, spec).metadata.num_rows
    return total


def _in(file: pathlib.Path, spec: TextSpec) -> str:
    """How a message names a file: as the path setting, and by its own name when the setting
    names a folder or a glob."""
    named = f"{spec.names.path}={spec.path!r}"
    return named if pathlib.Path(spec.path) == file else f"{named}: {str(file)!r}"


def _decoded(raw: bytes, file: pathlib.Path, offset: int, spec: TextSpec) -> str:
    """`raw` (bytes from `offset` in `file`) as text; a byte that is not UTF-8 is refused by
    its offset in the file. A leading byte-order mark is dropped."""
    try:
        return raw.decode("utf-8-sig" if offset == 0 else "utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{_in(file, spec)} is not UTF-8 text (byte 0x{raw[e.start]:02x} "
                          f"at byte offset {offset + e.start}); re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _text_file(file: pathlib.Path, spec: TextSpec) -> Iterator[str]:
    text = _decoded(file.read_bytes(), file, 0, spec)
    if not text.strip():
        raise ConfigError(f"{_in(file, spec)} is empty, a document of no text; "
                          "give it text, or leave it out of the path")
    yield text


def _jsonl_documents(file: pathlib.Path, spec: TextSpec) -> Iterator[str]:
    n, key, offset = spec.names, spec.text_field, 0
    with open(file, "rb") as f:
        for number, raw in enumerate(f, 1):
            line, offset = _decoded(raw, file, offset, spec), offset + len(raw)
            if not raw.strip():  # blank lines hold no document (the rule count_documents counts by)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{_in(file, spec)} line {number} is not JSON ({json_error(e)}); "
                                  "give one JSON object per line") from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                has = (f"its keys are {', '.join(map(repr, record))}" if isinstance(record, dict)
                       else f"it is a {type(record).__name__}")
                raise ConfigError(f"{n.text_field}={key!r}: {str(file)!r} line {number} holds no text under {key!r} "
                                  f"({has}); set {n.text_field} to the key that holds each document's text")
            yield record[key]


def parquet_file(file: pathlib.Path, spec: TextSpec):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{_in(file, spec)} is a Parquet file, which needs pyarrow: "
                          "pip install 'jaxpar[parquet]'") from None
    try:
        return pq.ParquetFile(file)
    except Exception as e:  # pyarrow's ArrowInvalid and OSError alike
        raise ConfigError(f"{_in(file, spec)} is not a readable Parquet file ({_first_line(e)}); "
                          "write it with pyarrow.parquet.write_table") from None


def _parquet_documents(file: pathlib.Path, spec: TextSpec) -> Iterator[str]:
    import pyarrow as pa

    n, column = spec.names, spec.text_field
    parquet = parquet_file(file, spec)
    schema = parquet.schema_arrow
    if column not in schema.names:
        raise ConfigError(f"{n.text_field}={column!r}: {str(file)!r} has no column {column!r} (its columns are "
                          f"{', '.join(map(repr, schema.names))}); set {n.text_field} to the one that holds the text")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(f"{n.text_field}={column!r}: column {column!r} of {str(file)!r} holds {kind}, not text; "
                          f"set {n.text_field} to a string column")
    row = 0
    for batch in parquet.iter_batches(columns=[column]):
        values = batch.column(0)
        if values.null_count:
            missing = row + values.is_null().to_pylist().index(True)
            raise ConfigError(f"{n.text_field}={column!r}: row {missing} of {str(file)!r} holds no text (null); "
                              "drop or fill the empty rows")
        row += len(values)
        yield from values.to_pylist()
