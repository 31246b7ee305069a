"""A GGUF file (llama.cpp's format) read directly: its key/value metadata walked once, its
tensors as numpy views of one memory map.

The layout: a header (`GGUF`, version, tensor count, key count), the key/value metadata
(the model's hyperparameters and, for a tokenizer, its whole vocabulary and merges), one
info record per tensor (name, dims innermost first, type, offset), then the tensor data,
aligned to `general.alignment` bytes. `gguf.GGUFReader` wraps every string of the metadata
in numpy views (about 2 s for a 49k-token vocabulary, paid on every load); walking the
bytes with `struct` takes a tenth of that or less. Tensors come out as `GGUFReader` gives them:
float and integer types with their numpy dtype and shape, quantized types as uint8
[rows, row bytes].
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from minserve.errors import ModelLoadError

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT32: "f",
    GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}  # fmt: skip
_ELEMENT_TYPES = {  # tensor types read element by element; the others are raw blocks
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}  # fmt: skip
DEFAULT_ALIGNMENT = 32


class _GGUFCursor:
    """Walks the little-endian sections that follow a GGUF header."""

    def __init__(self, buf: mmap.mmap, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        raw = self.buf[self.pos : self.pos + length]
        if len(raw) != length:
            raise struct.error(f"a {length}-byte string runs past the end of the file")
        self.pos += length
        return raw.decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            item_type, count = self.unpack("IQ")
            if item_type in _SCALAR_FORMATS:
                return list(self.unpack(f"{count}{_SCALAR_FORMATS[item_type]}"))
            return [self.value(item_type) for _ in range(count)]
        return self.unpack(_SCALAR_FORMATS[value_type])[0]

    def metadata(self, num_keys: int) -> dict[str, Any]:
        return {self.string(): self.value(self.unpack("I")[0]) for _ in range(num_keys)}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: `shape` lists dims innermost first, as GGUF does; `data` is
    a read-only view of the file ([rows, row bytes] uint8 for a quantized type)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata and tensors (the tensors' data stay in the memory map)."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]

    def field(self, key: str, default: object = None) -> Any:
        """The metadata value under `key` (a number, a string or a list), else `default`."""
        return self.metadata.get(key, default)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF file's key/value metadata, tensors untouched."""
    with open(path, "rb") as f, _mapped(f, path) as buf:
        cursor = _GGUFCursor(buf, 4)
        _, num_keys = _header(cursor, path)
        return _guarded(path, lambda: cursor.metadata(num_keys))


def read_gguf_file(path: str | Path) -> GGUFFile:
    """The metadata and the tensors of the GGUF file at `path`; a ModelLoadError if it is
    not one, or is corrupt or truncated."""
    with open(path, "rb") as f:
        buf = _mapped(f, path)  # the tensors' views keep the map open
    cursor = _GGUFCursor(buf, 4)
    num_tensors, num_keys = _header(cursor, path)
    metadata = _guarded(path, lambda: cursor.metadata(num_keys))
    infos = _guarded(path, lambda: [_tensor_info(cursor) for _ in range(num_tensors)])
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.pos // alignment) * alignment
    whole = np.frombuffer(buf, dtype=np.uint8)
    tensors = [_tensor(whole, start, *info, path) for info in infos]
    return GGUFFile(Path(path), metadata, tensors)


def _mapped(f: Any, path: str | Path) -> mmap.mmap:
    if f.read(4) != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _header(cursor: _GGUFCursor, path: str | Path) -> tuple[int, int]:
    """(tensor count, key count) after checking the version."""
    version, num_tensors, num_keys = _guarded(path, lambda: cursor.unpack("IQQ"))
    if version < 2:
        raise ModelLoadError(f"{path} is GGUF v{version}; minserve reads v2 and later")
    return num_tensors, num_keys


def _tensor_info(cursor: _GGUFCursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    (num_dims,) = cursor.unpack("I")
    dims = cursor.unpack(f"{num_dims}Q")
    raw_type, offset = cursor.unpack("IQ")
    return name, dims, raw_type, offset


def _tensor(
    whole: np.ndarray, start: int, name: str, dims: tuple[int, ...], raw_type: int,
    offset: int, path: str | Path,
) -> GGUFTensor:  # fmt: skip
    """A view of one tensor's bytes, typed and shaped as `gguf.GGUFReader` gives them."""
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError as error:
        raise ModelLoadError(f"{path}: tensor {name} has unknown type {raw_type}") from error
    numel = int(np.prod(dims))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    nbytes = numel * type_size // block_size
    first = start + offset
    if first + nbytes > len(whole):
        raise ModelLoadError(
            f"{path} is corrupt or truncated: tensor {name} runs past the end of the file"
        )
    raw = whole[first : first + nbytes]
    shape = tuple(reversed(dims))
    if qtype in _ELEMENT_TYPES:
        data = raw.view(_ELEMENT_TYPES[qtype]).reshape(shape)
    else:
        data = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
    return GGUFTensor(name, qtype, tuple(dims), data)


def _guarded(path: str | Path, read: Any) -> Any:
    try:
        return read()
    except (struct.error, UnicodeDecodeError, KeyError, ValueError) as error:
        raise ModelLoadError(f"{path} has corrupt or truncated metadata: {error!r}") from error
