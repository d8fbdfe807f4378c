"""The safetensors header every store begins with, read as untrusted input: its size bounds, the codec
of its metadata strings, the format it names, and the refusal of sparse files before any byte is read.
Probe stores (twinrun.storage.store) and training stores (twinrun.storage.train_store) share it.
"""

import json
import os
import re
import struct
from pathlib import Path

import torch

from twinrun.errors import StoreError
from twinrun.files import MAX_INT_DIGITS, open_regular

TENSOR_SHA256 = "tensor_sha256"  # metadata key: {parameter name: sha256 of its tensor's bytes}
HEX64 = re.compile(r"[0-9a-f]{64}")
MAX_HEADER_BYTES = 64 * 1024 * 1024
MAX_STORE_BYTES = 1 << 44  # 16 TiB: streamed, never held whole; the header must describe the size exactly
# A store is written whole from memory, so its blocks are all allocated: a file with fewer is sparse (a
# 64 GiB hole reads as 64 GiB of zeros, hashed before any digest can fail) and is refused. The margin
# leaves room for file systems that compress (a compressed store of floats shrinks far less than this).
SPARSE_RATIO = 16
SPARSE_MIN_BYTES = 64 * 2**20  # below this, reading a hole costs nothing worth refusing


def encode_meta(value) -> str:
    """A metadata value as the string safetensors keeps: a string as itself when it reads back as itself,
    anything else as JSON. A digest such as '9120e71234567890' is also a JSON number (it read back as
    9.12e+74, or inf), and 'true' or '123' are JSON too: those strings are stored JSON-quoted."""
    if isinstance(value, str) and decode_meta(value) == value:
        return value
    return json.dumps(value)


def decode_meta(value: str):
    """A metadata value as the JSON it encodes, or the string itself (a value that is not JSON, or one too
    deep or with too long an integer, is then refused by its field's type)."""
    try:
        return json.loads(value, parse_int=_short_int)
    except (ValueError, RecursionError):
        return value


def _short_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(text[:20])
    return int(text)


def refuse_sparse(path: Path, st) -> None:
    allocated = st.st_blocks * 512
    if st.st_size > SPARSE_MIN_BYTES and allocated * SPARSE_RATIO < st.st_size:
        raise StoreError(path, f"a sparse file ({allocated} of its {st.st_size} bytes allocated): twinrun "
                         "writes every byte of a store, so this one is damaged or planted; refused unread")


def raw_header(path: Path, data: bytes) -> dict:
    """The safetensors header of a store's bytes, as JSON (a StoreError if it is not one)."""
    if len(data) < 8:
        raise StoreError(path, f"truncated ({len(data)} bytes): not a safetensors store")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise StoreError(path, "truncated or corrupt safetensors header")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise StoreError(path, "corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise StoreError(path, "corrupt safetensors header")
    return header


def store_format(path: Path) -> str | None:
    """The format a store's metadata names (read from its header only), None if it names none."""
    fd, size = open_regular(Path(path), MAX_STORE_BYTES, "store")
    try:
        refuse_sparse(Path(path), os.fstat(fd))  # before any byte is read
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0)) if size >= 8 else (0,)
        head = os.pread(fd, 8 + n, 0) if 8 + n <= min(size, MAX_HEADER_BYTES) else b""
    finally:
        os.close(fd)
    try:
        meta = raw_header(Path(path), head).get("__metadata__")
    except StoreError:
        return None
    return meta.get("format") if isinstance(meta, dict) else None


class HeldFile:
    """A file held open by its descriptor `fd` for reading (a store, a checkpoint): a context manager,
    closed once, and reads of exactly the bytes asked for (a file that shrinks under the reader is an
    error, never a short read)."""

    path: Path
    fd: int | None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None

    def _pread(self, n: int, offset: int) -> bytes:
        try:
            data = os.pread(self.fd, n, offset)
        except OSError as err:
            raise StoreError(self.path, f"cannot read ({err.strerror})") from None
        if len(data) != n:
            raise StoreError(self.path, "changed size while being read")
        return data


def bytes_of(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, without a copy (any dtype: viewed as bytes)."""
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
