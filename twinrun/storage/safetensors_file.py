"""A safetensors file from outside the run directory (a start checkpoint, a cache of images or
conditioning) read as untrusted input: a regular file only (a FIFO is refused without waiting for a
writer), no larger than memory, not sparse, its header bounded and every tensor's dtype, shape and
offsets checked (they tile the payload exactly to the file's end) before one payload byte is read; the
caller compares names and shapes with what it expects (`expect`) before `tensors()` reads them. Never
mapped, never unpickled; the safetensors package's own reader is not used (it reads every tensor a
header declares, 64 GiB included, before anyone can compare it with a model).
"""

import hashlib
import math
import os
import struct
import sys
from pathlib import Path
from typing import Self

import torch

from twinrun.errors import StoreError
from twinrun.files import loads, memory_bytes, open_regular
from twinrun.storage.header import MAX_HEADER_BYTES, MAX_STORE_BYTES, HeldFile, refuse_sparse

# Every dtype safetensors writes that torch holds, with its element size in bytes.
DTYPES = {"F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
          "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
          "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1)}


class SafetensorsFile(HeldFile):
    """One untrusted safetensors file, its header checked on opening: `shapes` ({name: shape}), then
    `expect(shapes)` and `tensors()`. A context manager (it holds a descriptor)."""

    def __init__(self, path: Path, what: str, max_bytes: int | None = None):
        self.path, self.what = Path(path), what
        limit = min(MAX_STORE_BYTES, memory_bytes()) if max_bytes is None else max_bytes
        self.fd, self.size = open_regular(self.path, limit, what)
        try:
            refuse_sparse(self.path, os.fstat(self.fd))
            self.entries, self.start = self._header()
        except BaseException:
            self.close()
            raise
        self.shapes = {name: shape for name, (_, shape, _) in self.entries.items()}
        self.metadata: dict = {}

    def __enter__(self) -> Self:
        return self

    def _header(self) -> tuple[dict, int]:
        if self.size < 8:
            raise StoreError(self.path, f"truncated ({self.size} bytes): not a safetensors {self.what}")
        (n,) = struct.unpack("<Q", self._pread(8, 0))
        if n > MAX_HEADER_BYTES or 8 + n > self.size:
            raise StoreError(self.path, f"not a safetensors {self.what} (a header of {n} bytes in a file of "
                             f"{self.size})")
        header = loads(self._pread(n, 8), f"{self.path} (its safetensors header)")
        if not isinstance(header, dict):
            raise StoreError(self.path, f"not a safetensors {self.what} (its header is not an object)")
        meta = header.pop("__metadata__", None)
        self.metadata = meta if isinstance(meta, dict) else {}
        entries, spans = {}, []
        for name, info in header.items():
            entries[name] = self._entry(name, info)
            spans.append(entries[name][2])
        expected = 0
        for begin, end in sorted(spans):
            if begin != expected:
                raise StoreError(self.path, "tensor offsets overlap or leave gaps: damaged")
            expected = end
        if 8 + n + expected != self.size:
            raise StoreError(self.path, f"{self.size} bytes, but its header describes {8 + n + expected}: "
                             "truncated or padded")
        return entries, 8 + n

    def _entry(self, name: str, info) -> tuple:
        """(dtype, shape, (begin, end)) of one header entry, each field checked."""
        if not isinstance(info, dict):
            raise StoreError(self.path, f"tensor {name[:80]!r}: not a safetensors header entry")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPES:
            raise StoreError(self.path, f"tensor {name[:80]!r}: dtype {str(dtype)[:20]!r} is not one of "
                             f"{', '.join(DTYPES)}")
        if not (isinstance(shape, list) and len(shape) <= 64
                and all(type(k) is int and k >= 0 for k in shape)):
            raise StoreError(self.path, f"tensor {name[:80]!r}: shape {str(shape)[:60]} is not a list of "
                             "sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(k) is int for k in offsets)
                and 0 <= offsets[0] and offsets[1] - offsets[0] == DTYPES[dtype][1] * math.prod(shape)):
            raise StoreError(self.path, f"tensor {name[:80]!r}: offsets do not match its shape")
        return dtype, list(shape), tuple(offsets)

    def expect(self, shapes: dict[str, list[int]], key: str | None = None) -> None:
        """The names and shapes the caller needs, before any tensor is read: a StoreError naming what
        is missing, unknown or of another shape."""
        missing = sorted(set(shapes) - set(self.shapes))
        extra = sorted(set(self.shapes) - set(shapes))
        other = sorted(n for n in set(shapes) & set(self.shapes) if list(shapes[n]) != self.shapes[n])
        if missing or extra or other:
            parts = [f"{what} {', '.join(n[:80] for n in names[:3])}{' …' if len(names) > 3 else ''}"
                     for what, names in (("lacks", missing), ("has unknown", extra),
                                         ("has other shapes for", other)) if names]
            raise StoreError(self.path, f"does not match: it {'; '.join(parts)}")

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, read once (little-endian, as safetensors writes them), as CPU tensors."""
        return self._tensors(self._payload())

    def tensors_and_sha256(self) -> tuple[dict[str, torch.Tensor], str]:
        """tensors(), and the sha256 of the file's bytes as read (header and payload): the digest a run's
        identity records is of exactly the bytes its numbers came from."""
        head, data = self._pread(self.start, 0), self._payload()
        digest = hashlib.sha256(head)
        digest.update(data)
        return self._tensors(data), digest.hexdigest()

    def _payload(self) -> bytearray:
        data = bytearray(self.size - self.start)
        try:
            if os.preadv(self.fd, [data], self.start) != len(data):
                raise StoreError(self.path, "changed size while being read")
        except OSError as err:
            raise StoreError(self.path, f"cannot read ({err.strerror})") from None
        return data

    def _tensors(self, data: bytearray) -> dict[str, torch.Tensor]:
        assert sys.byteorder == "little", "twinrun reads safetensors files on little-endian machines only"
        out = {}
        for name, (dtype, shape, (begin, end)) in self.entries.items():
            torch_dtype = DTYPES[dtype][0]
            out[name] = (torch.frombuffer(data, dtype=torch_dtype, count=math.prod(shape), offset=begin)
                         .view(shape) if end > begin else torch.empty(shape, dtype=torch_dtype))
        return out


def read_safetensors(path: Path, what: str, shapes: dict[str, list[int]] | None = None) -> dict:
    """Every tensor of an untrusted safetensors file, after its header's checks and (`shapes`) its names
    and shapes against what the caller needs; a StoreError (exit 2) naming the file otherwise."""
    with SafetensorsFile(path, what) as f:
        if shapes is not None:
            f.expect(shapes)
        return f.tensors()
