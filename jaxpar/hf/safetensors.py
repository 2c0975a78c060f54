"""The safetensors format, read memory-mapped and written a tensor at a time.

A file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the raw little-endian bytes. A
checkpoint is one `model.safetensors`, or several files and `model.safetensors.index.json`
({"weight_map": {name: file}}).

jaxpar reads it here rather than through the `safetensors` package: a tensor is opened as a
numpy memmap, so slicing it reads only the pages the slice touches (each process reads only
what its devices hold), and writing streams one tensor at a time into a file whose header is
known up front, so an export never holds a whole file in memory. tests/equivalence/test_hf.py checks
both directions against the `safetensors` package.

A header is checked once, when it is read, as strictly as the Rust `safetensors` crate does
(tests/unit/test_safetensors_hostile.py): a stranger's file can make jaxpar refuse it, in one
ConfigError line, but never misread it, and an index never leads outside its folder.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
MAX_HEADER_BYTES = 100_000_000  # the Rust `safetensors` crate's MAX_HEADER_SIZE
MAX_ARRAY_BYTES = 2**63 - 1  # numpy's largest array, in bytes (zero dims left out)
FIELDS = ("dtype", "shape", "data_offsets")


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its file, dtype, shape and the byte offset of its data."""

    file: pathlib.Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int


def read_header(path: pathlib.Path) -> dict[str, Entry]:
    """Every tensor of one file, from its header alone (nothing else is read). The header is
    checked as strictly as the Rust `safetensors` crate does: known dtypes, each tensor's
    bytes exactly its shape's, the tensors covering the data without gaps or overlaps. A
    violation raises one ConfigError line naming the file, the tensor, the field and the value."""
    header, data_start, data_bytes = _read_json_header(path)
    entries, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            _check_metadata(path, info)
            continue
        dtype, shape, begin, end = _check_entry(path, name, info)
        spans.append((begin, end, name))
        entries[name] = Entry(path, dtype, shape, data_start + begin)
    _check_layout(path, spans, data_bytes)
    return entries


def _refuse(path: pathlib.Path, message: str) -> ConfigError:
    return ConfigError(f"{str(path)!r}: {message}")


def _show(value) -> str:
    """A header value as JSON on one line, cut short: a hostile header may hold megabytes."""
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _quote(name: str, limit: int = 80) -> str:
    text = repr(name)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _read_json_header(path: pathlib.Path) -> tuple[dict, int, int]:
    """The header as a JSON object, where the data starts and how many bytes it has."""
    damaged = "the file is truncated or damaged: download it again"
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise _refuse(path, f"the file has {size} bytes, fewer than the 8 of its header length; {damaged}")
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES:
                raise _refuse(path, f"header length (first 8 bytes) {length} is over the format's limit of "
                                    f"{MAX_HEADER_BYTES} bytes; this is not a safetensors file, or it is damaged")
            if length > size - 8:
                raise _refuse(path, f"header length (first 8 bytes) {length} is more than the {size - 8} bytes "
                                    f"after it; {damaged}")
            raw = f.read(length)
    except OSError as e:
        raise ConfigError(f"{str(path)!r} is not a readable safetensors file ({e})") from None
    header = _parse_json(path, raw, "header")
    if not isinstance(header, dict):
        raise _refuse(path, f"the header is a JSON {type(header).__name__}, {_show(header)}; it must be an object "
                            '{tensor: {"dtype", "shape", "data_offsets"}}')
    return header, 8 + length, size - 8 - length


def _parse_json(path: pathlib.Path, raw: bytes, what: str):
    """UTF-8 JSON, a key given twice refused (which one would be read is a guess)."""
    def no_repeats(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise _refuse(path, f"the {what} gives the key {_quote(key)} twice; each key is given once")
            seen[key] = value
        return seen

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=no_repeats)
    except ConfigError:
        raise
    except RecursionError:  # Python's parser recurses per level; a header is 3 deep
        raise _refuse(path, f"the {what} nests JSON deeper than Python can parse; a safetensors {what} "
                            "is 3 levels deep") from None
    except ValueError as e:  # bad UTF-8, bad JSON, an integer of over 4300 digits
        raise _refuse(path, f"the {what} is not UTF-8 JSON ({_cut(str(e))})") from None


def _cut(text: str) -> str:
    return text if len(text) <= 120 else text[:117] + "..."


def _check_metadata(path: pathlib.Path, metadata) -> None:
    if not isinstance(metadata, dict):
        raise _refuse(path, f"__metadata__ is {_show(metadata)}; it must be an object of string -> string")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise _refuse(path, f"__metadata__ {_quote(key)} is {_show(value)}; metadata values must be strings")


def _check_entry(path: pathlib.Path, name: str, info) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """One tensor's dtype, shape and [begin, end), each field checked, the span its shape's bytes."""
    tensor = f"tensor {_quote(name)}"
    if not isinstance(info, dict) or sorted(info) != sorted(FIELDS):
        got = f"fields {_show(sorted(info))}" if isinstance(info, dict) else _show(info)
        raise _refuse(path, f"{tensor} is described by {got}; it must be an object of exactly {', '.join(FIELDS)}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _refuse(path, f"{tensor} has dtype {_show(dtype)}, which jaxpar does not read; it reads {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _refuse(path, f"{tensor} has shape {_show(shape)}; a shape is a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            and offsets[0] <= offsets[1]):
        raise _refuse(path, f"{tensor} has data_offsets {_show(offsets)}; they must be two non-negative integers "
                            "[begin, end] with begin <= end")
    itemsize = DTYPES[dtype].itemsize
    nbytes = math.prod(shape) * itemsize  # Python ints: nothing overflows
    begin, end = offsets
    if end - begin != nbytes:
        raise _refuse(path, f"{tensor} has data_offsets {_show(offsets)} ({end - begin} bytes), but its shape "
                            f"{_show(shape)} of {dtype} takes {nbytes} bytes; the header is damaged")
    if math.prod(d or 1 for d in shape) * itemsize > MAX_ARRAY_BYTES:  # only a zero dim lets this through
        raise _refuse(path, f"{tensor} has shape {_show(shape)} of {dtype}, which numpy cannot map: its non-zero "
                            f"dims times {itemsize} bytes exceed 2**63 - 1")
    return DTYPES[dtype], tuple(shape), begin, end


def _is_count(value) -> bool:
    return type(value) is int and value >= 0  # not bool, float or string


def _check_layout(path: pathlib.Path, spans: list[tuple[int, int, str]], data_bytes: int) -> None:
    """The tensors, in order of offset, tile the data from byte 0 to its end (the Rust crate's
    rule): no byte read as two tensors, none left over."""
    end, last = 0, None
    for begin, next_end, name in sorted(spans):
        if begin < end:
            raise _refuse(path, f"tensors {_quote(last)} (data bytes to {end}) and {_quote(name)} (data bytes "
                                f"{begin} to {next_end}) overlap; each byte belongs to one tensor")
        if begin > end:
            raise _refuse(path, f"no tensor holds data bytes {end} to {begin} (before tensor {_quote(name)}); "
                                "the tensors must cover the data without gaps")
        end, last = next_end, name
    if end > data_bytes:
        raise _refuse(path, f"tensor {_quote(last)} ends at data byte {end}, but the data has {data_bytes} bytes; "
                            "the file is truncated or damaged: download it again")
    if end < data_bytes:
        raise _refuse(path, f"the data has {data_bytes} bytes, but its tensors end at byte {end}; the file "
                            "is damaged or holds what its header does not describe")


def tensor_index(folder: pathlib.Path) -> dict[str, Entry]:
    """Every tensor of a checkpoint folder: one file, or the files its index names (each must
    be there, inside the folder; a missing one is named). A tensor in two files is refused."""
    entries: dict[str, Entry] = {}
    for path in _checkpoint_files(folder):
        for name, entry in read_header(path).items():
            if name in entries:
                raise ConfigError(f"{str(folder)!r}: tensor {_quote(name)} is in both {entries[name].file.name} and "
                                  f"{path.name}; which to read is a guess: the checkpoint is damaged")
            entries[name] = entry
    return entries


def _checkpoint_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files to read, each checked to lie inside `folder` before it is opened."""
    roots = _allowed_roots(folder)
    index = folder / INDEX
    if index.is_file():
        files = _index_files(folder, _inside(folder, roots, INDEX, folder), roots)
    elif (folder / SINGLE).is_file():
        files = [_inside(folder, roots, SINGLE, folder)]
    else:
        found = sorted(p.name for p in folder.glob("*.safetensors"))
        if len(found) != 1:
            raise ConfigError(f"{str(folder)!r} has no {SINGLE} and no {INDEX}"
                              + (f" (it has {', '.join(found)}); give the index" if found else "; give a folder of a Hugging "
                                 "Face checkpoint (config.json and *.safetensors)"))
        files = [_inside(folder, roots, found[0], folder)]
    missing = [f.name for f in files if not _is_file(f)]
    if missing:
        raise ConfigError(f"{str(folder)!r}: {INDEX} names {', '.join(missing)}, which "
                          f"{'is' if len(missing) == 1 else 'are'} not there; copy the whole checkpoint")
    return files


def _index_files(folder: pathlib.Path, index: pathlib.Path, roots: list[pathlib.Path]) -> list[pathlib.Path]:
    """The files an index's weight_map names: it must be {"weight_map": {tensor: file}}."""
    shape = '{"weight_map": {tensor: file}}'
    try:
        raw = index.read_bytes()
    except OSError as e:
        raise ConfigError(f"{str(index)!r} is not a readable index ({e}); it holds {shape}") from None
    content = _parse_json(index, raw, "index")
    if not isinstance(content, dict):
        raise _refuse(index, f"the index is a JSON {type(content).__name__}; it must be an object {shape}")
    weight_map = content.get("weight_map")
    if not isinstance(weight_map, dict):
        raise _refuse(index, f"weight_map is {_show(weight_map)}; the index must be an object {shape}")
    for tensor, file in weight_map.items():
        if not isinstance(file, str):
            raise _refuse(index, f"weight_map gives tensor {_quote(tensor)} the file {_show(file)}; a file is a name")
    return [_inside(folder, roots, file, index) for file in sorted(set(weight_map.values()))]


def _allowed_roots(folder: pathlib.Path) -> list[pathlib.Path]:
    """Where a checkpoint's files may lie: its folder, and in a Hugging Face cache snapshot
    (models--X/snapshots/REV, whose files link to ../../blobs) that repository's blobs."""
    root = folder.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return [root, root.parent.parent / "blobs"]
    return [root]


def _inside(folder: pathlib.Path, roots: list[pathlib.Path], name: str, named_by: pathlib.Path) -> pathlib.Path:
    """folder / name, refused (before anything opens it) unless it resolves inside `roots`."""
    outside = f"the file {_quote(name, 300)} lies outside the checkpoint folder {str(folder)!r}"
    if "\0" in name:
        raise _refuse(named_by, f"the file {_quote(name, 300)} has a NUL byte in its name; no file is named so")
    if pathlib.PurePath(name).is_absolute() or ".." in pathlib.PurePath(name).parts:
        raise _refuse(named_by, f"{outside}; files are named relative to the folder, without '..'")
    path = folder / name
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise _refuse(named_by, f"the file {_quote(name, 300)} cannot be resolved ({_cut(str(e))})") from None
    if not any(resolved.is_relative_to(root) for root in roots):
        raise _refuse(named_by, f"{outside}: it links to {str(resolved)!r}; copy the file into the folder")
    return path


def _is_file(path: pathlib.Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long, say
        return False


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
            value = np.asarray(t.values(), dtype=t.dtype, order="C")  # ascontiguousarray makes a scalar 1-d
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
