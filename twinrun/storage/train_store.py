"""Training stores: one arm's weights, optimizer state and losses at the end of one training unit, written
straight from the tensors' memory and read back whole, every tensor checked against its own sha256.
"""

import hashlib
import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from twinrun.errors import StoreError, TwinrunError
from twinrun.files import memory_bytes, open_regular, write_all, write_through_temp
from twinrun.storage.header import (
    HEX64,
    MAX_STORE_BYTES,
    TENSOR_SHA256,
    bytes_of,
    decode_meta,
    encode_meta,
    raw_header,
)
from twinrun.storage.store_meta import validate_train_store_meta

TRAIN_STORE_FORMAT = "twinrun-train-store/1"

# Tensor dtypes a training store may hold (weights and optimizer state of any torch optimizer).
TRAIN_DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32}
_DTYPE_BYTES = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I64": 8, "I32": 4}


@dataclass
class TrainStore:
    """A training store read whole and checked: every tensor by name, its metadata, the file's sha256."""

    path: Path
    tensors: dict[str, torch.Tensor]
    meta: dict  # decoded metadata, without the format and digest fields
    digests: dict[str, str]  # each tensor's sha256 (a cheap bit-identity test between two stores)
    sha256: str


def safetensors_header(tensors: dict[str, torch.Tensor], strings: dict[str, str]) -> bytes:
    """The safetensors file's head for `tensors` laid out in order: the 8-byte little-endian length and
    the JSON header (dtypes, shapes, offsets, metadata), padded with spaces to 8 bytes as safetensors does."""
    names = {dtype: name for name, dtype in TRAIN_DTYPES.items()}
    entries, offset = {"__metadata__": strings}, 0
    for name, t in tensors.items():
        if t.dtype not in names:
            raise TwinrunError(f"tensor {name!r} of a training store is {t.dtype}: a training store holds "
                               f"{', '.join(map(str, names))} only")
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + n]}
        offset += n
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def write_train_store(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> str:
    """A training store written straight from the tensors' memory (no copy of the state is ever held, so
    a job holds no second model while it stores one) into a temporary file created exclusively under a
    random name beside it (as atomic_write's: no planted link is followed, a leftover is found and
    removed, the file has the umask's mode), fsynced and renamed into place; the file's sha256."""
    tensors = {name: t.detach().contiguous() for name, t in tensors.items()}
    digests = {name: hashlib.sha256(bytes_of(t)).hexdigest() for name, t in tensors.items()}
    strings = {"format": TRAIN_STORE_FORMAT, TENSOR_SHA256: json.dumps(digests)}
    strings.update({k: encode_meta(v) for k, v in meta.items()})
    digest = hashlib.sha256()

    def fill(fd: int) -> None:
        for part in (safetensors_header(tensors, strings), *(bytes_of(t) for t in tensors.values())):
            digest.update(part)
            write_all(fd, part)

    write_through_temp(path, fill)
    return digest.hexdigest()


def read_train_store(path: Path, sha256: str | None = None) -> TrainStore:
    """A training store read whole, after its checks: the file's size against memory and its sha256
    against run.json's, the header (format, metadata fields, dtypes, offsets that tile the payload),
    every tensor against its own sha256, and no NaN or inf. Never unpickled, never mapped."""
    path = Path(path)
    fd, size = open_regular(path, min(MAX_STORE_BYTES, memory_bytes()), "store")
    data = bytearray(size)  # the tensors are views into it: the store is held once
    try:
        if os.preadv(fd, [data], 0) != size:
            raise StoreError(path, "changed size while being read")
    except OSError as err:
        raise StoreError(path, f"cannot read ({err.strerror})") from None
    finally:
        os.close(fd)
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256:
        raise StoreError(path, "sha256 does not match run.json: the store was altered or damaged")
    header = raw_header(path, data)
    raw = header.pop("__metadata__", None)
    fmt = raw.get("format") if isinstance(raw, dict) else None
    if fmt != TRAIN_STORE_FORMAT:
        raise StoreError(path, f"not a twinrun training store (format {fmt!r}, expected "
                         f"{TRAIN_STORE_FORMAT})")
    try:
        shapes = _check_train_tensors(path, header, 8 + struct.unpack("<Q", data[:8])[0], len(data))
        digests = json.loads(raw.get(TENSOR_SHA256, "null"))
        meta = {k: decode_meta(v) for k, v in raw.items()
                if isinstance(v, str) and k not in ("format", TENSOR_SHA256)}
    except StoreError:
        raise
    except Exception as err:  # noqa: BLE001 — a hostile or damaged header ends as a named error
        raise StoreError(path, f"malformed store header ({type(err).__name__})") from None
    if not (isinstance(digests, dict) and set(digests) == set(shapes)
            and all(isinstance(d, str) and HEX64.fullmatch(d) for d in digests.values())):
        raise StoreError(path, f"metadata field {TENSOR_SHA256} is not one sha256 digest per tensor: damaged")
    meta = validate_train_store_meta(path, meta, shapes)
    _check_last_step(path, meta, digests)
    tensors = _tensors_of(data, header, 8 + struct.unpack("<Q", data[:8])[0])
    for name, t in tensors.items():
        if hashlib.sha256(bytes_of(t)).hexdigest() != digests[name]:
            raise StoreError(path, f"tensor {name!r} does not match its sha256 in the store's metadata: "
                             "damaged or altered")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise StoreError(path, f"tensor {name!r} holds NaN or inf (twinrun never writes such a store): "
                             "damaged or forged")
    return TrainStore(path, tensors, meta, digests, digest)


def _check_last_step(path: Path, meta: dict, digests: dict[str, str]) -> None:
    """The digests of the unit's last step name the weights the store holds (each a prefix of its
    tensor's sha256): the gate and the first differing step are read from the step digests, so a store
    whose weights were rewritten with fresh tensor and file digests, or whose step digests were edited,
    is refused here instead of read as a verdict."""
    if not meta["step_digests"]:
        return  # the start unit: no step
    for w, short in zip(meta["layout"], meta["step_digests"][-1], strict=True):
        full = digests[f"weight/{w['name']}"]
        if not (16 <= len(short) <= len(full) and full.startswith(short)):
            raise StoreError(path, f"metadata field step_digests: the last step's digest of weight "
                             f"{w['name']!r} ({short[:16]}) is not the stored weight's ({full[:16]}): "
                             "damaged or forged")


def _tensors_of(data: bytearray, header: dict, start: int) -> dict[str, torch.Tensor]:
    """The tensors a checked header describes, as views into the store's bytes (little-endian, as
    safetensors writes them and as StoreReader reads them)."""
    assert sys.byteorder == "little", "twinrun reads stores on little-endian machines only"
    out = {}
    for name, info in header.items():
        dtype, shape = TRAIN_DTYPES[info["dtype"]], info["shape"]
        begin, end = info["data_offsets"]
        out[name] = (torch.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=start + begin)
                     .view(shape) if end > begin else torch.empty(shape, dtype=dtype))
    return out


def _check_train_tensors(path: Path, header: dict, start: int, size: int) -> dict[str, list[int]]:
    """{name: shape} of a training store's tensors, once their dtypes and offsets tile the payload exactly."""
    spans, shapes = [], {}
    for name, info in header.items():
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in TRAIN_DTYPES or not all(type(n) is int and n >= 0 for n in shape):
            raise StoreError(path, f"tensor {name!r}: dtype {dtype!r} or shape {shape!r} is not a training "
                             "store's")
        if not (type(begin) is int and type(end) is int
                and end - begin == _DTYPE_BYTES[dtype] * math.prod(shape)):
            raise StoreError(path, f"tensor {name!r}: offsets do not match its shape")
        spans.append((begin, end))
        shapes[name] = list(shape)
    expected = 0
    for begin, end in sorted(spans):
        if begin != expected:
            raise StoreError(path, "tensor offsets overlap or leave gaps: damaged")
        expected = end
    if start + expected != size:
        raise StoreError(path, f"{size} bytes, but its header describes {start + expected}: "
                         "truncated or padded")
    return shapes
