"""Minimal safetensors reader/writer over numpy, for dtypes numpy lacks (BF16, F8_E4M3).

Format: u64 little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import mmap
import struct

import numpy as np

_NP = {"F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "U8": "u1", "I8": "i1", "BOOL": "?", "F64": "<f8"}
_ITEMSIZE = {"BF16": 2, "F8_E4M3": 1, **{k: np.dtype(v).itemsize for k, v in _NP.items()}}


def bf16_bytes(x: np.ndarray) -> bytes:
    """float32 -> bf16 (round to nearest even), as bytes."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
    return u.astype("<u2").tobytes()


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def save_file(path: str, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str] | None = None) -> None:
    """Write ``{name: (dtype, array)}``; dtype is a safetensors name ("BF16" takes float32 input,
    "F8_E4M3" takes the uint8 codes). Tensors are written in sorted name order."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        dtype, x = tensors[name]
        if dtype == "BF16":
            data = bf16_bytes(x)
        elif dtype == "F8_E4M3":
            data = np.ascontiguousarray(x, dtype=np.uint8).tobytes()
        else:
            data = np.ascontiguousarray(x, dtype=_NP[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(x.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


class SafeTensorsFile:
    """Lazy reader: ``keys()``, ``dtype(name)``, ``shape(name)``, ``get(name)`` -> numpy.

    ``get`` returns float32 for BF16/F16/F32, uint8 codes for F8_E4M3 (``ops/fp8_numerics.py`` decodes them)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if len(self._mm) < 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", self._mm[:8])
        if n > len(self._mm) - 8:
            raise ValueError(f"{path}: not a safetensors file (bad header length {n})")
        header = json.loads(bytes(self._mm[8 : 8 + n]))
        self.metadata = header.pop("__metadata__", {})
        self._header = header
        self._base = 8 + n
        self.bytes_read = 0

    def keys(self) -> list[str]:
        return list(self._header)

    def dtype(self, name: str) -> str:
        return self._header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def nbytes(self, name: str) -> int:
        """Bytes the tensor takes in the file."""
        b, e = self._header[name]["data_offsets"]
        return e - b

    def get(self, name: str, dim: int | None = None, start: int = 0, end: int | None = None) -> np.ndarray:
        """The tensor, or its slice [start, end) along ``dim`` (0 or 1), reading only those bytes
        from the mapped file; ``bytes_read`` counts them."""
        info = self._header[name]
        dtype, shape = info["dtype"], tuple(info["shape"])
        b, e = info["data_offsets"]
        if dtype not in _ITEMSIZE:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
        size = _ITEMSIZE[dtype]
        if e - b != int(np.prod(shape, dtype=np.int64)) * size:
            raise ValueError(f"{self.path}: tensor {name!r} byte length does not match shape {shape}")
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=e - b, offset=self._base + b)
        if dim is not None:
            end = shape[dim] if end is None else end
            row = int(np.prod(shape[1:], dtype=np.int64)) * size
            if dim == 0:  # contiguous rows
                raw, shape = raw[start * row : end * row], (end - start, *shape[1:])
            else:  # a column block of every row
                cols = shape[1]
                raw = raw.reshape(shape[0], cols, -1)[:, start:end].reshape(-1)
                shape = (shape[0], end - start, *shape[2:])
            raw = np.ascontiguousarray(raw)
        self.bytes_read += raw.size
        if dtype == "BF16":
            return bf16_to_f32(raw.view("<u2")).reshape(shape)
        if dtype == "F8_E4M3":
            return raw.reshape(shape).copy()
        return raw.view(_NP[dtype]).astype(np.float32 if dtype == "F16" else _NP[dtype]).reshape(shape)
