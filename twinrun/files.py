"""Plain file I/O, the floor under everything that writes or reads a run directory.

Writes go to a temporary file in the same directory, created exclusively (never an existing name,
never through a link), fsynced and renamed into place, so a file is either whole or absent and a
link planted at any name is replaced, never written through. Reads open only regular files of
plausible size (never a FIFO, a device or a 1 TiB file planted in a run directory) and decode JSON
and YAML without any schema, bounded in depth, size and integer length: what a document must hold
is its owner's business (twinrun.storage).
"""

import hashlib
import json
import os
import re
import resource
import secrets
import stat
from pathlib import Path

import yaml

from twinrun.errors import StoreError

MAX_JSON_BYTES = 256 * 1024 * 1024  # run.json of a 10⁵-bin run is a few MB
MAX_YAML_BYTES = 16 * 1024 * 1024  # a resolved arm config, Hydra's records
# run.json nests 6 levels deep, a fingerprint 8, a resolved config ~6: anything far deeper is damage or an
# attack (Python's parsers and printers recurse: 100k levels is a RecursionError, not a message).
MAX_DEPTH = 64
# The longest integer twinrun writes (a 2^63 seed, a byte count) has 19 digits; Python refuses to parse
# more than 4,300 with a ValueError of its own.
MAX_INT_DIGITS = 64
# A YAML document may repeat one node through aliases (a "billion laughs"): its walk is capped instead.
MAX_YAML_NODES = 1_000_000
_INT_BOUND = 10**MAX_INT_DIGITS
TEMP_ATTEMPTS = 100  # fresh random names tried before giving up (each taken name is a leftover or a plant)
# Names of arm directories, store files and views: one path component, no traversal, nothing a shell expands.
SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def safe_name(value, what: str, where) -> str:
    """`value` as a single safe path component, else a StoreError naming `where` and `what`."""
    if not isinstance(value, str) or not SAFE_NAME.fullmatch(value) or ".." in value or value == ".":
        raise StoreError(where, f"{what}={value!r} is not a safe name (letters, digits, '_', '.', '-'; "
                         "no '..'): refusing a path that could leave the run directory")
    return value


def temp_name(path: Path) -> Path:
    """A temporary name beside `path` (`.NAME.tmp-PID-RANDOM`: RunDir.tmp_files finds leftovers by it).
    Random, so that nobody can plant a link at the name in advance, nor can two processes of the same pid
    on two hosts of a shared file system collide."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")


def create_temp(path: Path) -> tuple[int, Path]:
    """A new file beside `path`, created exclusively: O_EXCL fails on any existing name (a symlink, a hard
    link, a leftover), O_NOFOLLOW on a link, so no byte is ever written into a file outside the directory."""
    for _ in range(TEMP_ATTEMPTS):
        tmp = temp_name(path)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        return fd, tmp
    raise StoreError(path, f"no free temporary name after {TEMP_ATTEMPTS} tries (every one taken: files "
                     f"planted beside it?); remove the files named .{path.name}.tmp-* and run again")


def write_through_temp(path: Path, fill) -> None:
    """`fill(fd)` writes the file's bytes into an exclusive temporary file beside `path`; it is then
    fsynced and renamed into place (+ fsync of the directory). The rename replaces whatever entry `path`
    was (a symlink, a hard link), never its target. An OSError removes the temporary file."""
    path = Path(path)
    tmp = None
    try:
        fd, tmp = create_temp(path)
        try:
            fill(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power loss
        finally:
            os.close(dir_fd)
    except OSError as err:
        try:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only file system: there is no temporary file to remove either
        raise StoreError(path, f"cannot write ({err.strerror or err}); finished stores are kept") from None


def write_all(fd: int, data) -> None:
    """Every byte of `data` (bytes or a buffer) to `fd`: os.write may write fewer than it is given."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def atomic_write(path: Path, data: bytes) -> str:
    """Write bytes through an exclusive temporary file renamed into place (write_through_temp); return
    their sha256."""
    write_through_temp(path, lambda fd: write_all(fd, data))
    return hashlib.sha256(data).hexdigest()


def refuse_links(paths) -> None:
    """A StoreError for the first of `paths` that is a symlink or a file with another name elsewhere (a hard
    link): code that writes it in place (Hydra's records, a log opened for appending) would write through it
    into a file outside the directory. Absent paths pass."""
    for path in map(Path, paths):
        st = _lstat(path)
        if st is None:
            continue
        if stat.S_ISLNK(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink > 1):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else f"a hard link ({st.st_nlink} names)"
            raise StoreError(path, f"is {kind}: refusing to write through it into a file elsewhere; "
                             "remove it and run again")


def _lstat(path: Path) -> os.stat_result | None:
    """The entry at `path` itself (a link, not its target); None if there is none."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise StoreError(path, f"cannot be inspected ({err.strerror})") from None


def make_dir(path: Path) -> Path:
    """`path` and its parents as directories (those present are kept), or one StoreError saying why not (a
    read-only file system, a name too long, a file in the way)."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise StoreError(path, f"cannot create this directory ({err.strerror or err}); finished stores are "
                         "kept: make room or fix the permissions and run again") from None
    return Path(path)


def write_json(path: Path, obj) -> str:
    return atomic_write(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def read_json(path: Path) -> dict:
    """A JSON object from a regular file of plausible size (no schema: see twinrun.storage)."""
    path = Path(path)
    obj = loads(read_regular(path, MAX_JSON_BYTES, "JSON file"), path)
    if not isinstance(obj, dict):
        raise StoreError(path, "not a JSON object")
    return obj


def loads(data: bytes | str, where):
    """JSON read from a run directory (a file, a store header): at most MAX_DEPTH levels deep, no
    integer longer than MAX_INT_DIGITS digits; anything else is one StoreError naming `where`."""
    try:
        obj = json.loads(data.decode() if isinstance(data, bytes) else data, parse_int=_bounded_int)
    except RecursionError:
        raise StoreError(where, f"not readable JSON (nested deeper than {MAX_DEPTH} levels)") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, a too-long integer
        raise StoreError(where, f"not readable JSON ({str(err)[:200]})") from None
    check_shape(obj, where, "JSON")
    return obj


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits, more than the {MAX_INT_DIGITS} twinrun writes")
    return int(text)


def check_shape(obj, where, what: str, max_nodes: int | None = None) -> None:
    """Refuse a document nested deeper than MAX_DEPTH, holding an integer longer than MAX_INT_DIGITS, or
    (with max_nodes) of more nodes: YAML aliases can repeat a node exponentially often. A walk with a
    stack of its own: it never recurses."""
    stack, nodes = [(obj, 1)], 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if max_nodes is not None and nodes > max_nodes:
            raise StoreError(where, f"not a plausible {what} document (more than {max_nodes:,} nodes)")
        if isinstance(node, dict | list):
            if depth > MAX_DEPTH:
                raise StoreError(where, f"not a plausible {what} document (nested deeper than {MAX_DEPTH} "
                                 "levels)")
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
        elif isinstance(node, int) and abs(node) >= _INT_BOUND:
            raise StoreError(where, f"not a plausible {what} document (an integer of more than "
                             f"{MAX_INT_DIGITS} digits)")


def read_yaml(path: Path, what: str):
    """A YAML document (safe_load: plain data only) from a regular file of plausible size, bounded like
    JSON (depth, integers) and in nodes (aliases)."""
    try:
        doc = yaml.safe_load(read_regular(Path(path), MAX_YAML_BYTES, what).decode())
    except RecursionError:
        raise StoreError(path, f"unreadable {what} (nested deeper than {MAX_DEPTH} levels)") from None
    except (UnicodeDecodeError, yaml.YAMLError, ValueError) as err:  # ValueError: an integer of 5,000 digits
        raise StoreError(path, f"unreadable {what} ({(str(err).splitlines() or [''])[0][:200]})") from None
    check_shape(doc, path, what, MAX_YAML_NODES)
    return doc


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


def ensure_descriptors(more: int, what: str) -> None:
    """Room for `more` open descriptors beside those open now (the reducer holds one per store): the soft
    limit (`ulimit -n`, often 1,024) is raised as far as the hard limit allows, else one line, exit 2."""
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    need = in_use + more + 32  # the margin: imports, logs, the pool's threads
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise StoreError(what, f"needs {need} open files, more than this process may open (ulimit -n: hard "
                         f"limit {hard}); raise the hard limit (ulimit -Hn, limits.conf) and run again")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def memory_bytes() -> int:
    """This machine's physical memory (what no single read may exceed)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 40


# ----------------------------------------------------------------------------- outside a run directory


def refuse_unsafe_target(path: Path, what: str) -> None:
    """A name twinrun is about to write outside a run directory (a table at a user's path, a tracker's
    file): absent or a regular file of one link, else a StoreError (exit 2). A symlink would be written
    through (or replaced, losing where it pointed); a device node, FIFO or directory is never replaced
    (as root, `--csv /dev/null` would otherwise swap the machine's /dev/null for a regular file)."""
    path = Path(path)
    st = _lstat(path)
    if st is None:
        return
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(path, f"is a symlink: refusing to write a {what} through it; name a new file or a "
                         "regular one")
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(path, f"exists and is not a regular file (a {_kind(st.st_mode)}): refusing to "
                         f"replace it with a {what}; name a new file or a regular one")
    if st.st_nlink > 1:
        raise StoreError(path, f"is a hard link ({st.st_nlink} names): refusing to write a {what} over a "
                         "file shared with another name; name a new file")


def write_output(path: Path, data: bytes, what: str) -> Path:
    """A file at a user's path (a table): refused onto anything but a new name or a regular file of one
    link (refuse_unsafe_target), then written as atomic_write writes (exclusive temporary file, renamed)."""
    refuse_unsafe_target(path, what)
    atomic_write(Path(path), data)
    return Path(path)


def create_once(path: Path, data: bytes, what: str) -> None:
    """A small file twinrun creates once in a folder of its own outside a run directory (a compile
    cache's marker): created exclusively, never through a link; an existing regular file is kept, any
    other entry at the name is a StoreError."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        refuse_unsafe_target(path, what)
        return
    except OSError as err:
        raise StoreError(path, f"cannot create this {what} ({err.strerror or err})") from None
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


MAX_TREE_ENTRIES = 1_000_000  # a tracker's store of this many entries is not one twinrun wrote


def refuse_links_under(root: Path, what: str) -> None:
    """Every entry under `root` (a tracker's store) a directory, a regular file of one link or a symlink
    that resolves inside `root` (W&B keeps some), walked without following links, else a StoreError
    naming the first other entry: a tracker's package opens its files by name (SQLite's mlflow.db and
    its journals, TensorBoard's run folders, W&B's run directories), so a link planted there would carry
    its writes into a file outside the store."""
    root, seen = Path(root), 0
    inside, stack = os.path.realpath(root), [root]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        except OSError as err:
            raise StoreError(folder, f"cannot be listed ({err.strerror})") from None
        for entry in entries:
            seen += 1
            if seen > MAX_TREE_ENTRIES:
                raise StoreError(root, f"holds more than {MAX_TREE_ENTRIES:,} entries: not a {what} twinrun "
                                 "would write into; choose another directory")
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                stack.append(Path(entry.path))
            elif stat.S_ISLNK(st.st_mode) and _within(os.path.realpath(entry.path), inside):
                continue  # the tracker's own pointers (W&B's latest-run, debug.log): what they name is walked
            elif stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else f"a hard link ({st.st_nlink} names)"
                        if stat.S_ISREG(st.st_mode) else f"a {_kind(st.st_mode)}")
                raise StoreError(entry.path, f"is {kind} inside the {what}: refusing to let the tracker "
                                 "write through it into a file elsewhere; remove it and run again")


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
