"""One safetensors file, read as untrusted input: opened once (never a FIFO, a device or a
directory), its header parsed and checked against the file (offsets inside it, every byte indexed
once, sizes that fit the shapes), its tensors read lazily from a memory map of the descriptor
that was opened, so that a file replaced or rewritten later is never read at the old file's
offsets; every failure a ValueError or OSError naming the file.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian N, N bytes of JSON
header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data,
offsets relative to its start.
"""

from __future__ import annotations

import json
import math
import os
import stat

import ml_dtypes  # numpy learns bfloat16 and the float8 types
import numpy as np

# safetensors' own limit on the header (a larger one is refused by its reader too).
MAX_HEADER_BYTES = 100_000_000

DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}


def open_regular(path: str, what: str) -> int:
    """A read-only descriptor of `path` (symlinks followed), which must be a regular file; never
    blocks on a FIFO. ValueError naming `what` and the path otherwise."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"{what} {path}: no such file") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} {path} is not a regular file (a FIFO, device or directory)")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the stat and the open
        os.close(fd)
        raise ValueError(f"{what} {path} is not a regular file (a FIFO, device or directory)")
    return fd


def read_json(path: str, what: str, limit: int = MAX_HEADER_BYTES):
    """The parsed JSON of a small regular file (config.json, an index); ValueError naming it."""
    fd = open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what} {path} is larger than {limit} bytes: not a {what}")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} {path} is not JSON: {err}") from None


def _identity(info: os.stat_result) -> tuple:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


class SafetensorsFile:
    """A safetensors file opened and checked; `tensors` maps each name to its (dtype name, numpy
    dtype or None when unknown, shape, begin, end)."""

    def __init__(self, path: str):
        self.path = path
        self._fd = open_regular(path, "safetensors file")
        try:
            info = os.fstat(self._fd)
            self.identity = _identity(info)
            self.tensors, self._data_start = self._parse(info.st_size)
        except BaseException:
            os.close(self._fd)
            raise
        self._file = os.fdopen(self._fd, "rb")

    def _bad(self, why: str) -> ValueError:
        return ValueError(
            f"safetensors file {self.path}: {why} (truncated, damaged or not a safetensors file)"
        )

    def _parse(self, size: int):
        if size < 8:
            raise self._bad(f"{size} bytes, shorter than a safetensors header")
        head = os.pread(self._fd, 8, 0)
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise self._bad(f"its header says {n} bytes, the file has {size}")
        raw = os.pread(self._fd, n, 8)
        if len(raw) != n:
            raise self._bad(f"its header of {n} bytes could not be read whole")
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise self._bad(f"its header is not JSON ({err})") from None
        if not isinstance(header, dict):
            raise self._bad("its header is not a JSON object")
        data = size - 8 - n
        tensors, spans = {}, []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            tensors[name] = self._entry(name, entry, data)
            spans.append(tensors[name][3:])
        covered = 0
        for begin, end in sorted(spans):
            if begin != covered:  # safetensors' own rule: no holes, no overlaps
                raise self._bad(f"its data has a hole or an overlap at byte {covered}")
            covered = end
        if covered != data:
            raise self._bad(f"its tensors index {covered} of its {data} data bytes")
        return tensors, 8 + n

    def _entry(self, name, entry, data: int):
        if not isinstance(entry, dict):
            raise self._bad(f"tensor {name!r} has no header entry")
        dtype_name, shape = entry.get("dtype"), entry.get("shape")
        offsets = entry.get("data_offsets")
        if (
            not isinstance(dtype_name, str)
            or not isinstance(shape, list)
            or not all(type(d) is int and d >= 0 for d in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
        ):
            raise self._bad(f"tensor {name!r} has a malformed header entry {entry!r:.200}")
        begin, end = offsets
        if not 0 <= begin <= end <= data:
            raise self._bad(f"tensor {name!r} lies at bytes [{begin}, {end}), past its {data}")
        dtype = DTYPES.get(dtype_name)
        if dtype is not None and (end - begin) != math.prod(shape) * dtype.itemsize:
            raise self._bad(
                f"tensor {name!r} ({dtype_name} {shape}) has {end - begin} bytes, not "
                f"{math.prod(shape) * dtype.itemsize}"
            )
        return dtype_name, dtype, tuple(shape), begin, end

    def read(self, name: str, index=Ellipsis) -> np.ndarray:
        """tensor[index] as a numpy array, from the file that was opened (an OSError when it
        changed since)."""
        dtype_name, dtype, shape, begin, end = self.tensors[name]
        if dtype is None:
            raise ValueError(
                f"safetensors file {self.path}: tensor {name!r} has dtype {dtype_name}, which "
                f"this reader does not know (known: {sorted(DTYPES)})"
            )
        if _identity(os.fstat(self._fd)) != self.identity:
            raise OSError(
                f"safetensors file {self.path} changed since it was opened (rewritten while it "
                f"was being read?): open the checkpoint again"
            )
        if begin == end:
            return np.zeros(shape, dtype)[index]
        try:
            raw = np.memmap(
                self._file, np.uint8, "r", offset=self._data_start + begin, shape=(end - begin,)
            )
            return np.array(raw.view(dtype).reshape(shape)[index])
        except (OSError, ValueError) as err:
            raise OSError(f"safetensors file {self.path}: reading tensor {name!r}: {err}") from None

    def close(self) -> None:
        self._file.close()
