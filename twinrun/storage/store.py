"""Stores: one safetensors file per (arm, unit), written atomically, each tensor with its own sha256.

A probe store holds one float32 [numel, n_folds] tensor per probed parameter (parameter-major: a
parameter's column range is one contiguous byte range, so the reducer streams every store front
to back, reading and hashing each byte once). run.json records each store's sha256; reading a
store checks it, and nothing read from a run directory is unpickled or executed.
"""

import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import safetensors.torch
import torch

from twinrun.errors import StoreError
from twinrun.files import atomic_write, check_shape, loads, memory_bytes, open_regular
from twinrun.storage.header import (
    HEX64,
    MAX_HEADER_BYTES,
    MAX_STORE_BYTES,
    TENSOR_SHA256,
    HeldFile,
    decode_meta,
    encode_meta,
    refuse_sparse,
)
from twinrun.storage.store_meta import validate_store_meta

STORE_FORMAT = "twinrun-store/2"  # one float32 [numel, n_folds] tensor per probed parameter
OLD_STORE_FORMAT = "twinrun-store/1"  # one [n_folds, n_params] matrix `sums`: refused, never migrated


def write_store(path: Path, tensors: dict[str, torch.Tensor], meta: dict, fmt: str = STORE_FORMAT) -> str:
    """Write named float32 CPU tensors with their metadata (JSON-encoded strings); return the file's
    sha256. `fmt`: the format the store names (another kind writes its own: Measure.write_store)."""
    # Each tensor's own digest travels inside the store, so a store handed around without its
    # run.json still proves its numbers intact (a flipped byte is caught by compare too).
    digests = {name: hashlib.sha256(t.numpy().tobytes()).hexdigest() for name, t in tensors.items()}
    strings = {"format": fmt, TENSOR_SHA256: json.dumps(digests)}
    strings.update({k: encode_meta(v) for k, v in meta.items()})
    return atomic_write(path, safetensors.torch.save(tensors, metadata=strings))


# The probe's pairing receipt: up to 5 blocks of [n_tensors, F, F] float64 per store, base64 in its header.
PAIRING_BLOCKS = 5


def header_size(n_folds: int, n_tensors: int, n_images: int, pairing: bool = True) -> int:
    """A store's header estimated, in bytes: the layout and a digest per tensor, the image ids, the
    environment record and (pairing) the receipt's blocks, base64 (4 bytes per 3)."""
    blocks = PAIRING_BLOCKS * n_tensors * n_folds**2 * 8 * 4 // 3 if pairing else 0
    return 16 * 1024 + 400 * n_tensors + 8 * n_images + blocks


def store_size(n_folds: int, n_params: int, n_tensors: int, n_images: int, pairing: bool = True) -> int:
    """A store's size on disk, for planning: the payload exactly, the header estimated."""
    return 4 * n_folds * n_params + header_size(n_folds, n_tensors, n_images, pairing)


@dataclass
class Store:
    """A store read whole (small tools and tests); the reducer streams through StoreReader instead."""

    path: Path
    sums: torch.Tensor  # [n_folds, n_params] float32, columns in layout order
    meta: dict  # decoded metadata (JSON values decoded), without the format and digest fields
    sha256: str


@dataclass(frozen=True)
class Tensor:
    """One parameter's tensor in a store: its name, where its payload starts (absolute) and its numel."""

    name: str
    start: int
    numel: int


class StoreReader(HeldFile):
    """One store opened for streaming: its header parsed and checked against the file's size before
    any payload is read; the payload then read front to back, column chunk by column chunk.

    Every chunk is hashed as it is read (its tensor's sha256 from the metadata, the whole file's from
    run.json) and refused if it holds NaN or inf; `finish()` proves every byte was read and the file
    digest matches. Nothing is mapped or unpickled. Use as a context manager (it holds a descriptor).
    """

    def __init__(self, path: Path, sha256: str | None = None, payload_bytes: int | None = None):
        """payload_bytes: what the run's protocol says its tensors hold (run.json's store entry); the
        header must describe exactly that, before any payload byte is read. None (a store handed over on
        its own): the header decides, and only a file really that large is read."""
        self.path, self.expected_sha256, self.payload_bytes = Path(path), sha256, payload_bytes
        self.fd, size = open_regular(self.path, MAX_STORE_BYTES, "store")
        try:
            refuse_sparse(self.path, os.fstat(self.fd))
            head = self._parse_header(size)
        except BaseException:
            self.close()
            raise
        self._file_hash = hashlib.sha256(head)
        self._tensor_hash, self._pos, self._current = None, len(head), 0

    def __enter__(self) -> Self:
        return self

    def __del__(self) -> None:
        self.close()

    # ---- the header

    def _parse_header(self, size: int) -> bytes:
        if size < 8:
            raise StoreError(self.path, f"truncated ({size} bytes): not a safetensors store")
        (n,) = struct.unpack("<Q", self._pread(8, 0))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise StoreError(self.path, "truncated or corrupt safetensors header")
        head = self._pread(8 + n, 0)
        header = loads(head[8:], f"{self.path} (its safetensors header)")
        if not isinstance(header, dict):
            raise StoreError(self.path, "corrupt safetensors header")
        try:
            self._read_metadata(header.pop("__metadata__", None))
            self._read_tensors(header, 8 + n, size)
        except StoreError:
            raise
        except Exception as err:  # noqa: BLE001 — a hostile or damaged header ends as a named error, never a traceback
            raise StoreError(self.path, f"malformed store header ({type(err).__name__})") from None
        return head

    def _read_metadata(self, raw) -> None:
        fmt = raw.get("format") if isinstance(raw, dict) else None
        if fmt == OLD_STORE_FORMAT:
            raise StoreError(self.path, f"format {OLD_STORE_FORMAT} (one [n_folds, n_params] matrix) is no "
                             "longer read; measure the run again into a new run directory "
                             f"(stores are now {STORE_FORMAT})")
        if fmt != STORE_FORMAT:
            raise StoreError(self.path, f"not a twinrun store (format {fmt!r}, expected {STORE_FORMAT})")
        given = raw.get(TENSOR_SHA256)
        digests = decode_meta(given) if isinstance(given, str) else None
        if not (isinstance(digests, dict)
                and all(isinstance(d, str) and HEX64.fullmatch(d) for d in digests.values())):
            raise StoreError(self.path, f"metadata field {TENSOR_SHA256} is not a map of sha256 "
                             "digests: damaged")
        self.digests = digests
        decoded = {k: decode_meta(v) for k, v in raw.items()
                   if isinstance(v, str) and k not in ("format", TENSOR_SHA256)}
        check_shape(decoded, self.path, "store metadata")
        self.meta = validate_store_meta(self.path, decoded)
        self.layout, self.n_folds = self.meta["layout"], len(self.meta["fold_sizes"])

    def _read_tensors(self, header: dict, start: int, size: int) -> None:
        """One float32 [numel, n_folds] tensor per layout entry, tiling the payload exactly to the file's
        end."""
        numel = {g["name"]: g["numel"] for g in self.layout}
        if set(header) != set(numel) or set(self.digests) != set(numel):
            raise StoreError(self.path, f"its tensors {sorted(header)[:4]} are not its layout's parameters "
                             f"{sorted(numel)[:4]} (or lack a digest): damaged or forged")
        entries = []
        for name, info in header.items():
            if not (isinstance(info, dict) and info.get("dtype") == "F32"
                    and info.get("shape") == [numel[name], self.n_folds]):
                raise StoreError(self.path, f"tensor {name!r} is not float32 [{numel[name]}, {self.n_folds}] "
                                 "(numel, folds) as its layout says")
            begin, end = info["data_offsets"]
            if not (type(begin) is int and type(end) is int
                    and end - begin == 4 * numel[name] * self.n_folds):
                raise StoreError(self.path, f"tensor {name!r}: offsets do not match its shape")
            entries.append(Tensor(name, start + begin, numel[name]))
        described = sum(4 * e.numel * self.n_folds for e in entries)
        if self.payload_bytes is not None and described != self.payload_bytes:
            raise StoreError(self.path, f"its header describes {described} bytes of tensors, but the run's "
                             f"protocol (run.json: layout x folds) gives {self.payload_bytes}: a store of "
                             "another run, damaged or forged")
        entries.sort(key=lambda e: e.start)
        expected = start
        for e in entries:
            if e.start != expected:
                raise StoreError(self.path, "tensor offsets overlap or leave gaps: damaged")
            expected += 4 * e.numel * self.n_folds
        if expected != size:
            raise StoreError(self.path, f"{size} bytes, but its header describes {expected}: "
                             "truncated or padded")
        self.tensors = entries  # in file order: the order a streaming reader reads them in

    # ---- the payload, front to back

    def columns(self, tensor: Tensor, lo: int, hi: int) -> torch.Tensor:
        """Columns [lo, hi) of one parameter as float32 [n_folds, hi − lo]; calls must walk the file in
        order (tensors in self.tensors' order, each from column 0 to its end without gaps)."""
        offset = tensor.start + 4 * lo * self.n_folds
        expected = self.tensors[self._current] if self._current < len(self.tensors) else None
        if offset != self._pos or tensor != expected or not 0 <= lo <= hi <= tensor.numel:
            raise AssertionError(f"{self.path}: read out of order (twinrun reads stores front to back)")
        if lo == 0:
            self._tensor_hash = hashlib.sha256()
        data = self._pread(4 * (hi - lo) * self.n_folds, offset)
        self._file_hash.update(data)
        self._tensor_hash.update(data)
        self._pos += len(data)
        if hi == tensor.numel:
            if self._tensor_hash.hexdigest() != self.digests[tensor.name]:
                raise StoreError(self.path, f"tensor {tensor.name!r} does not match its sha256 in the "
                                 "store's metadata: damaged or altered")
            self._current += 1
        # safetensors stores little-endian; this view is exact on the little-endian machines torch targets.
        assert sys.byteorder == "little", "twinrun reads stores on little-endian machines only"
        chunk = torch.frombuffer(bytearray(data), dtype=torch.float32).view(hi - lo, self.n_folds).T
        if not bool(torch.isfinite(chunk).all()):
            raise StoreError(self.path, f"tensor {tensor.name!r} holds NaN or inf (twinrun never writes "
                             "such a store): damaged or forged")
        return chunk

    def finish(self) -> str:
        """After the last chunk: every byte was read, and the file matches run.json's sha256. Returns it."""
        if self._current != len(self.tensors):
            raise AssertionError(f"{self.path}: finish() before every tensor was read")
        digest = self._file_hash.hexdigest()
        if self.expected_sha256 is not None and digest != self.expected_sha256:
            raise StoreError(self.path, "sha256 does not match run.json: the store was altered or damaged")
        return digest

    def walk(self, chunk_params: int):
        """(tensor, lo, hi) over the whole payload in file order, at most chunk_params columns at a time."""
        for t in self.tensors:
            for lo in range(0, max(t.numel, 1), max(1, chunk_params)):  # an empty tensor is one empty read
                yield t, lo, min(lo + chunk_params, t.numel)


def verify_store(path: Path, sha256: str | None = None, chunk_bytes: int = 16 * 2**20,
                 payload_bytes: int | None = None) -> dict:
    """Read a store once, front to back, checking everything (no payload kept); return its metadata.
    (Another kind's stores are checked by its own reader: Measure.verify_store.)"""
    with StoreReader(path, sha256, payload_bytes) as reader:
        for t, lo, hi in reader.walk(max(1, chunk_bytes // (4 * max(1, reader.n_folds)))):
            reader.columns(t, lo, hi)
        reader.finish()
        return reader.meta


def read_store(path: Path, sha256: str | None = None) -> Store:
    """Read and check one whole store: its sums as one [n_folds, n_params] matrix in layout order.

    For small tools and tests; the reducer streams (StoreReader) and never holds a store whole.
    """
    with StoreReader(path, sha256) as reader:
        offsets = {g["name"]: g["offset"] for g in reader.layout}
        n_params = sum(g["numel"] for g in reader.layout)
        if 4 * reader.n_folds * n_params > memory_bytes():
            raise StoreError(path, f"{4 * reader.n_folds * n_params} bytes of sums do not fit in this "
                             "machine's memory: read it with the streaming reducer")
        sums = torch.empty(reader.n_folds, n_params, dtype=torch.float32)
        for t in reader.tensors:
            sums[:, offsets[t.name] : offsets[t.name] + t.numel] = reader.columns(t, 0, t.numel)
        return Store(Path(path), sums, reader.meta, reader.finish())


