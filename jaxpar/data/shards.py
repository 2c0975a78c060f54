"""A token stream over many files (data.path a folder or a glob of .npy / .bin shards),
opened lazily: the files' lengths come from their sizes and .npy headers, and a shard is
memory-mapped only when a row reads it, at most `KEEP` at a time. Slicing gives another lazy
view; `np.asarray` reads one. So a process's memory does not grow with the corpus: it holds
the file table and the pages its rows touch."""

from __future__ import annotations

import collections
import glob
import pathlib
from typing import Any

import numpy as np

from jaxpar.errors import ConfigError

KEEP = 64  # shards memory-mapped at once (each holds a file descriptor)
SUFFIXES = (".npy", ".bin")


class TokenShards:
    """Tokens [start, stop) of the concatenated shards `files` ((path, offset in bytes, length) each)."""

    def __init__(self, files: tuple[tuple[str, int, int], ...], dtype: np.dtype, start: int = 0, stop: int | None = None,
                 cache: collections.OrderedDict | None = None):
        self.files, self.dtype = files, np.dtype(dtype)
        self.ends = np.cumsum([n for _, _, n in files])
        self.start, self.stop = start, int(self.ends[-1]) if stop is None else stop
        self.cache = collections.OrderedDict() if cache is None else cache

    @classmethod
    def open(cls, path: str, dtype: str) -> "TokenShards":
        """The shards `path` names (a folder's .npy and .bin files, or a glob), in name order."""
        p = pathlib.Path(path)
        names = sorted(str(f) for f in p.iterdir() if f.suffix in SUFFIXES) if p.is_dir() else sorted(glob.glob(path))
        if not names:
            raise ConfigError(f"data.path={path!r} names no .npy or .bin files; give a file of token ids, a folder of "
                              "them, or a glob such as 'shards/*.npy'")
        files, kinds = [], set()
        for name in names:
            offset, length, kind = _header(name, dtype)
            if length:
                files.append((name, offset, length))
                kinds.add(kind)
        if not files:
            raise ConfigError(f"data.path={path!r}: its {len(names)} files hold no tokens")
        if len(kinds) > 1:
            raise ConfigError(f"data.path={path!r} mixes token types {sorted(map(str, kinds))}; give shards of one "
                              "(re-save them with one dtype)")
        return cls(tuple(files), kinds.pop())

    @property
    def shards(self) -> int:
        return len(self.files)

    @property
    def size(self) -> int:
        return self.stop - self.start

    def __len__(self) -> int:
        return self.size

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    def __getitem__(self, index: slice) -> "TokenShards":
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("TokenShards takes slices (a lazy view); np.asarray(view) reads it")
        lo, hi, _ = index.indices(self.size)
        return TokenShards(self.files, self.dtype, self.start + lo, self.start + max(hi, lo), self.cache)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The view's tokens, read from the shards they lie in."""
        out, at = [], self.start
        first = int(np.searchsorted(self.ends, at, side="right"))
        for i in range(first, len(self.files)):
            if at >= self.stop:
                break
            begin = int(self.ends[i - 1]) if i else 0
            piece = self._map(i)[at - begin: min(self.stop, int(self.ends[i])) - begin]
            out.append(np.asarray(piece))
            at += len(piece)
        tokens = np.concatenate(out) if out else np.zeros(0, self.dtype)
        return tokens.astype(dtype) if dtype is not None else tokens

    def _map(self, i: int) -> np.memmap:
        if i in self.cache:
            self.cache.move_to_end(i)
            return self.cache[i]
        path, offset, length = self.files[i]
        self.cache[i] = np.memmap(path, dtype=self.dtype, mode="r", offset=offset, shape=(length,))
        if len(self.cache) > KEEP:
            self.cache.popitem(last=False)
        return self.cache[i]


def _header(name: str, dtype: str) -> tuple[int, int, np.dtype]:
    """(the bytes before the tokens, their count, their type) of one shard, from its header
    or size, nothing else read."""
    p = pathlib.Path(name)
    if p.suffix == ".npy":
        try:
            with open(p, "rb") as f:
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, kind = read(f)
                offset = f.tell()
        except (ValueError, OSError) as e:
            raise ConfigError(f"data.path shard {name!r} is not a readable .npy file ({e})") from None
        length = int(np.prod(shape))
    elif p.suffix == ".bin":
        kind = np.dtype(dtype)
        offset, length = 0, p.stat().st_size // kind.itemsize
    else:
        raise ConfigError(f"data.path shard {name!r}: unknown file type {p.suffix!r}; use .npy or .bin")
    if kind.kind not in "iu":
        raise ConfigError(f"data.path shard {name!r} holds {kind} values, not token ids")
    return offset, length, kind
