"""Stores: one safetensors file per (arm, bin), and run.json, the run's index.

Everything the reducer reads is written to a temporary file in the same directory, fsynced and
renamed into place, so a store is either whole or absent. run.json records each store's sha256;
reading a store checks it, and nothing read from a run directory is unpickled or executed.
"""

import hashlib
import json
import os
import stat
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from twinrun.errors import StoreError

STORE_FORMAT = "twinrun-store/1"
MAX_HEADER_BYTES = 64 * 1024 * 1024
MAX_JSON_BYTES = 256 * 1024 * 1024  # run.json of a 10⁵-bin run is a few MB


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
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only file system: there is no temporary file to remove either
        raise StoreError(path, f"cannot write ({err.strerror or err}); finished stores are kept") from None
    return hashlib.sha256(data).hexdigest()


def write_json(path: Path, obj) -> str:
    return atomic_write(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def read_json(path: Path) -> dict:
    """A JSON object from a regular file of plausible size; run.json and summary.json are also
    validated against their schema (twinrun.rundir), so every reader inherits the checks."""
    path = Path(path)
    data = read_regular(path, MAX_JSON_BYTES, "JSON file")
    try:
        obj = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StoreError(path, f"not readable JSON ({err})") from None
    if not isinstance(obj, dict):
        raise StoreError(path, "not a JSON object")
    from twinrun.rundir import SCHEMAS  # rundir reads and writes through this module

    validate = SCHEMAS.get(path.name)
    return validate(path, obj) if validate is not None else obj


def open_regular(path: Path, max_bytes: int, what: str) -> tuple[int, int]:
    """(descriptor, size) of a regular file no larger than max_bytes; anything else is a StoreError.

    O_NONBLOCK: opening a FIFO planted in place of a file must not wait for a writer forever.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StoreError(path, "not found") from None
    except OSError as err:
        raise StoreError(path, f"cannot read ({err.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise StoreError(path, f"not a regular file (a {_kind(st.st_mode)}): refusing to read it as a {what}")
    if st.st_size > max_bytes:
        os.close(fd)
        raise StoreError(path, f"implausibly large for a {what} ({st.st_size} bytes > {max_bytes}): refused "
                         "before reading")
    return fd, st.st_size


def read_regular(path: Path, max_bytes: int, what: str) -> bytes:
    """The whole content of a regular file of plausible size (see open_regular)."""
    fd, size = open_regular(path, max_bytes, what)
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read(size + 1)
    except OSError as err:
        raise StoreError(path, f"cannot read ({err.strerror})") from None


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
             (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))
    return next((name for test, name in kinds if test(mode)), "special file")


def max_store_bytes() -> int:
    """No store may be larger than this machine's memory: reading it would allocate it whole."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 40


def require_run_dir(path: Path) -> Path:
    """A run directory given on a command line: it must hold run.json."""
    from twinrun.rundir import RunDir

    return RunDir(path).require().path


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

    The header is read first and the file's size checked against it (and against this machine's
    memory) before the payload is allocated, so a planted FIFO or a 1 TiB sparse file is refused
    at once. The file is then read once into one buffer, hashed there, and `sums` is a view of that
    buffer (safetensors' own loader copies a store three times; at P = 10⁶ loading dominated reducing).
    """
    path = Path(path)
    fd, size = open_regular(path, max_store_bytes(), "store")
    try:
        with os.fdopen(fd, "rb") as f:
            _check_size(path, f, size)
            data = bytearray(size)
            n_read = f.readinto(data)
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


def _check_size(path: Path, f, size: int) -> None:
    """The size the header promises (header + one float32 [n_folds, n_params] tensor) is the file's."""
    head = f.read(min(size, 8 + MAX_HEADER_BYTES))
    header = _header(path, head)
    info = header.get("sums")
    shape = info.get("shape") if isinstance(info, dict) else None
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(n) is int and n >= 0 for n in shape)):
        raise StoreError(path, "not a twinrun store (no float32 [n_folds, n_params] tensor 'sums' in its header)")
    expected = 8 + struct.unpack("<Q", head[:8])[0] + 4 * shape[0] * shape[1]
    if expected != size:
        raise StoreError(path, f"{size} bytes, but its header describes {expected}: truncated or padded")
    f.seek(0)


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
    """The metadata every reader relies on, field by field, and numbers that are numbers."""
    from twinrun.rundir import validate_store_meta

    validate_store_meta(path, meta)
    n_params = sum(g["numel"] for g in meta["layout"])
    if tuple(sums.shape) != (len(meta["fold_sizes"]), n_params):
        raise StoreError(path, f"'sums' has shape {list(sums.shape)}, metadata says "
                         f"[{len(meta['fold_sizes'])}, {n_params}]")
    if not bool(torch.isfinite(sums).all()):
        raise StoreError(path, "'sums' holds NaN or inf (twinrun never writes such a store): damaged or forged")


MAX_CONFIG_BYTES = 16 * 1024 * 1024


def read_config(path: Path) -> dict:
    """A resolved arm config (config.yaml) from a regular file of plausible size: one StoreError line
    naming the file if it is not one, never a hang on a FIFO."""
    import yaml

    try:
        config = yaml.safe_load(read_regular(Path(path), MAX_CONFIG_BYTES, "config").decode())
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        raise StoreError(path, f"unreadable arm config ({str(err).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise StoreError(path, "not a resolved twinrun config")
    return config
