"""Stores: one safetensors file per (arm, bin), and run.json, the run's index.

Everything the reducer reads is written to a temporary file in the same directory, fsynced and
renamed into place, so a store is either whole or absent. run.json records each store's sha256;
reading a store checks it, and nothing read from a run directory is unpickled or executed.
"""

import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from twinrun.errors import StoreError

STORE_FORMAT = "twinrun-store/1"
RUN_FORMAT = "twinrun-run/1"
MAX_HEADER_BYTES = 64 * 1024 * 1024


def atomic_write(path: Path, data: bytes) -> str:
    """Write bytes via temp file + fsync + rename (+ fsync of the directory); return their sha256."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power loss
        finally:
            os.close(dir_fd)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise StoreError(path, f"cannot write ({err.strerror or err}); finished stores are kept") from None
    return hashlib.sha256(data).hexdigest()


def write_json(path: Path, obj) -> str:
    return atomic_write(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def read_json(path: Path) -> dict:
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreError(path, "not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StoreError(path, f"not readable JSON ({err})") from None
    if not isinstance(obj, dict):
        raise StoreError(path, "not a JSON object")
    return obj


def require_run_dir(path: Path) -> Path:
    """A run directory given on a command line: it must hold run.json."""
    path = Path(path)
    if not (path / "run.json").is_file():
        raise StoreError(path, "not a twinrun run directory (no run.json)")
    return path


def store_name(bin_index: int, sigma: float) -> str:
    return f"bin{bin_index:02d}_sigma{sigma:g}.safetensors"


def write_store(path: Path, sums: torch.Tensor, meta: dict) -> str:
    """Write `sums` [n_folds, n_params] float32 with string metadata; return the file's sha256."""
    assert sums.dtype == torch.float32 and sums.dim() == 2, (sums.dtype, sums.shape)
    sums = sums.contiguous().cpu()
    # The payload's own digest travels inside the store, so a store handed around without its
    # run.json still proves its numbers intact (a flipped byte is caught by compare too).
    strings = {"format": STORE_FORMAT, "sums_sha256": hashlib.sha256(sums.numpy().tobytes()).hexdigest()}
    strings.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()})
    data = safetensors.torch.save({"sums": sums}, metadata=strings)
    return atomic_write(path, data)


@dataclass
class Store:
    path: Path
    sums: torch.Tensor  # [n_folds, n_params] float32
    meta: dict  # decoded metadata (JSON values decoded)
    sha256: str


def _header(path: Path, data: bytes) -> dict:
    if len(data) < 8:
        raise StoreError(path, f"truncated ({len(data)} bytes): not a safetensors store")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise StoreError(path, "truncated or corrupt safetensors header")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise StoreError(path, "corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise StoreError(path, "corrupt safetensors header")
    return header


def _decode(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def read_store(path: Path, sha256: str | None = None) -> Store:
    """Read and check one store; any problem is a StoreError naming the path.

    The file is read once into one buffer, hashed there, and `sums` is a view of that buffer
    (safetensors' own loader copies a store three times; at P = 10⁶ loading dominated reducing).
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            n_read = f.readinto(data)
    except FileNotFoundError:
        raise StoreError(path, "missing store (the bin was not measured, or the file was removed)") from None
    except OSError as err:
        raise StoreError(path, f"cannot read ({err.strerror})") from None
    if n_read != len(data):
        raise StoreError(path, "changed size while being read")
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256:
        raise StoreError(path, "sha256 does not match run.json: the store was altered or damaged")
    try:
        sums, meta = _parse(path, data)
    except StoreError:
        raise
    except Exception as err:  # noqa: BLE001 — a hostile or damaged file must end as a named error, never a traceback
        raise StoreError(path, f"malformed store ({type(err).__name__})") from None
    return Store(path, sums, meta, digest)


def _parse(path: Path, data: bytearray) -> tuple[torch.Tensor, dict]:
    header = _header(path, data)
    raw_meta = header.get("__metadata__") or {}
    if not isinstance(raw_meta, dict) or raw_meta.get("format") != STORE_FORMAT:
        fmt = raw_meta.get("format") if isinstance(raw_meta, dict) else None
        raise StoreError(path, f"not a twinrun store (format {fmt!r}, expected {STORE_FORMAT})")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    info = tensors.get("sums")
    if set(tensors) != {"sums"} or not isinstance(info, dict) or info.get("dtype") != "F32" \
            or len(info.get("shape", [])) != 2:
        raise StoreError(path, f"must hold exactly one tensor 'sums', float32 [n_folds, n_params]; found {tensors}")
    (n_folds, n_params), (begin, end) = info["shape"], info["data_offsets"]
    start = 8 + struct.unpack("<Q", bytes(data[:8]))[0]
    if not (isinstance(n_folds, int) and isinstance(n_params, int) and n_folds >= 0 and n_params >= 0
            and begin == 0 and end == 4 * n_folds * n_params and start + end == len(data)):
        raise StoreError(path, "damaged safetensors payload (offsets do not match the shape or the file size)")
    # safetensors stores little-endian; this view is exact on the little-endian machines torch targets.
    assert sys.byteorder == "little", "twinrun reads stores on little-endian machines only"
    sums = torch.frombuffer(data, dtype=torch.float32, offset=start, count=n_folds * n_params)
    sums = sums.view(n_folds, n_params)
    payload = memoryview(data)[start : start + end]
    if raw_meta.get("sums_sha256") != hashlib.sha256(payload).hexdigest():
        raise StoreError(path, "the numbers do not match the store's own sums_sha256: damaged or altered")
    meta = {k: _decode(v) for k, v in raw_meta.items() if isinstance(v, str)}
    _check_meta(path, sums, meta)
    return sums, meta


def _check_meta(path: Path, sums: torch.Tensor, meta: dict) -> None:
    required = ("arm", "bin_index", "sigma", "sigma_cond", "n_images", "n_draws", "fold_sizes",
                "draws_digest", "config_hash", "layout")
    missing = [k for k in required if k not in meta]
    if missing:
        raise StoreError(path, f"metadata lacks {', '.join(missing)}")
    try:
        n_params = sum(int(g["numel"]) for g in meta["layout"])
        n_folds = len(meta["fold_sizes"])
    except (TypeError, KeyError, ValueError):
        raise StoreError(path, "metadata 'layout' or 'fold_sizes' is malformed") from None
    if tuple(sums.shape) != (n_folds, n_params):
        raise StoreError(path, f"'sums' has shape {list(sums.shape)}, metadata says [{n_folds}, {n_params}]")
