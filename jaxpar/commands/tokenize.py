"""`jaxpar tokenize`: text tokenized once, in parallel, into a token file for data.source=tokens.

The ids are those data.source=text makes when a run starts (jaxpar.data.text: the same
documents in the same order, each after --bos-id and followed by --eos-id), written as uint16 where the
vocabulary fits, else uint32. The file appears whole or not at all: it is written beside its
destination under a temporary name and renamed into place when complete; an error or Ctrl-C
removes the temporary file. A side file beside it, its name with .json added (corpus.bin.json),
records how it was made. The output paths are checked before any document is read.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

from tqdm import tqdm

from jaxpar.data import text
from jaxpar.data.tokenized import encoded, write_atomically, write_tokens
from jaxpar.errors import ConfigError

NAMES = text.Names(path="PATH", tokenizer="--tokenizer", text_field="--text-field", eos_id="--eos-id", bos_id="--bos-id")
OUTPUTS = (".bin", ".npy")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `tokenize` and its arguments on the CLI's sub-command parsers."""
    p = subparsers.add_parser(
        "tokenize", help="tokenize text once, in parallel, into a token file for data.source=tokens",
        description="Tokenize .txt, .jsonl or .parquet documents with a Hugging Face tokenizer.json into a "
        "memory-mapped token file, the ids data.source=text would make.")
    p.add_argument("path", metavar="PATH", help="a .txt, .jsonl or .parquet file, a folder of them, or a glob (quoted)")
    p.add_argument("--tokenizer", required=True, metavar="FILE", help="a Hugging Face tokenizer.json")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="the token file to write, .bin (raw) or .npy; FILE.json beside it records how it was made")
    p.add_argument("--text-field", default="text", metavar="KEY",
                   help="the JSONL key or Parquet column of each document (default text)")
    p.add_argument("--eos-id", type=int, default=-1, metavar="ID",
                   help="the id written after each document, to train with data.eos_id=ID (default -1: none)")
    p.add_argument("--bos-id", type=int, default=-1, metavar="ID",
                   help="the id written before each document, as the model's tokenizer puts it (its <bos>); "
                        "train with data.bos_id=ID (default -1: none)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="processes tokenizing at once (default: one per CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p



def run(args) -> int:
    """Tokenize args.path into args.out and its sidecar; print one line saying how to train on it.
    Bad input raises ConfigError, before anything is written where it can."""
    spec = text.TextSpec(args.path, args.tokenizer, args.text_field, args.eos_id, NAMES, args.bos_id)
    out = pathlib.Path(args.out)
    check_out(out)
    if args.workers < 1:
        raise ConfigError(f"--workers={args.workers} must be at least 1, e.g. --workers={os.cpu_count() or 1}")
    if not spec.text_field:
        raise ConfigError("--text-field='' names no key; give the JSONL key or Parquet column of each document")
    tokenizer = text.load_tokenizer(spec)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = text.token_dtype(vocab)
    files = text.document_files(spec)
    total = text.count_documents(files, spec)
    # None: no bar where stderr is not a terminal (a pipe, a log file); the last line says it all
    with tqdm(total=total, unit="doc", disable=args.no_progress or None, dynamic_ncols=True) as bar:
        parts = encoded(tokenizer, spec, files, dtype, args.workers, bar)
        try:
            count = write_tokens(out, parts, dtype)
        finally:
            parts.close()  # stops the workers now, also when writing failed
    sidecar = {"tokenizer": str(pathlib.Path(spec.tokenizer).resolve()), "vocab_size": vocab, "dtype": dtype.name,
               "eos_id": spec.eos_id, "bos_id": spec.bos_id, "documents": total, "tokens": count, "source": spec.path,
               "text_field": spec.text_field}
    write_atomically(side_file(out), lambda f: f.write(json.dumps(sidecar, indent=1).encode() + b"\n"))
    eos = f" --set data.eos_id={spec.eos_id}" if spec.eos_id >= 0 else ""
    eos += f" --set data.bos_id={spec.bos_id}" if spec.bos_id >= 0 else ""
    print(f"jaxpar tokenize: {total} documents, {count} tokens ({dtype.name}) in {out}; train on it with "
          f"--set data.source=tokens --set data.path={out} --set data.dtype={dtype.name}{eos}", flush=True)
    return 0


def side_file(out: pathlib.Path) -> pathlib.Path:
    """Where the record of how `out` was made goes: its whole name with .json added, so
    corpus.bin's and corpus.npy's do not overwrite each other."""
    return out.with_name(out.name + ".json")


def check_out(out: pathlib.Path) -> None:
    """--out and its side file can be written, checked before the corpus is read: a .bin or
    .npy path, in a folder that is there and writable, neither path a folder."""
    shown = f"--out={str(out)!r}"
    if out.suffix not in OUTPUTS:
        raise ConfigError(f"{shown}: write a .bin (raw ids) or .npy file, e.g. --out={out.with_suffix('.bin')}")
    if out.parent.exists() and not out.parent.is_dir():
        raise ConfigError(f"{shown}: {str(out.parent)!r} is a file, not a folder; give a path in a folder")
    if not out.parent.is_dir():
        raise ConfigError(f"{shown}: no folder {str(out.parent)!r}; create it first")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{shown}: the folder {str(out.parent)!r} is not writable by this user; give a folder you "
                          "can write")
    if out.is_dir():
        raise ConfigError(f"{shown} is a folder; give the file to write, e.g. --out={out / ('tokens' + out.suffix)}")
    if side_file(out).is_dir():
        raise ConfigError(f"{shown}: its side file {str(side_file(out))!r} is a folder; move it, or give another --out")
