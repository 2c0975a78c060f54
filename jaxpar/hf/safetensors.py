"""The safetensors format, read memory-mapped and written a tensor at a time.

A file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the raw little-endian bytes. A
checkpoint is one `model.safetensors`, or several files and `model.safetensors.index.json`
({"weight_map": {name: file}}).

jaxpar reads it here rather than through the `safetensors` package: a tensor is opened as a
numpy memmap, so slicing it reads only the pages the slice touches (each process reads only
what its devices hold), and writing streams one tensor at a time into a file whose header is
known up front, so an export never holds a whole file in memory. tests/test_hf.py checks
both directions against the `safetensors` package.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import struct
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from jaxpar.errors import ConfigError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its file, dtype, shape and the byte offset of its data."""

    file: pathlib.Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int


def read_header(path: pathlib.Path) -> dict[str, Entry]:
    """Every tensor of one file, from its header alone (nothing else is read)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise ConfigError(f"{str(path)!r} is not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    start, size = 8 + length, path.stat().st_size
    entries = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{str(path)!r}: the header's entry for {name!r} is not a tensor's") from None
        if dtype not in DTYPES:
            raise ConfigError(f"{str(path)!r}: tensor {name!r} has dtype {dtype}, which jaxpar does not read; "
                              f"it reads {', '.join(DTYPES)}")
        if end - begin != int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize or start + end > size:
            raise ConfigError(f"{str(path)!r}: tensor {name!r} should lie in bytes {start + begin} to {start + end} of "
                              f"the file, which has {size}; the file is truncated or damaged: download it again")
        entries[name] = Entry(path, DTYPES[dtype], shape, start + begin)
    return entries


def tensor_index(folder: pathlib.Path) -> dict[str, Entry]:
    """Every tensor of a checkpoint folder: one file, or the files its index names (each must
    be there; a missing one is named)."""
    index = folder / INDEX
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"{str(index)!r} is not a readable index ({type(e).__name__}: {e}); it holds "
                              '{"weight_map": {tensor: file}}') from None
    elif (folder / SINGLE).is_file():
        files = [SINGLE]
    else:
        found = sorted(p.name for p in folder.glob("*.safetensors"))
        if len(found) != 1:
            raise ConfigError(f"{str(folder)!r} has no {SINGLE} and no {INDEX}"
                              + (f" (it has {', '.join(found)}); give the index" if found else "; give a folder of a Hugging "
                                 "Face checkpoint (config.json and *.safetensors)"))
        files = found
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise ConfigError(f"{str(folder)!r}: {INDEX} names {', '.join(missing)}, which "
                          f"{'is' if len(missing) == 1 else 'are'} not there; copy the whole checkpoint")
    entries: dict[str, Entry] = {}
    for f in files:
        entries.update(read_header(folder / f))
    return entries


def open_tensor(entry: Entry) -> np.ndarray:
    """The tensor as a read-only memmap: nothing is read until it is sliced."""
    if not entry.shape:
        return np.fromfile(entry.file, entry.dtype, 1, offset=entry.offset).reshape(())
    return np.memmap(entry.file, entry.dtype, "r", entry.offset, entry.shape)


@dataclasses.dataclass(frozen=True)
class Planned:
    """A tensor to write: its name, dtype, shape and a function that makes its values."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    values: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def plan_files(tensors: list[Planned], max_bytes: int) -> list[list[Planned]]:
    """Tensors grouped, in order, into files of at most `max_bytes` (a larger tensor alone)."""
    files: list[list[Planned]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files


def write_file(path: pathlib.Path | None, tensors: Iterable[Planned], metadata: dict[str, str]) -> None:
    """One safetensors file, each tensor's values made and written in turn. With `path`
    None the values are made and dropped: another process writes, and making them may be
    a collective every process must join."""
    tensors = list(tensors)
    if path is None:
        for t in tensors:
            t.values()
        return
    header: dict = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-aligned, as the format asks
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for t in tensors:
            value = np.ascontiguousarray(t.values(), dtype=t.dtype)
            if value.shape != t.shape:
                raise AssertionError(f"{t.name}: made {value.shape}, planned {t.shape}")
            f.write(value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())


def file_names(count: int) -> list[str]:
    """Hugging Face's names: model.safetensors alone, else model-0000i-of-0000n.safetensors."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
