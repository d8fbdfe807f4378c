"""Plain file I/O, the floor under everything that writes or reads a run directory.

Writes go to a temporary file in the same directory, fsynced and renamed into place, so a file is
either whole or absent. Reads open only regular files of plausible size (never a FIFO, a device or
a 1 TiB file planted in a run directory) and decode JSON and YAML without any schema: what a
document must hold is its owner's business (twinrun.storage).
"""

import hashlib
import json
import os
import re
import stat
from pathlib import Path

import yaml

from twinrun.errors import StoreError

MAX_JSON_BYTES = 256 * 1024 * 1024  # run.json of a 10⁵-bin run is a few MB
MAX_YAML_BYTES = 16 * 1024 * 1024  # a resolved arm config, Hydra's records
# Names of arm directories, store files and views: one path component, no traversal, nothing a shell expands.
SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def safe_name(value, what: str, where) -> str:
    """`value` as a single safe path component, else a StoreError naming `where` and `what`."""
    if not isinstance(value, str) or not SAFE_NAME.fullmatch(value) or ".." in value or value == ".":
        raise StoreError(where, f"{what}={value!r} is not a safe name (letters, digits, '_', '.', '-'; "
                         "no '..'): refusing a path that could leave the run directory")
    return value


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
    """A JSON object from a regular file of plausible size (no schema: see twinrun.storage)."""
    path = Path(path)
    data = read_regular(path, MAX_JSON_BYTES, "JSON file")
    try:
        obj = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StoreError(path, f"not readable JSON ({err})") from None
    if not isinstance(obj, dict):
        raise StoreError(path, "not a JSON object")
    return obj


def read_yaml(path: Path, what: str):
    """A YAML document (safe_load: plain data only) from a regular file of plausible size."""
    try:
        return yaml.safe_load(read_regular(Path(path), MAX_YAML_BYTES, what).decode())
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        raise StoreError(path, f"unreadable {what} ({str(err).splitlines()[0]})") from None


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


def memory_bytes() -> int:
    """This machine's physical memory (what no single read may exceed)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 40
