"""torch.compile's caches as the fingerprint sees them: where Inductor and Triton cache, and a digest of
what they hold (their autotune winners choose kernels, so a cache's content is part of the kernel path).

Every run compiles into a cache of its own (`run_cache_dir`): a cache shared between runs would take
the entries of whatever other run compiled in between, and a resume would then read another digest
and be refused as another kernel path. The digest covers, by content, every entry that decides
kernels (`_dir_digest`).
"""

import getpass
import hashlib
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from twinrun.files import create_once

# Inductor exports these itself on first compile; their resolved paths are read separately.
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
# Beside a run's own inductor/ and triton/ folders: names the run (and marks the folder twinrun's).
RUN_CACHE_MARKER = "twinrun-run-cache.txt"
# Beside the inductor/ and triton/ folders twinrun points a process at outside a run's own (an eager
# job, `python -m twinrun.env`): marks them twinrun's, so a child process that inherits the variables
# does not take them for the user's own choice and compile into them (they are shared, not a run's).
CACHE_MARKER = "twinrun-cache.txt"
CACHE_FOLDERS = ("inductor", "triton")  # what twinrun names Inductor's and Triton's caches in a home


def _run_cache_home(root: str, run_dir) -> tuple[str, str]:
    """(where a run's compile caches live under `root`, the marker text naming that run)."""
    where = os.path.realpath(run_dir)
    home = os.path.join(os.path.abspath(root), "runs", hashlib.sha256(where.encode()).hexdigest()[:16])
    return home, f"torch.compile caches of the twinrun run at {where}\n"


def run_cache_dir(root: str, run_dir) -> str:
    """The compile caches of one run under `root` (determinism.compile_cache_dir): `root/runs/<key>`,
    keyed by the run directory's resolved path, so a resume finds its own cache and no other run
    writes into it. Safe to delete once the run is finished (a resume would then recompile on
    another kernel path, and be refused)."""
    home, text = _run_cache_home(root, run_dir)
    os.makedirs(home, exist_ok=True)
    # Created exclusively, never through a link planted at its name (a dangling symlink was followed).
    create_once(Path(home) / RUN_CACHE_MARKER, text.encode(), "compile-cache marker")
    return home


def is_run_cache(cache_dir: str) -> bool:
    """Whether a cache dir (…/inductor, …/triton) is inside a run's own compile cache (twinrun set it)."""
    return os.path.isfile(os.path.join(os.path.dirname(os.path.abspath(cache_dir)), RUN_CACHE_MARKER))


def is_twinrun_cache(cache_dir: str) -> bool:
    """Whether twinrun chose a cache dir (a run's own, or the shared one of an eager job), not the user."""
    cache_dir = os.path.abspath(cache_dir)
    home, name = os.path.split(cache_dir)
    # Only the folders twinrun names there: a user's own cache may sit beside them in that home.
    marked = is_run_cache(cache_dir) or os.path.isfile(os.path.join(home, CACHE_MARKER))
    return name in CACHE_FOLDERS and marked


def mark_twinrun_cache(home: str) -> None:
    """Mark `home` (holding inductor/ and triton/) as twinrun's choice; a run's own is marked already."""
    if not os.path.isfile(os.path.join(home, RUN_CACHE_MARKER)):
        create_once(Path(home) / CACHE_MARKER, b"torch.compile caches twinrun chose (not a run's own)\n",
                    "compile-cache marker")


def ours_alone(path) -> bool:
    """`path` (not followed) belongs to this user and no one else may write it: a library copied from a
    cache another user could write would be native code of theirs that Inductor loads."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def existing_run_cache(root: str, run_dir) -> str | None:
    """The Inductor cache a run compiled into under `root` on this machine, when it is still there, its
    marker (a regular file) names that run, and it is this user's alone (a node-shared compile_cache_dir
    lets others create a run's predictable folder); None otherwise. Nothing is created."""
    home, text = _run_cache_home(root, run_dir)
    marker = os.path.join(home, RUN_CACHE_MARKER)
    inductor = os.path.join(home, "inductor")
    if not all(ours_alone(p) for p in (home, marker, inductor)):
        return None
    try:
        st = os.stat(marker, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096 or Path(marker).read_text() != text:
            return None
    except (OSError, UnicodeDecodeError):
        return None
    return inductor if os.path.isdir(inductor) and not os.path.islink(inductor) else None


# Inductor's C++ libraries: `<2 characters of the key>/<key>[.suffix].so`, the key a hash of the
# generated source and its compile command; a library present at its key is loaded, not rebuilt.
_LIBRARY = re.compile(r"[a-z0-9]{2}/[a-z0-9_]+(\.[a-z0-9_]+)?\.so")


def reuse_built_libraries(source: str, own: str) -> dict:
    """Copy the C++ libraries Inductor built in `source` (another run's own cache on this machine) into
    `own` (this run's, still cold) at their keys, so a replay loads them instead of running the C++
    compiler again. Only regular files at Inductor's key paths; one already in `own` is kept."""
    copied = size = 0
    for path in sorted(Path(source).glob("*/*.so")):
        rel = path.relative_to(source).as_posix()
        target = Path(own) / rel
        if (not _LIBRARY.fullmatch(rel) or path.is_symlink() or path.parent.is_symlink() or not path.is_file()
                or target.exists() or not (ours_alone(path) and ours_alone(path.parent))):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target, follow_symlinks=False)
        copied, size = copied + 1, size + target.stat().st_size
    return {"from": source, "libraries": copied, "bytes": size}


def compile_caches() -> dict:
    """Resolved Inductor/Triton cache dirs with a digest of their content (or "absent")."""
    inductor = os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_inductor_cache_dir())
    caches = {"inductor": {"path": inductor, **_dir_digest(inductor)}}
    # Unset, Inductor puts Triton's cache at <inductor>/triton/<device>, already covered above.
    triton = os.environ.get("TRITON_CACHE_DIR")
    if triton is None or _is_within(os.path.abspath(triton), inductor):
        caches["triton"] = {"path": triton, "digest": "within inductor cache"}
    else:
        caches["triton"] = {"path": os.path.abspath(triton), **_dir_digest(triton)}
    return caches


def autotune_choices(caches: dict) -> dict:
    """sha256 over the content of the autotuner's recorded winners (Triton's `*.best_config` files,
    Inductor's autotune JSON) in the caches: a re-autotune that crowns other winners moves it even
    where the rest of the cache digest would not tell why."""
    h, files = hashlib.sha256(), 0
    for entry in caches.values():
        root = entry.get("path")
        if not root or not os.path.isdir(root):
            continue
        for path in sorted(Path(root).rglob("*")):
            if path.is_file() and not path.is_symlink() and (path.suffix == ".best_config"
                                                             or "autotune" in path.name):
                h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
                files += 1
    return {"digest": h.hexdigest() if files else "none", "files": files}


def default_inductor_cache_dir() -> str:
    """Where Inductor caches when TORCHINDUCTOR_CACHE_DIR is unset: `<tempdir>/torchinductor_<user>`."""
    # Mirrors torch._inductor.runtime.cache_dir_utils.default_cache_dir without importing Inductor.
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


# The entries that decide kernels: Inductor's FX-graph entries (each holds its graph's generated code,
# so every chosen kernel), AOTAutograd's, and the autotuners' recorded winners. The rest of a cache is
# code those entries generated, stored under a hash of its content (`.py`, `.cpp`, the `.so` built from
# it, whose bytes also carry the build's paths), scratch compiled only to be timed, and measured
# timings (read only by a compile that misses, which writes a new entry). A replay's cache is filled
# from its source's bundle with byte-identical entries, so its digest is its source's.
DECISION_FOLDERS = ("fxgraph", "aotautograd")


def _is_decision(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return rel.split("/", 1)[0] in DECISION_FOLDERS or name.endswith(".best_config") or "autotune" in name


def _dir_digest(root: str) -> dict:
    """sha256 over (relative path, sha256 of the content) of every entry that decides kernels
    (`_is_decision`), in sorted walk order: content, not modification times, so two caches holding the
    same decisions (a pinned replay and its source) read alike wherever and whenever they were written.

    A missing and an empty directory are both "absent": torch creates the empty one on import.
    """
    if not os.path.isdir(root):
        return {"digest": "absent", "files": 0}
    h, files = hashlib.sha256(), 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Lock files are rewritten by every compile; they hold no kernels.
        dirnames[:] = sorted(d for d in dirnames if d != "locks")
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            rel = Path(os.path.relpath(path, root)).as_posix()
            if name.endswith(".lock") or not _is_decision(rel) or os.path.islink(path):
                continue
            try:
                content = Path(path).read_bytes()
            except (FileNotFoundError, IsADirectoryError):  # removed by a concurrent writer since the listing
                continue
            h.update(f"{rel}\0{hashlib.sha256(content).hexdigest()}\n".encode())
            files += 1
    return {"digest": h.hexdigest() if files else "absent", "files": files}


def _is_within(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root
