"""A small GGUF reader: metadata key/values, the tensor directory, zero-copy tensor bytes.

`gguf.GGUFReader` builds a numpy view per metadata item (about 2 s for a 49k-token vocabulary);
this reader walks the same layout with `struct` in ~0.1 s. File layout (little endian):

    magic "GGUF" u32 | version u32 | n_tensors u64 | n_kv u64
    n_kv x      (key: string, value_type: u32, value)
    n_tensors x (name: string, n_dims: u32, dims: u64 x n_dims (fastest first), type: u32,
                 offset: u64 from the aligned start of the data section)

A string is a u64 byte length and UTF-8 bytes; an array is an item type u32, a u64 count and
the items. The data section starts at the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = 0x46554747  # b"GGUF", read as a little-endian u32
_U64 = struct.Struct("<Q")
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_ITEMS = {k: np.dtype(fmt) for k, fmt in _SCALAR_FORMATS.items()}
_PLAIN_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: rows first (GGUF dims reversed)
    data: np.ndarray  # plain types: `shape`; quantized: uint8 [*shape[:-1], bytes_per_row]


@dataclass
class GGUFFile:
    path: str
    metadata: dict[str, Any]  # scalars as Python values; arrays as lists / numpy arrays
    tensors: dict[str, GGUFTensor]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Cursor:
    """Sequential little-endian reads over a buffer."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        return self.scalar(_SCALAR_FORMATS[vtype])

    def array(self) -> Any:
        itype = GGUFValueType(self.scalar("<I"))
        count = self.scalar("<Q")
        if itype in _NUMPY_ITEMS:
            dtype = _NUMPY_ITEMS[itype]
            items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return items
        if itype == GGUFValueType.STRING:
            return self.strings(count)
        return [self.value(itype) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """A string array (a vocabulary: ~100k items), in one tight loop."""
        buf, pos, out = self.buf, self.pos, []
        unpack = _U64.unpack_from
        for _ in range(count):
            (n,) = unpack(buf, pos)
            out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        self.pos = pos
        return out


def read_gguf(path: str) -> GGUFFile:
    """Parse the header of a GGUF file; tensor data stays memory-mapped (copy-on-write)."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    cur = _Cursor(buf)
    if cur.scalar("<I") != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (bad magic)")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version}")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = [_tensor_info(cur) for _ in range(n_tensors)]
    align = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    tensors = {info[0]: _tensor(buf, data_start, *info) for info in infos}
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    n_dims = cur.scalar("<I")
    dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
    return name, dims, cur.scalar("<I"), cur.scalar("<Q")


def _tensor(buf: mmap.mmap, data_start: int, name: str, dims, qtype: int, offset: int):
    qtype = GGMLQuantizationType(qtype)
    shape = tuple(reversed(dims))
    if qtype in _PLAIN_TYPES:
        dtype = np.dtype(_PLAIN_TYPES[qtype])
        count = int(np.prod(shape))
        flat = np.frombuffer(buf, dtype=dtype, count=count, offset=data_start + offset)
        return GGUFTensor(name, qtype, shape, flat.reshape(shape))
    block, type_size = GGML_QUANT_SIZES[qtype]
    byte_shape = (*shape[:-1], shape[-1] // block * type_size)
    count = int(np.prod(byte_shape))
    flat = np.frombuffer(buf, dtype=np.uint8, count=count, offset=data_start + offset)
    return GGUFTensor(name, qtype, shape, flat.reshape(byte_shape))
