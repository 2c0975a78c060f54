"""A text corpus tokenized by a pool of worker processes (data.workers; `jaxpar tokenize`
--workers), streamed to a token file that appears whole or not at all, and kept in a cache
folder (data.cache) where the next run finds it, memory-mapped.

Our own pool, not Grain: the corpus is tokenized once, in order, into one stream whose
windows and epochs are then a pure function of (seed, step) (jaxpar.data.order), the same on
any number of processes; Grain's loaders shard records per process and checkpoint each
process's iterator, which resumes exactly only on the same process count.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import pathlib
import shutil
import signal
from typing import Iterable, Iterator

import numpy as np

from jaxpar.data import text

CHUNK = 256  # documents per task: enough to keep a worker busy, few enough for a smooth progress bar


def encoded(tokenizer, spec: text.TextSpec, files, dtype, workers: int, bar=None) -> Iterator[np.ndarray]:
    """The corpus's ids, a chunk of documents at a time, in order; with several workers each
    encodes whole chunks with its own copy of the tokenizer."""
    chunks = (list(c) for c in itertools.batched(text.documents(files, spec), CHUNK))
    if workers == 1:
        for docs in chunks:
            yield text.encode(tokenizer, docs, spec.eos_id, dtype, spec.bos_id)
            if bar is not None:
                bar.update(len(docs))
        return
    # spawn: a forked child would inherit the parent's threads (JAX's, the tokenizer's) mid-state
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_start_worker, initargs=(spec, dtype)) as pool:
        for ids, n_docs in pool.imap(_encode_chunk, chunks):
            yield ids
            if bar is not None:
                bar.update(n_docs)


_WORKER: dict = {}  # in each worker process: its tokenizer, spec and dtype, set once by _start_worker


def _start_worker(spec: text.TextSpec, dtype) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism: no thread pool each
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends the pool
    _WORKER.update(tokenizer=text.load_tokenizer(spec), spec=spec, dtype=dtype)


def _encode_chunk(docs: list[str]) -> tuple[np.ndarray, int]:
    spec = _WORKER["spec"]
    return text.encode(_WORKER["tokenizer"], docs, spec.eos_id, _WORKER["dtype"], spec.bos_id), len(docs)


def write_tokens(out: pathlib.Path, parts: Iterable[np.ndarray], dtype) -> int:
    """Write the parts end to end to `out` (.bin: raw; .npy: with its header) atomically, and
    return how many ids were written. The ids stream to disk, never all in memory."""
    raw = out.with_name(f".{out.name}.{os.getpid()}.ids")
    count = 0
    try:
        with open(raw, "wb") as f:
            for part in parts:
                f.write(part.astype(dtype, copy=False).tobytes())
                count += len(part)
        if out.suffix == ".npy":
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (count,)}

            def npy(f):
                np.lib.format.write_array_header_1_0(f, header)
                with open(raw, "rb") as ids:
                    shutil.copyfileobj(ids, f, 1 << 24)

            write_atomically(out, npy)
        else:
            os.replace(raw, out)
    finally:
        raw.unlink(missing_ok=True)
    return count


def write_atomically(path: pathlib.Path, write) -> None:
    """`write(file)` into a temporary file beside `path`, then rename it into place; on any
    error or interrupt the temporary file is removed and `path` left as it was."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            write(f)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def cached_corpus(spec: text.TextSpec, vocab_size: int, workers: int, cache: str) -> text.Corpus:
    """The corpus's ids memory-mapped from `cache`, tokenized into it first (by `workers`
    processes; 0 or 1: this one) unless a file of the same files, sizes, times, tokenizer
    and ids around documents is there already. Its side file counts the documents."""
    tokenizer, dtype, files = _opened(spec, vocab_size)
    key = {"files": [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files],
           "tokenizer": hashlib.sha256(pathlib.Path(spec.tokenizer).read_bytes()).hexdigest(),
           "text_field": spec.text_field, "eos_id": spec.eos_id, "bos_id": spec.bos_id}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    out, side = pathlib.Path(cache) / f"{name}.npy", pathlib.Path(cache) / f"{name}.npy.json"
    if not (out.exists() and side.exists()):
        documents = _Count()
        parts = encoded(tokenizer, spec, files, dtype, max(workers, 1), documents)
        try:
            count = write_tokens(out, parts, dtype)
        finally:
            parts.close()
        write_atomically(side, lambda f: f.write(json.dumps({**key, "documents": documents.n, "tokens": count}).encode()))
    return text.Corpus(np.load(out, mmap_mode="r"), len(files), json.loads(side.read_text())["documents"])


def parallel_corpus(spec: text.TextSpec, vocab_size: int, workers: int) -> text.Corpus:
    """The corpus's ids in memory, tokenized by `workers` processes (text.read_corpus's ids)."""
    tokenizer, dtype, files = _opened(spec, vocab_size)
    documents = _Count()
    parts = list(encoded(tokenizer, spec, files, dtype, workers, documents))
    return text.Corpus(np.concatenate(parts) if parts else np.zeros(0, dtype), len(files), documents.n)


def _opened(spec: text.TextSpec, vocab_size: int) -> tuple:
    """(the tokenizer, the ids' dtype, the corpus's files), as text.read_corpus opens them."""
    tokenizer = text.load_tokenizer(spec, vocab_size)
    return tokenizer, text.token_dtype(tokenizer.get_vocab_size(with_added_tokens=True)), text.document_files(spec)


class _Count:
    """The documents `encoded` went through, counted as it reports them (a bar's `update`),
    so the corpus is read once."""

    n = 0

    def update(self, documents: int) -> None:
        self.n += documents
