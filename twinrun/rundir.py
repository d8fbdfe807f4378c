"""The run directory's one owner: every path in it (RunDir) and run.json as a validated record (RunIndex).

A run directory is untrusted input (it may come from anyone): every name read from it is checked
against SAFE_NAME and every path resolved inside the directory before it is opened or written, and
run.json is validated field by field before anyone reads it, so a malformed one is one line naming
the file and the field (exit 2), never a traceback or a number.
"""

import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Literal, NotRequired, TypedDict

from twinrun.errors import StoreError

RUN_FORMAT = "twinrun-run/1"
RUN_JSON = "run.json"
SUMMARY_JSON = "summary.json"
LAUNCH_JSON = "launch.json"
CONFIG_DIFF_JSON = "config_diff.json"
LOCK_NAME = ".lock"
INDEX_LOCK_NAME = ".run.json.lock"  # held for one read-modify-write of run.json, never longer
ARMS_DIR = "arms"
ENV_DIR = "env"
ARM_CONFIG = "config.yaml"
VIEWS_DIR = "views"
LOG_NAME = "twinrun.log"
REPORT_MD = "report.md"  # in the run directory and in each post-hoc view
EFFECT_PNG = "effect.png"

# Arm directories and store files: one path component, no traversal, nothing a shell expands.
SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
GATE_REPLICATE = "native_replicate"  # the twin measured again at gate bins (twinrun/gates.py)
ROLES = ("intervention", "twin", "replicate", "machinery")
RUN_STATUSES = ("planned", "running", "measured", "failed", "interrupted")
STORE_STATUSES = ("pending", "done", "failed")
HEX = re.compile(r"[0-9a-f]+")


def safe_name(value, what: str, where) -> str:
    """`value` as a single safe path component, else a StoreError naming `where` and `what`."""
    if not isinstance(value, str) or not SAFE_NAME.fullmatch(value) or ".." in value or value == ".":
        raise StoreError(where, f"{what}={value!r} is not a safe name (letters, digits, '_', '.', '-'; "
                         "no '..'): refusing a path that could leave the run directory")
    return value


class RunDir:
    """Every path of one run directory; each name is validated and each path kept inside it."""

    def __init__(self, path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def run_json(self) -> Path:
        return self.path / RUN_JSON

    @property
    def summary_json(self) -> Path:
        return self.path / SUMMARY_JSON

    @property
    def launch_json(self) -> Path:
        return self.path / LAUNCH_JSON

    @property
    def config_diff_json(self) -> Path:
        return self.path / CONFIG_DIFF_JSON

    @property
    def lock(self) -> Path:
        return self.path / LOCK_NAME

    @property
    def index_lock(self) -> Path:
        return self.path / INDEX_LOCK_NAME

    def bin_lock(self, index: int) -> Path:
        """Held by the one process measuring this bin (an array element of launcher.split=bins)."""
        return self.path / f"{LOCK_NAME}-bin{int(index):03d}"

    @property
    def env_dir(self) -> Path:
        return self.inside(self.path / ENV_DIR)  # start_job writes here: a symlinked env/ is refused

    @property
    def log(self) -> Path:
        return self.path / LOG_NAME

    def view_dir(self, name: str) -> Path:
        """A post-hoc view's directory (RUN/views/<what changed>/)."""
        return self.inside(self.path / VIEWS_DIR / name)

    def job_env(self, index: int) -> Path:
        return self.inside(self.env_dir / f"job{int(index):03d}.json")

    def kernel_path_env(self, sha: str) -> Path:
        return self.inside(self.env_dir / f"kernel_path-{sha[:12]}.json")

    def arm_dir(self, arm: str) -> Path:
        return self.inside(self.path / ARMS_DIR / safe_name(arm, "arm name", self.run_json))

    def arm_config(self, arm: str) -> Path:
        return self.inside(self.arm_dir(arm) / ARM_CONFIG)

    def store(self, arm: str, file: str) -> Path:
        return self.inside(self.arm_dir(arm) / safe_name(file, f"store file of arm {arm}", self.run_json))

    def tmp_files(self) -> list[Path]:
        """Writes cut short by a kill (atomic_write's temp files): never read, safe to delete."""
        return [p for p in self.path.glob(f"{ARMS_DIR}/*/.*.tmp-*") if self._is_inside(p)]

    def inside(self, path: Path) -> Path:
        """`path` itself, once its resolved form (symlinks followed) is inside this run directory."""
        if not self._is_inside(path):
            raise StoreError(path, f"resolves outside the run directory {self.path} (a symlink or '..'): refused")
        return path

    def _is_inside(self, path: Path) -> bool:
        return Path(path).resolve().is_relative_to(self.path.resolve())

    def is_run(self) -> bool:
        """Holds a run.json (of any kind: whether it is a readable one is read_json's to say)."""
        return os.path.lexists(self.run_json)

    def require(self) -> "RunDir":
        """A run directory given on a command line: it must hold run.json."""
        if not self.is_run():
            raise StoreError(self.path, f"not a twinrun run directory (no {RUN_JSON})")
        return self


# ----------------------------------------------------------------------------- run.json schema


class _Check:
    """Field checks for one document; each failure names the file and the field's path."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, field: str, problem: str) -> "NoReturn":  # noqa: F821
        raise StoreError(self.path, f"field {field}: {problem}; the file is damaged or was edited by hand")

    def get(self, obj: dict, key: str, field: str, types, optional: bool = False):
        if key not in obj:
            if optional:
                return None
            self.fail(field, "missing")
        value = obj[key]
        if value is None and optional:
            return None
        # bool is an int in Python; a count or index must not be one.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            self.fail(field, f"{_show(value)} is not {_type_names(types)}")
        return value

    def number(self, obj: dict, key: str, field: str, low: float = -math.inf, optional: bool = False):
        value = self.get(obj, key, field, (int, float), optional)
        if value is not None and not (math.isfinite(value) and value > low):
            self.fail(field, f"{_show(value)} must be finite and > {low:g}")
        return value

    def one_of(self, obj: dict, key: str, field: str, choices) -> str:
        value = self.get(obj, key, field, str)
        if value not in choices:
            self.fail(field, f"{_show(value)} is not one of {', '.join(choices)}")
        return value

    def hex_digest(self, obj: dict, key: str, field: str, optional: bool = False) -> str | None:
        value = self.get(obj, key, field, str, optional)
        if value is not None and not HEX.fullmatch(value):
            self.fail(field, f"{_show(value)} is not a hex digest")
        return value


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _type_names(types) -> str:
    return " or ".join({"str": "a string", "int": "an integer", "float": "a number", "bool": "true/false",
                        "list": "a list", "dict": "an object"}[t.__name__] for t in _tuple(types))


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ----------------------------------------------------------------------------- run.json, typed
# The types below are run.json's one description: readers annotate with them, and validate_run
# checks a document against them field by field (a field typed `X | None` may be null or absent,
# NotRequired[X] may be absent). Annotated marks add what a Python type cannot say; the few rules
# across fields (roles, positions, store sets) follow in validate_run.
HexDigest = Annotated[str, "hex digest"]
SafeName = Annotated[str, "safe name"]
Sigma = Annotated[float, "positive"]  # finite and > 0
RunStatus = Literal["planned", "running", "measured", "failed", "interrupted"]
StoreStatus = Literal["pending", "done", "failed"]
Role = Literal["intervention", "twin", "replicate", "machinery"]


class ArmEntry(TypedDict):
    name: SafeName  # its directory under arms/
    role: Role
    config_hash: HexDigest  # of its resolved config.yaml (run.config_hash)


class Failure(TypedDict):
    """Where the run failed (plus, when the model raised, its exception's type, message, frame)."""

    arm: str
    bin_index: int
    sigma: Sigma


class StoreEntry(TypedDict):
    file: SafeName  # in arms/<arm>/
    status: StoreStatus
    sha256: NotRequired[HexDigest | None]  # of the whole file; present once done
    kernel_path_sha256: NotRequired[HexDigest | None]  # the kernel path it was measured on
    # why it failed (each array element of a split run records its own; run.json's `failure` is the latest)
    failure: NotRequired[Failure | None]


class BinEntry(TypedDict):
    index: int  # its position in `bins`
    sigma: Sigma  # noising σ
    gate: bool  # a no-op gate bin of the intervention
    stores: dict[str, StoreEntry]  # arm name -> its store (every arm, plus the gate replicate's)


class Registered(TypedDict):
    """The analysis registered at plan time (`reduce` with other settings is a post-hoc view)."""

    estimands: list[str]  # names from the registry (twinrun/estimands.py)
    gate_rule: str
    signal_alpha: Annotated[float, "positive"]  # in (0, 1)


class JobRecord(TypedDict):
    index: int  # its position in `jobs`
    kernel_path_sha256: HexDigest
    sentinel_start: str
    sentinel_end: str | None  # None while the job runs (or if it died)
    hostname: str | None
    boot_id: str | None
    slurm_job_id: str | None


class RunRecord(TypedDict):
    format: str  # RUN_FORMAT
    status: RunStatus
    command: str | None  # the command that planned it (the report's Reproduce section)
    reference: str | None  # an earlier run directory whose twin is this run's reference
    arms: list[ArmEntry]
    registered: NotRequired[Registered]  # absent in runs planned before registration
    bins: list[BinEntry]
    jobs: NotRequired[list[JobRecord]]
    failure: NotRequired[Failure | None]


assert set(typing.get_args(RunStatus)) == set(RUN_STATUSES) and set(typing.get_args(Role)) == set(ROLES)
assert set(typing.get_args(StoreStatus)) == set(STORE_STATUSES)


def check_typed(c: "_Check", obj, schema: type, field: str):
    """`obj` checked against a TypedDict, field by field (extra keys allowed)."""
    if not isinstance(obj, dict):
        c.fail(field, f"{_show(obj)} is not an object")
    hints = typing.get_type_hints(schema, include_extras=True)
    for key, hint in hints.items():
        _check_field(c, obj, key, f"{field}.{key}" if field else key, hint, key in schema.__required_keys__)
    return obj


def _check_field(c: "_Check", obj: dict, key: str, field: str, hint, required: bool) -> None:
    hint, nullable = _without_none(hint)
    base, marks = (hint.__origin__, hint.__metadata__) if typing.get_origin(hint) is Annotated else (hint, ())
    origin = typing.get_origin(base)
    if key not in obj and not (required and not nullable):
        return
    if origin is Literal:
        c.one_of(obj, key, field, typing.get_args(base))
        return
    value = c.get(obj, key, field, _python_types(base), optional=nullable)
    if value is None:
        return
    for mark in marks:
        _check_mark(c, value, field, mark)
    if origin is list:
        for i, item in enumerate(value):
            _check_item(c, item, f"{field}[{i}]", typing.get_args(base)[0])
    elif origin is dict:
        for k, item in value.items():
            _check_item(c, item, f"{field}.{k}", typing.get_args(base)[1])
    elif typing.is_typeddict(base):
        check_typed(c, value, base, field)


def _check_item(c: "_Check", item, field: str, hint) -> None:
    """One element of a list or dict field, checked as a field of its own."""
    _check_field(c, {"item": item}, "item", field, hint, True)


def _without_none(hint):
    """(the hint without None (and without NotRequired, which __required_keys__ says), whether None is allowed)."""
    if typing.get_origin(hint) is NotRequired:
        hint = typing.get_args(hint)[0]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _python_types(base) -> tuple:
    if typing.is_typeddict(base):
        return (dict,)
    origin = typing.get_origin(base) or base
    return (int, float) if origin is float else (origin,)


def _check_mark(c: "_Check", value, field: str, mark: str) -> None:
    if mark == "hex digest" and not HEX.fullmatch(value):
        c.fail(field, f"{_show(value)} is not a hex digest")
    elif mark == "positive" and not (math.isfinite(value) and value > 0):
        c.fail(field, f"{_show(value)} must be finite and > 0")
    elif mark == "safe name":
        safe_name(value, field, c.path)


def validate_run(path: Path, run: dict) -> RunRecord:
    """run.json checked against RunRecord field by field (extra keys allowed: later versions and other
    tools add some), then the rules across fields."""
    c = _Check(Path(path))
    if run.get("format") != RUN_FORMAT:
        c.fail("format", f"{_show(run.get('format'))} is not {RUN_FORMAT!r} (not a twinrun run index)")
    if "registered" not in run and "estimands" in run:
        _validate_unregistered(c, run)
    elif "registered" not in run:
        c.fail("registered", "missing")
    check_typed(c, run, RunRecord, "")
    names = [a["name"] for a in run["arms"]]
    roles = [a["role"] for a in run["arms"]]
    if roles.count("intervention") != 1 or roles.count("twin") != 1 or len(set(names)) != len(names):
        c.fail("arms", f"roles {roles} with names {names}: need exactly one intervention and one twin, "
               "names unique")
    if "registered" in run:
        _validate_registered(c, run["registered"])
    if not run["bins"]:
        c.fail("bins", "empty: a run has at least one bin")
    for i, b in enumerate(run["bins"]):
        _validate_bin(c, b, i, names)
    _contained(c, names, run["bins"])
    for i, job in enumerate(run.get("jobs", [])):
        if job["index"] != i:
            c.fail(f"jobs[{i}].index", f"{job['index']!r} must equal its position {i}")
    return run


def _validate_unregistered(c: _Check, run: dict) -> None:
    """Runs planned before registration: estimands and a gate threshold at the top level."""
    c.get(run, "estimands", "estimands", list)
    _non_empty_names(c, run["estimands"], "estimands")
    threshold = c.number(run, "gate_threshold", "gate_threshold", low=0)
    if threshold > 1:
        c.fail("gate_threshold", f"{threshold!r} must be in (0, 1]")


def _validate_registered(c: _Check, reg: Registered) -> None:
    _non_empty_names(c, reg["estimands"], "registered.estimands")
    if not 0 < reg["signal_alpha"] < 1:
        c.fail("registered.signal_alpha", f"{reg['signal_alpha']!r} must be in (0, 1)")


def _non_empty_names(c: _Check, estimands, field: str) -> None:
    if not estimands or not all(isinstance(e, str) and SAFE_NAME.fullmatch(e) for e in estimands):
        c.fail(field, f"{_show(estimands)} must be a non-empty list of names")


def _validate_bin(c: _Check, b: BinEntry, i: int, names: list[str]) -> None:
    field = f"bins[{i}]"
    if b["index"] != i:
        c.fail(f"{field}.index", f"{b['index']!r} must equal its position {i}")
    # Every arm has a store in every bin; the twin's gate replicate (measured only where the gate
    # rule needs it) may add one more.
    if not set(names) <= set(b["stores"]) <= set(names) | {GATE_REPLICATE}:
        c.fail(f"{field}.stores", f"arms {sorted(b['stores'])} are not the run's arms {sorted(names)}")
    for arm, entry in b["stores"].items():
        if entry["status"] == "done" and entry.get("sha256") is None:
            c.fail(f"{field}.stores.{arm}.sha256", "missing (the store is recorded done)")


def _contained(c: _Check, names: list[str], bins: list[dict]) -> None:
    """Every arm directory and store file run.json names resolves inside its run directory
    (a symlinked arm directory or store is refused before anyone reads through it)."""
    rd = RunDir(c.path.parent)
    for name in names:
        rd.arm_dir(name)
    for b in bins:
        for arm, entry in b["stores"].items():
            rd.store(arm, entry["file"])


def validate_summary(path: Path, summary: dict) -> dict:
    """summary.json: the fields its readers (sweep summary, compare) rely on."""
    c = _Check(Path(path))
    c.get(summary, "valid", "valid", bool)
    for key in ("checks", "gates", "effects"):
        for i, item in enumerate(c.get(summary, key, key, list)):
            if not isinstance(item, dict):
                c.fail(f"{key}[{i}]", f"{_show(item)} is not an object")
            if key != "effects":
                c.get(item, "passed", f"{key}[{i}].passed", bool)
                continue
            c.number(item, "sigma", f"{key}[{i}].sigma", low=0)
            c.get(item, "estimand", f"{key}[{i}].estimand", str)
            c.number(item, "cos", f"{key}[{i}].cos", optional=True)
            c.number(item, "se", f"{key}[{i}].se", optional=True)
    reference = c.get(summary, "reference", "reference", dict, optional=True)
    if reference is not None:
        c.get(reference, "alive", "reference.alive", bool)
        c.get(reference, "path", "reference.path", str)
        _reference_is_the_runs(c, reference)
    return summary


def _reference_is_the_runs(c: _Check, reference: dict) -> None:
    """A summary may vouch only for the reference its own run.json names (a hand-edited claim
    of "alive" for another run is refused)."""
    from twinrun.store import read_json

    run_json = c.path.parent / RUN_JSON
    if not run_json.is_file():
        c.fail("reference", "present, but there is no run.json beside the summary to confirm it")
    named = read_json(run_json).get("reference")
    if named is None or Path(named).resolve() != Path(reference["path"]).resolve():
        c.fail("reference.path", f"{_show(reference['path'])} is not the reference run.json names ({named!r})")


def validate_store_meta(path: Path, meta: dict) -> dict:
    """A store's metadata (JSON-decoded strings): what reduce, compare and resume read from it."""
    c = _Check(Path(path))
    c.get(meta, "arm", "metadata.arm", str)
    if c.get(meta, "bin_index", "metadata.bin_index", int) < 0:
        c.fail("metadata.bin_index", f"{meta['bin_index']} is negative")
    c.number(meta, "sigma", "metadata.sigma", low=0)
    c.number(meta, "sigma_cond", "metadata.sigma_cond", low=0)
    n_images = c.get(meta, "n_images", "metadata.n_images", int)
    c.get(meta, "n_draws", "metadata.n_draws", int)
    sizes = c.get(meta, "fold_sizes", "metadata.fold_sizes", list)
    if len(sizes) < 2 or not all(type(n) is int and n >= 1 for n in sizes) or sum(sizes) != n_images:
        c.fail("metadata.fold_sizes", f"{_show(sizes)} must be ≥ 2 positive counts summing to n_images={n_images}")
    c.get(meta, "draws_digest", "metadata.draws_digest", str)
    c.get(meta, "config_hash", "metadata.config_hash", str)
    layout = c.get(meta, "layout", "metadata.layout", list)
    offset = 0
    for i, g in enumerate(layout):
        if not isinstance(g, dict):
            c.fail(f"metadata.layout[{i}]", f"{_show(g)} is not an object")
        c.get(g, "name", f"metadata.layout[{i}].name", str)
        c.get(g, "cond", f"metadata.layout[{i}].cond", bool)
        numel = c.get(g, "numel", f"metadata.layout[{i}].numel", int)
        if c.get(g, "offset", f"metadata.layout[{i}].offset", int) != offset or numel < 0:
            c.fail(f"metadata.layout[{i}]", "offsets and sizes do not tile the columns")
        offset += numel
    names = [g["name"] for g in layout]
    if len(set(names)) != len(names):
        c.fail("metadata.layout", "parameter names repeat: each names one tensor of the store")
    for key in ("env", "kernel_path"):
        c.get(meta, key, f"metadata.{key}", dict, optional=True)
    return meta


def validate_launch(path: Path, launch: dict) -> dict:
    """launch.json: the job a run was submitted as (its id reaches squeue/sacct as an argument)."""
    c = _Check(Path(path))
    cluster = c.one_of(launch, "cluster", "cluster", ("local", "slurm"))
    _validate_job_record(c, launch, "", cluster)
    c.get(launch, "folder", "folder", str)
    c.get(launch, "launcher", "launcher", dict)
    # launcher.split=bins: every element's job (its bins, id and logs)
    for i, element in enumerate(c.get(launch, "elements", "elements", list, optional=True) or []):
        if not isinstance(element, dict):
            c.fail(f"elements[{i}]", f"{_show(element)} is not an object")
        bins = c.get(element, "bins", f"elements[{i}].bins", list)
        if not all(type(k) is int and k >= 0 for k in bins):
            c.fail(f"elements[{i}].bins", f"{_show(bins)} is not a list of bin indices")
        _validate_job_record(c, element, f"elements[{i}].", cluster)
    return launch


# A local job's id is its controller's pid, which status signals (kill(pid, 0)): Linux's pids lie in
# [1, 2**22) (pid_max's ceiling); 0 would signal status's own process group.
LOCAL_JOB_ID_END = 2**22


def _validate_job_record(c: _Check, record: dict, where: str, cluster: str) -> None:
    job_id = c.get(record, "job_id", f"{where}job_id", str)
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job_id):
        c.fail(f"{where}job_id", f"{_show(job_id)} is not a job id")
    if cluster == "local" and not (job_id.isdigit() and 1 <= int(job_id) < LOCAL_JOB_ID_END):
        c.fail(f"{where}job_id", f"{_show(job_id)} is not a local job's process id (1 to {LOCAL_JOB_ID_END - 1})")
    for key in ("result", "stdout", "stderr"):
        c.get(record, key, f"{where}{key}", str)


# The documents read_json validates, by file name.
SCHEMAS = {RUN_JSON: validate_run, SUMMARY_JSON: validate_summary, LAUNCH_JSON: validate_launch}


# ----------------------------------------------------------------------------- the record


class RunIndex:
    """run.json, validated, with the questions and updates every module asks of it.

    `doc` is the plain JSON document, typed RunRecord (what is written back); readers that only need
    the data may use it directly, but every change goes through a method here and is saved atomically.
    """

    def __init__(self, run_dir: RunDir, doc: RunRecord):
        self.run_dir, self.doc = run_dir, doc

    @classmethod
    def load(cls, run_dir) -> "RunIndex":
        from twinrun.store import read_json

        rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        return cls(rd, read_json(rd.require().run_json))  # read_json validates run.json

    def save(self) -> None:
        from twinrun.store import write_json

        write_json(self.run_dir.run_json, self.doc)

    # ---- questions

    @property
    def status(self) -> str:
        return self.doc["status"]

    @property
    def bins(self) -> list[BinEntry]:
        return self.doc["bins"]

    @property
    def arm_names(self) -> list[str]:
        return [a["name"] for a in self.doc["arms"]]

    def arm(self, role: Role) -> ArmEntry:
        """The arm entry with this role (intervention, twin, replicate, machinery)."""
        found = [a for a in self.doc["arms"] if a["role"] == role]
        if not found:
            raise StoreError(self.run_dir.run_json, f"no arm with role {role!r}")
        return found[0]

    def store_path(self, b: BinEntry, arm: str) -> Path:
        return self.run_dir.store(arm, b["stores"][arm]["file"])

    def marked_done(self, b: BinEntry) -> bool:
        """Every store of the bin is recorded done (no file is read)."""
        return all(entry["status"] == "done" for entry in b["stores"].values())

    def is_done(self, b: BinEntry, arm: str) -> bool:
        """The store is recorded done, exists, and verifies against its sha256 in run.json."""
        from twinrun.store import verify_store

        entry = b["stores"][arm]
        if entry["status"] != "done":
            return False
        try:
            verify_store(self.store_path(b, arm), entry["sha256"])
        except StoreError as err:
            print(f"twinrun: re-measuring {err}", flush=True)
            return False
        return True

    def whole_bins(self, verify: bool = True, only: list[int] | None = None) -> list[BinEntry]:
        """The bins whose every arm is done (verified on disk unless verify=False). only: verify just
        these bins (an array element's own); the others are judged by their record, no file read."""
        def whole(b: BinEntry) -> bool:
            if not verify or (only is not None and b["index"] not in only):
                return self.marked_done(b)
            return all(self.is_done(b, a) for a in b["stores"])

        return [b for b in self.bins if whole(b)]

    # ---- updates (each a read-modify-write of run.json under its lock)

    def _update(self, change) -> None:
        """Apply `change(doc)` to run.json as it is on disk now and write it back atomically, all under
        RUN_DIR/.run.json.lock: the array elements of a split run update run.json concurrently, and
        none may lose another's record. `self.doc` becomes the document written (same object)."""
        from twinrun.lock import update_lock
        from twinrun.store import read_json, write_json

        with update_lock(self.run_dir.index_lock):
            # A run.json not written yet has no other writer: the document in memory is the record.
            doc = read_json(self.run_dir.run_json) if os.path.lexists(self.run_dir.run_json) else self.doc
            change(doc)
            write_json(self.run_dir.run_json, doc)
        if doc is not self.doc:  # (clearing the very document read back would empty it)
            self.doc.clear()
            self.doc.update(doc)  # in place: callers holding `index.doc` see the fresh document

    def set_status(self, status: str, bins: list[int] | None = None) -> None:
        """bins: the bins this job measures; a failure recorded at another bin (another array
        element's) is kept, and so is the run's "failed" status."""
        assert status in RUN_STATUSES, status

        def change(doc: dict) -> None:
            failure = doc.get("failure")
            other = bins is not None and failure is not None and failure["bin_index"] not in bins
            if status == "running" and not other:
                doc.pop("failure", None)
            if status == "running":  # this job's bins start afresh; another element's failures stay
                for b in doc["bins"]:
                    if bins is None or b["index"] in bins:
                        for entry in b["stores"].values():
                            entry.pop("failure", None)
            if not (status == "running" and other):
                doc["status"] = status

        self._update(change)

    def finish_measuring(self) -> None:
        """The run is "measured" once every bin is whole, whichever job or array element ends last;
        until then its status stays as it is (another element may still be measuring)."""
        def change(doc: dict) -> None:
            if all(e["status"] == "done" for b in doc["bins"] for e in b["stores"].values()):
                doc["status"] = "measured"

        self._update(change)

    def add_job(self, job: JobRecord) -> int:
        """Append this job's record to run.json's `jobs`; its index is its position there."""
        def change(doc: dict) -> None:
            jobs = doc.setdefault("jobs", [])
            job["index"] = len(jobs)
            jobs.append({"index": job["index"], **job})

        self._update(change)
        return job["index"]

    def end_job(self, index: int, sentinel_end: str) -> None:
        def change(doc: dict) -> None:
            doc["jobs"][index]["sentinel_end"] = sentinel_end

        self._update(change)

    def mark_done(self, b: dict, arm: str, sha256: str, kernel_path_sha256: str) -> None:
        """Record the store done, unless a whole bin of run.json as it is now (another array element's,
        finished since this job started) holds another kernel path: KernelPathRefused (exit 3)."""
        from twinrun.provenance import KernelPathRefused

        def change(doc: dict) -> None:
            others = {e.get("kernel_path_sha256") for other in doc["bins"] if other["index"] != b["index"]
                      and all(e["status"] == "done" for e in other["stores"].values())
                      for e in other["stores"].values()} - {kernel_path_sha256, None}
            if others:
                raise KernelPathRefused(
                    f"{self.run_dir.path}: bin {b['index']}: another job finished bins of this run on another "
                    "kernel path meanwhile; twins must not straddle environments: resume it where those "
                    "bins ran, or start a new run directory")
            doc["bins"][b["index"]]["stores"][arm].update(sha256=sha256, status="done",
                                                        kernel_path_sha256=kernel_path_sha256)

        self._update(change)

    def mark_failed(self, b: dict, arm: str, cause: dict | None = None) -> None:
        """Record which arm and bin failed (and, when the model raised, its exception's type, message
        and frame); best effort (on a full disk run.json may not be writable)."""
        def change(doc: dict) -> None:
            failure = {"arm": arm, "bin_index": b["index"], "sigma": b["sigma"], **(cause or {})}
            doc["bins"][b["index"]]["stores"][arm].update(status="failed", failure=failure)
            doc["status"] = "failed"
            doc["failure"] = failure  # the latest; the bin's store entry keeps its own

        self._update_best_effort(change)

    def mark_interrupted(self, bins: list[int] | None = None) -> None:
        """The run is "interrupted" (resume continues); not so when one array element (`bins`) was:
        the others may still be measuring, and its bins stay pending for a resume."""
        def change(doc: dict) -> None:
            if bins is None:
                doc["status"] = "interrupted"

        self._update_best_effort(change)

    def _update_best_effort(self, change) -> None:
        try:
            self._update(change)
        except StoreError as err:
            print(f"twinrun: could not record the state in run.json: {err}", flush=True)
